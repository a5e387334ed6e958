"""DCP checkpoints (trainer/robust/checkpoint_dcp.py) reshard across data parallelism: a dp=2 ZeRO job saves
asynchronously, and a job restarted with ONE replica (a node excluded, no spare) resumes from it at the
same step with the loss continuing as the uninterrupted dp=2 run's; through the real `megascope train`
(--resume with --dp 1) and through the trainer API (also to an fsspec URL and from a non-ZeRO save). A
damaged checkpoint is skipped or refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import JobConfig
from megascope.trainer.robust import checkpoint as ck
from megascope.trainer.robust.checkpoint_format import make_checkpoint_manager
from tests.run_steps import losses

STEPS, SAVE_AT = 6, 3


def make_cfg(run_dir: str, dp: int, zero: bool = True, checkpoint_dir: str = "") -> JobConfig:
    cfg = JobConfig()
    cfg.run_dir = run_dir
    cfg.model.n_layers, cfg.model.hidden, cfg.model.n_heads, cfg.model.seq_len = 2, 32, 2, 16
    cfg.train.global_batch, cfg.train.micro_batch, cfg.train.warmup_steps = 8, 2, 2
    cfg.train.steps = STEPS
    cfg.parallel.dp, cfg.parallel.zero = dp, zero
    cfg.trace.enabled = False
    cfg.robust.checkpoint_format, cfg.robust.checkpoint_dir = "dcp", checkpoint_dir
    return cfg


def _train(cfg: JobConfig, rank: int, resume: bool) -> dict:
    from megascope.trainer.data import build_loader
    from megascope.trainer.lr_schedule import learning_rate
    from megascope.trainer.parallel.parallel_dims import ParallelDims
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.robust.faults import Faults
    from megascope.trainer.step import train_step

    p = cfg.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp, p.vpp)
    dims.build_groups()
    state = parallelize(cfg, dims, torch.device("cpu"), Faults([], rank))
    manager = make_checkpoint_manager(cfg, dims, rank, torch.device("cpu"))
    start = manager.resume(state) if resume else 0
    loader = build_loader(cfg, dims, rank, torch.device("cpu"), start_step=start)
    losses = {}
    try:
        for step in range(start, STEPS):
            batch, _ = loader.next()
            losses[step] = train_step(state, batch, learning_rate(cfg.train, step)).loss
            if not resume and step + 1 == SAVE_AT:
                manager.save(step + 1, state)
    finally:
        loader.close()
        manager.close()
    return {"start": start, "losses": losses, "errors": manager.errors}


def api_worker(rank: int, world: int, run_dir: str, dp: int, zero: bool, resume: bool, ckpt_dir: str) -> dict:
    return _train(make_cfg(run_dir, dp, zero, ckpt_dir), rank, resume)


@pytest.mark.parametrize("zero,url", [(True, False), (False, True)])
def test_dp2_save_resumes_on_dp1_through_the_api(tmp_path, zero, url):
    ckpt_dir = f"file://{tmp_path}/ckpt" if url else ""  # a URL goes through DCP's FsspecWriter/Reader
    saved = run_distributed(api_worker, 2, str(tmp_path), 2, zero, False, ckpt_dir)
    assert all(not r["errors"] for r in saved)
    info = ck.latest_complete_at(ckpt_dir or ck.checkpoint_root(tmp_path))
    assert info is not None and info.step == SAVE_AT and info.manifest["format"] == "dcp"
    assert ".metadata" in info.manifest["files"] and info.manifest["layout"]["dp"] == 2
    [resumed] = run_distributed(api_worker, 1, str(tmp_path), 1, True, True, ckpt_dir)
    assert resumed["start"] == SAVE_AT
    reference = saved[0]["losses"]
    for step in range(SAVE_AT, STEPS):  # dp=1 sums the same global batch in another order: close, not equal
        assert resumed["losses"][step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), step


def test_a_damaged_checkpoint_is_skipped_and_said(tmp_path):
    saved = run_distributed(api_worker, 2, str(tmp_path), 2, True, False, "")
    assert all(not r["errors"] for r in saved)
    info = ck.latest_complete(tmp_path)
    data = sorted(p for p in info.path.glob("*.distcp"))
    data[0].write_bytes(data[0].read_bytes()[:100])  # truncated: a disk that filled up, a partial copy
    problems: list[str] = []
    assert ck.latest_complete_at(ck.checkpoint_root(tmp_path), problems=problems) is None
    assert len(problems) == 1 and f"file {data[0].name} has 100 bytes, the manifest says" in problems[0]


# ---------------------------------------------------------------------- the real `megascope train`

TRAIN = [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--steps", str(STEPS),
         "--set", "robust.checkpoint_every=3", "--set", "robust.checkpoint_format=dcp",
         "--set", "trace.flush_interval_s=0.5"]


@pytest.mark.slow
def test_megascope_train_dp2_checkpoint_resumes_with_dp1(tmp_path):
    full = tmp_path / "dp2"
    result = subprocess.run(TRAIN + ["--dp", "2", "--run-dir", str(full)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # the run as it stood after its step-3 checkpoint: what a job that lost a node leaves behind
    cut = tmp_path / "dp1"
    cut.mkdir()
    shutil.copy(full / "run.json", cut / "run.json")
    shutil.copytree(ck.step_dir(full, SAVE_AT), ck.step_dir(cut, SAVE_AT))
    result = subprocess.run(TRAIN + ["--dp", "1", "--run-dir", str(cut), "--resume"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from checkpoint step {SAVE_AT}" in result.stdout, result.stdout[-2000:]
    reference, got = losses(full), losses(cut)
    assert sorted(got) == list(range(SAVE_AT, STEPS))
    for step in got:
        assert got[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), step
    assert json.loads((cut / "run.json").read_text())["config"]["parallel"]["dp"] == 1

    # every checkpoint of the dp=2 run truncated: --resume refuses in one line that says why, nothing runs
    saved = ck.list_complete(full)
    assert [c.step for c in saved] == [SAVE_AT, STEPS]
    for info in saved:
        sorted(info.path.glob("*.distcp"))[-1].write_bytes(b"")
    result = subprocess.run(TRAIN + ["--dp", "1", "--run-dir", str(full), "--resume", "--steps", "9"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no complete checkpoint" in lines[0], lines
    assert lines[0].count("has 0 bytes, the manifest says") == 2 and "[megascope] launching" not in result.stdout
