"""Bad input to `megascope train`, fed through the real command: one line on stderr saying what is wrong
and what to do, exit code 2, no traceback, and nothing written (no run directory, an existing run
untouched). Then --resume, the way to continue a run in its own directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megascope.tracer.run_dir import write_manifest

TINY = ["--preset", "tiny", "--steps", "4"]


def train(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", "train", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("megascope train: ")
    for needle in needles:
        assert needle in err, err
    assert "launching" not in proc.stdout  # refused before any rank started


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flags, needles", [
    (["--inject", "hang:rank=0,at=-3"], ["at=-3", "step count >= 0"]),
    (["--inject", "crash:rank=0,at=4"], ["past the last step (3)", "--steps"]),
    (["--inject", "straggler:rank=0,slowdown=2,from=3,to=1"], ["from=3 is after to=1"]),
    (["--inject", "late_launch:rank=0,ms=-5"], ["ms=-5", "positive"]),
    (["--lr", "-1"], ["train.lr must be > 0, got -1.0"]),
    (["--lr", "nan"], ["train.lr must be > 0, got nan"]),
    (["--micro-batch", "0"], ["train.micro_batch must be >= 1"]),
    (["--seed", "-1"], ["train.seed must be >= 0"]),
    (["--set", "train.beta2=1"], ["train.beta2 must be >= 0 and < 1"]),
    (["--max-restarts", "-1"], ["robust.max_restarts must be >= 0"]),
    (["--set", "robust.checkpoint_interval_s=0"], ["robust.checkpoint_interval_s must be > 0"]),
    (["--data", "/missing/corpus.txt"], ["--data /missing/corpus.txt: no such file or folder"]),
])
def test_out_of_range_values_are_refused_before_launch(tmp_path, flags, needles):
    proc = train(tmp_path, *TINY, "--run-dir", str(tmp_path / "r"), *flags)
    assert_refused(proc, *needles)
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_data_too_short_or_empty_is_refused(tmp_path):
    (tmp_path / "short.txt").write_text("tiny corpus")
    assert_refused(train(tmp_path, *TINY, "--run-dir", "r", "--data", "short.txt"), "seq_len + 1 = 65")
    (tmp_path / "empty").mkdir()
    assert_refused(train(tmp_path, *TINY, "--run-dir", "r", "--data", "empty"), "the folder has no files")
    (tmp_path / "odd.bin").write_bytes(b"\x01" * 301)
    assert_refused(train(tmp_path, *TINY, "--run-dir", "r", "--data", "odd.bin"), "even byte size")
    assert not (tmp_path / "r").exists()


def test_cuda_without_a_gpu_is_refused_before_launch(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = train(tmp_path, *TINY, "--run-dir", "r", "--device", "cuda")
    assert_refused(proc, "--device cuda: torch sees no CUDA device", "--device cpu")
    assert not (tmp_path / "r").exists()


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    assert_refused(train(tmp_path, *TINY, "--run-dir", "notes.txt"), "is a file, not a directory")
    assert_refused(train(tmp_path, *TINY, "--run-dir", "notes.txt/run"), "notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_existing_run_of_another_layout_is_left_untouched(tmp_path):
    """A run directory holding another run (here a dp=4 run's manifest and one steps segment) is
    refused whatever the new layout: appending would mix both runs in Run.steps()."""
    run = tmp_path / "old"
    write_manifest(run, {"run_id": "old-run", "source": "megascope-trainer",
                         "topology": {"dp": 4, "tp": 1, "pp": 1, "world": 4}})
    segment = run / "steps" / "rank=00000" / "seg-000000.parquet"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(b"PAR1 stand-in")
    before = snapshot(run)
    proc = train(tmp_path, *TINY, "--dp", "2", "--pp", "2", "--run-dir", "old")
    assert_refused(proc, "old already holds a run (run.json, steps)", "pass a new --run-dir", "--resume")
    assert snapshot(run) == before
    # --resume does not take it either: it has no checkpoint to continue from
    proc = train(tmp_path, *TINY, "--dp", "2", "--pp", "2", "--run-dir", "old", "--resume")
    assert_refused(proc, "no complete checkpoint", "pass a new --run-dir")
    assert snapshot(run) == before


def test_an_empty_or_unrelated_directory_is_fine_to_train_into(tmp_path):
    """Only run entries make a directory "taken": the check must not refuse a fresh mkdir'd folder."""
    from megascope.trainer.robust.preflight import check_run_dir

    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README").write_text("a folder of mine")
    assert check_run_dir(str(tmp_path / "empty"), resume=False) is None
    assert check_run_dir(str(tmp_path / "other"), resume=False) is None
    assert check_run_dir(str(tmp_path / "new" / "run"), resume=False) is None
    assert "--resume needs --run-dir" in train(tmp_path, *TINY, "--resume").stderr


def _steps(run: Path) -> list[int]:
    return sorted(int(s) for seg in (run / "steps" / "rank=00000").glob("seg-*.parquet")
                  for s in pq.read_table(seg, columns=["step"]).column("step").to_pylist())


@pytest.mark.slow
def test_resume_continues_a_run_and_a_plain_rerun_is_refused(tmp_path):
    first = train(tmp_path, "--preset", "tiny", "--steps", "5", "--run-dir", "run", "--checkpoint-every", "2",
                  "--set", "trace.flush_interval_s=0.5")  # checkpoints after steps 2 and 4; step 4 runs again
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-000004" / "manifest.json").is_file()

    again = train(tmp_path, "--preset", "tiny", "--steps", "6", "--run-dir", "run")
    assert_refused(again, "run already holds a run", "--resume")
    # dp may change (DCP checkpoints reshard: tests/test_checkpoint_reshard.py); the pipeline layout may not
    other_layout = train(tmp_path, "--preset", "tiny", "--steps", "6", "--pp", "2", "--run-dir", "run", "--resume")
    assert_refused(other_layout, "different layout (pp: saved 1, now 2)", "reshards across dp")

    resumed = train(tmp_path, "--preset", "tiny", "--steps", "6", "--run-dir", "run", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing run from its checkpoint at step 4" in resumed.stdout
    assert "resumed from checkpoint step 4" in resumed.stdout and "done: 2 steps" in resumed.stdout
    assert _steps(run) == [0, 1, 2, 3, 4, 4, 5]  # step 4 of both launches is in the trace ...
    incidents = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    assert [(i["kind"], i["step"]) for i in incidents] == [("restart", 4)]
    from megascope.analyzer import Run

    rank_steps = Run.open(run).rank_steps()  # ... and the analyzer keeps the resumed launch's
    assert sorted(rank_steps.step) == [0, 1, 2, 3, 4, 5]


def test_version_and_defaults_in_help():
    version = subprocess.run([sys.executable, "-m", "megascope", "--version"], capture_output=True, text=True)
    from megascope import __version__

    assert version.returncode == 0 and version.stdout.strip() == f"megascope {__version__}"
    for command, option, default in [("train", "--lr", "0.003"), ("train", "--max-restarts", "3"),
                                     ("simulate", "--steps", "20"), ("demo", "--steps", "30"),
                                     ("dashboard", "--port", "8050"), ("dashboard", "--refresh", "3.0")]:
        text = subprocess.run([sys.executable, "-m", "megascope", command, "--help"], capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "1000"}).stdout  # one line per option
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(option + " "))
        assert f"(default: {default})" in line, (command, line)
