import argparse
import re

import pytest

from megascope.cli import build_parser
from megascope.trainer.cli import resolve_config
from megascope.trainer.config import ConfigError, JobConfig, validate
from megascope.trainer.robust.faults import Faults, FaultSpecError, parse_spec


def parse(*argv: str) -> argparse.Namespace:
    return build_parser("train").parse_args(["train", *argv])


def test_precedence_defaults_preset_toml_flags(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[model]\nhidden = 96\nn_heads = 4\n[train]\nsteps = 7\nlr = 0.01\n")
    cfg = resolve_config(parse("--preset", "tiny", "--config", str(toml), "--lr", "0.02",
                               "--set", "trace.flush_interval_s=0.5"))
    assert cfg.model.hidden == 96          # TOML over preset (tiny has 64)
    assert cfg.model.seq_len == 64        # preset over default
    assert cfg.train.steps == 7           # TOML over default
    assert cfg.train.lr == 0.02           # flag over TOML
    assert cfg.trace.flush_interval_s == 0.5


def test_bool_flags_accept_on_off():
    cfg = resolve_config(parse("--zero", "off", "--trace", "off", "--parallel-block", "on"))
    assert cfg.parallel.zero is False and cfg.trace.enabled is False and cfg.model.parallel_block is True


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    (["--pp", "3"], "n_layers=4 is not divisible by pp*vpp=3"),
    (["--dp", "3"], "not divisible by micro_batch*dp"),
    (["--vpp", "2"], "needs --pp > 1"),
    (["--optimizer", "sgd"], "optimizer 'sgd' unknown"),
    (["--set", "train.backend=mpi"], "backend 'mpi' unknown"),
    (["--device", "cpu", "--set", "train.backend=nccl"], "train.backend=nccl needs --device cuda"),
    (["--device", "cuda", "--set", "train.backend=gloo", "--dp", "2"], "set --set parallel.zero=false"),
    (["--device", "cuda", "--set", "train.backend=gloo", "--zero", "off", "--pp", "2"], "--pp 1"),
])
def test_invalid_layouts_say_what_to_change(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_config(parse("--preset", "tiny", *flags))


def test_world_size_mismatch():
    cfg = JobConfig()
    cfg.parallel.dp = 2
    with pytest.raises(ConfigError, match="dp\\*tp\\*pp = 2\\*1\\*1 = 2 but the job has 4 processes"):
        validate(cfg, world_size=4)


def test_unknown_toml_key_is_refused(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[model]\nhiden = 96\n")
    with pytest.raises(ConfigError, match="unknown option model.hiden"):
        resolve_config(parse("--config", str(toml)))


def test_cli_reports_config_errors_without_traceback(capsys):
    from megascope.cli import main

    assert main(["train", "--tp", "3"]) == 2
    assert "n_heads=4 is not divisible by tp=3" in capsys.readouterr().err


def test_fault_specs_parse_and_validate():
    s = parse_spec("straggler:rank=3,slowdown=1.5,from=10", world_size=4)
    assert s.ranks == (3,) and s.params["slowdown"] == 1.5 and not s.active(9) and s.active(10)
    f = parse_spec("flap:ranks=0-2,down_ms=50,period_steps=4", world_size=4)
    assert f.ranks == (0, 2)
    with pytest.raises(FaultSpecError, match="outside the world"):
        parse_spec("hang:rank=9,at=3", world_size=4)
    with pytest.raises(FaultSpecError, match="missing slowdown"):
        parse_spec("straggler:rank=1", world_size=4)
    with pytest.raises(FaultSpecError, match="unknown fault"):
        parse_spec("meltdown:rank=1", world_size=4)
    with pytest.raises(FaultSpecError):
        resolve_config(parse("--inject", "late_launch:rank=0"))


def test_flap_stalls_only_the_link_in_down_phases(monkeypatch):
    slept = []
    monkeypatch.setattr("time.sleep", lambda s: slept.append(s))
    f = Faults([parse_spec("flap:ranks=0-2,down_ms=50,period_steps=4", world_size=4)], rank=0)
    for step in range(8):
        f.step = step
        f.before_p2p([2])
        f.before_p2p([1])  # another link: never stalls
    assert slept == [0.05] * 4  # steps 2,3 and 6,7 are down


def test_config_reference_is_current():
    from pathlib import Path

    from megascope.trainer.config_docs import markdown

    doc = Path(__file__).parent.parent / "docs" / "config.md"
    assert doc.read_text().strip() == markdown().strip(), \
        "docs/config.md is stale: python -m megascope.trainer.config_docs > docs/config.md"


def test_train_help_explains_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser("train").parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "[parallel.tp] Tensor-parallel degree" in out and "--inject" in out


def test_gloo_on_a_gpu_is_accepted_for_plain_data_parallelism():
    cfg = resolve_config(parse("--preset", "tiny", "--device", "cuda", "--dp", "2", "--zero", "off",
                               "--set", "train.backend=gloo"))
    assert cfg.train.backend == "gloo"

