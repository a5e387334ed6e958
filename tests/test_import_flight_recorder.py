"""Flight-recorder import: real dumps from this torch build's gloo flight recorder (a world of 3 where
rank 2 never joins an all-reduce) name the rank that never joined; a dump in the NCCL format with
tp/dp groups does too; bad dumps give a clear message."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megascope.analyzer import Run
from megascope.cli import main
from megascope.samples.distributed import run_distributed
from megascope.tracer.importers.cli import import_run
from megascope.tracer.importers.writer import ImportInputError

HAS_FR = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")


def _hang_and_dump(rank: int, world: int, out: str, straggler_dumps: bool) -> int:
    """Three world all-reduces and one on a pair group complete; then ranks 0 and 1 start a fourth
    world all-reduce that rank 2 joins only after their dumps are written (it 'hangs' until then)."""
    pair = dist.new_group([0, 1])
    x = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(x)
    if rank < 2:
        dist.all_reduce(x, group=pair)
    path = Path(out) / f"fr_trace_rank_{rank}"
    if rank < 2:
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.3)
        path.write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
        work.wait()
    else:
        if straggler_dumps:  # its dump shows it never enqueued the fourth all-reduce
            path.write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
        deadline = time.monotonic() + 60
        while not all((Path(out) / f"fr_trace_rank_{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
        dist.all_reduce(x)
    return rank


@pytest.mark.slow
@pytest.mark.skipif(not HAS_FR, reason="this torch build has no flight recorder (_dump_fr_trace)")
@pytest.mark.parametrize("straggler_dumps", [False, True])
def test_real_gloo_dumps_name_the_rank_that_never_joined(tmp_path: Path, monkeypatch, straggler_dumps: bool):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # spawned ranks inherit it: the recorder is on
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    run_distributed(_hang_and_dump, 3, str(dumps), straggler_dumps)
    out = tmp_path / "run"
    args = ["import", "flight-recorder", str(dumps), "--out", str(out)]
    if not straggler_dumps:  # rank 2 wrote nothing: the world size must come from the command line
        args += ["--dp", "3"]
    assert main(args) == 0
    hang = Run.open(out).hang()
    assert hang is not None and hang.suspects == [2], hang
    assert hang.waiting == [0, 1] and hang.op.startswith("all_reduce")
    assert "outside any recorded training step" in hang.summary and "unknown" not in hang.summary
    run = Run.open(out)
    ev = run.events(steps=(-1, -1), ranks=[0])
    assert list(ev[ev.group == "dp"].seq) == [0, 1, 2]  # completed world all-reduces, 0-based like ours
    assert run.manifest["source"] == "import:flight-recorder"


def _entry(pg: tuple[str, str], seq: int, t: int, retired: bool, name: str = "nccl:all_reduce") -> dict:
    return {"record_id": seq, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": name, "time_created_ns": t, "input_sizes": [[1024]],
            "input_dtypes": ["BFloat16"], "output_sizes": [[1024]], "output_dtypes": ["BFloat16"],
            "state": "completed" if retired else "started", "time_discovered_started_ns": t + 10,
            "time_discovered_completed_ns": t + 500 if retired else None, "retired": retired,
            "timeout_ms": 600000, "is_p2p": False, "frames": []}


def test_nccl_format_dump_with_tp_groups(tmp_path: Path):
    """World 4 = dp 2 x tp 2 (documented NCCL dump format, pg_config listing ranks). Rank 3 is stuck in
    its tp all-reduce; rank 2 waits there for it; ranks 0 and 1 wait in the dp all-reduce for 2 and 3."""
    pgs = {"0": ("0", "default_pg", [0, 1, 2, 3]), "1": ("1", "tp0", [0, 1]), "2": ("2", "tp1", [2, 3]),
           "3": ("3", "dp0", [0, 2]), "4": ("4", "dp1", [1, 3])}
    config = {name: {"name": name, "desc": desc, "ranks": str(ranks)} for name, (_, desc, ranks) in pgs.items()}
    for rank in range(3):  # rank 3 wrote no dump
        tp_pg = ("1", "tp0") if rank < 2 else ("2", "tp1")
        dp_pg = ("3", "dp0") if rank % 2 == 0 else ("4", "dp1")
        entries = [_entry(tp_pg, 1, 1000, True), _entry(dp_pg, 1, 2000, True)]
        if rank < 2:
            entries += [_entry(tp_pg, 2, 3000, True), _entry(dp_pg, 2, 4000, False)]
        else:
            entries += [_entry(tp_pg, 2, 3000, False)]
        dump = {"version": "2.4", "pg_config": config, "pg_status": {}, "entries": entries}
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    out = tmp_path / "run"
    result = import_run("flight-recorder", [tmp_path / f"nccl_trace_rank_{r}" for r in range(3)], out, dp=2, tp=2, pp=1)
    assert any("no dump for rank(s) 3" in w for w in result.warnings)
    hang = Run.open(out).hang()
    assert hang.suspects == [3] and hang.waiting == [0, 1, 2]
    ev = Run.open(out).events(steps=(-1, -1))
    assert set(ev.group) == {"tp", "dp"} and set(ev.bytes) == {2048}


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bad_dumps(tmp_path: Path, capsys):
    (tmp_path / "text_rank_0").write_text("hello")
    (tmp_path / "evil_rank_1").write_bytes(pickle.dumps({"entries": [_Evil()]}))
    (tmp_path / "norank").write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "pg_status": {}}))
    for name, expected in (("text_rank_0", "is not a flight-recorder dump"), ("evil_rank_1", "refusing to load"),
                           ("norank", "cannot tell the rank")):
        with pytest.raises(ImportInputError, match=expected):
            import_run("flight-recorder", [tmp_path / name], tmp_path / f"o-{name}")
    assert main(["import", "fr", str(tmp_path / "evil_rank_1"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr()
    assert "refusing to load" in err.err and "Traceback" not in err.err and "must never run" not in err.out
