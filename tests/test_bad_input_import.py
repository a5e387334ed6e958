"""Bad and unusual input to `megascope import` (issue 14), through the real command: a failed import
leaves nothing behind (never removing a directory the user had), a single-process profiler trace is
rank 0 of a world of 1, a trace without ProfilerStep#N annotations is one step, each with a note; the
progress bar is drawn on a terminal only. The profiler traces are real torch.profiler output."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megascope.analyzer import Run
from megascope.progress import ProgressBar

LOOP_STEPS = 4


def megascope(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def _train(prof: torch.profiler.profile | None, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)
    for _ in range(steps):
        with torch.profiler.record_function("forward"):
            loss = model(x).square().mean()
        with torch.profiler.record_function("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """A single-process job profiled twice: with a schedule (ProfilerStep#1-3) and as one region."""
    folder = tmp_path_factory.mktemp("profiler")
    cpu = [torch.profiler.ProfilerActivity.CPU]
    stepped = folder / "train.json"
    with torch.profiler.profile(activities=cpu, schedule=torch.profiler.schedule(wait=0, warmup=1, active=3),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(stepped))) as prof:
        _train(prof, LOOP_STEPS)
    region = folder / "region.json"
    with torch.profiler.profile(activities=cpu) as prof:
        _train(None, LOOP_STEPS)
    prof.export_chrome_trace(str(region))
    for path in (stepped, region):  # what this test is about: no rank anywhere in them
        assert "distributedInfo" not in path.read_text()
    assert "ProfilerStep#" in stepped.read_text() and "ProfilerStep#" not in region.read_text()
    return {"stepped": stepped, "region": region}


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("megascope import: note: ")]


def test_single_process_trace_is_rank_0_of_1(traces, tmp_path):
    out = tmp_path / "run"
    proc = megascope("import", "kineto", traces["stepped"], "--out", out)
    assert proc.returncode == 0, proc.stderr
    (note,) = _notes(proc.stderr)
    assert "train.json has no distributedInfo and no rank in its file name: imported as rank 0 of a world of 1" in note
    run = Run.open(out)
    assert run.topology["rank"].tolist() == [0] and run.manifest["topology"]["world"] == 1
    assert sorted(run.steps().step) == [1, 2, 3]
    assert set(run.events((1, 3)).name) >= {"forward", "backward", "optimizer"}
    assert run.manifest["import"]["notes"] == [note.removeprefix("megascope import: note: ")]


def test_trace_without_profiler_steps_is_one_step(traces, tmp_path):
    out = tmp_path / "run"
    proc = megascope("import", "kineto", traces["region"], "--out", out)
    assert proc.returncode == 0, proc.stderr
    notes = _notes(proc.stderr)
    assert len(notes) == 2 and "imported as rank 0 of a world of 1" in notes[0]
    assert "no ProfilerStep#N annotations in the trace of rank(s) 0: each profiled region was imported as one " \
           "step (step 0)" in notes[1]
    run = Run.open(out)
    steps = run.steps()
    assert steps.step.tolist() == [0]
    ev = run.events((0, 0))
    # the region spans the whole loop: every iteration's forward and backward are in it
    assert (ev.name == "forward").sum() >= LOOP_STEPS and (ev.name == "backward").sum() >= LOOP_STEPS
    assert ev.start_ns.min() >= steps.start_ns[0] and ev.end_ns.max() <= steps.end_ns[0]
    report = megascope("analyze", out, "--json")
    assert report.returncode == 0 and json.loads(report.stdout)["run"]["steps"] == 1


def test_several_traces_without_ranks_are_still_refused(traces, tmp_path):
    """Which would be rank 0? Only a single trace is taken as a single-process job."""
    out = tmp_path / "run"
    proc = megascope("import", "kineto", traces["stepped"], traces["region"], "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no distributedInfo.rank and no rank at the end of the file name" in proc.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---- nothing left behind --------------------------------------------------------------------------
def _garbage(tmp_path: Path) -> Path:
    bad = tmp_path / "in" / "trace_rank0.json"
    bad.parent.mkdir()
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1')  # truncated
    return bad


@pytest.mark.parametrize("fmt", ["kineto", "flight-recorder", "ndtimeline"])
def test_failed_import_leaves_no_out_directory(tmp_path, fmt):
    bad = _garbage(tmp_path)
    out = tmp_path / "runs" / "deep" / "new"
    proc = megascope("import", fmt, bad, "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("megascope import: ")
    # neither the run, nor its hidden work folder, nor the parents the import created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_failed_import_keeps_the_users_empty_directory(tmp_path):
    bad = _garbage(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    proc = megascope("import", "kineto", bad, "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert out.is_dir() and list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["in", "mine"]


def test_import_into_an_empty_directory_succeeds(traces, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    assert megascope("import", "kineto", traces["stepped"], "--out", out).returncode == 0
    assert (out / "run.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.parametrize("setup, needle", [
    ("file", "is a file; pass a new directory"),
    ("other", "exists and is not empty; pass a new or empty directory"),
    ("run", "already holds a run (run.json); pass a new --out directory"),
])
def test_out_that_is_not_a_new_directory(traces, tmp_path, setup, needle):
    out = tmp_path / "out"
    if setup == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / ("run.json" if setup == "run" else "notes.txt")).write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = megascope("import", "kineto", traces["stepped"], "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


# ---- progress -------------------------------------------------------------------------------------
def test_import_progress_bar_on_a_terminal_only(traces, tmp_path):
    piped = megascope("import", "kineto", traces["stepped"], "--out", tmp_path / "a")
    assert piped.returncode == 0 and "\r" not in piped.stderr and "reading" not in piped.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "megascope", "import", "kineto", str(traces["stepped"]),
                               "--out", str(tmp_path / "b")], stdout=subprocess.PIPE, stderr=follower, timeout=300)
        os.close(follower)
        follower = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0
    text = drawn.decode()
    assert "\rreading" in text and "1/1" in text and "\rwriting" in text


def test_progress_line_clears_a_longer_label():
    class Term:
        """A one-line terminal: \\r returns to column 0, characters overwrite."""

        def __init__(self) -> None:
            self.line, self.col = [], 0

        def write(self, text: str) -> None:
            for ch in text:
                if ch == "\r":
                    self.col = 0
                    continue
                if self.col < len(self.line):
                    self.line[self.col] = ch
                else:
                    self.line.append(ch)
                self.col += 1

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    term = Term()
    bar = ProgressBar(stream=term)
    bar("updating the rank-step summary", 1, 4)
    bar("done", 4, 4)
    shown = "".join(term.line).rstrip()
    assert shown.startswith("done ") and "summary" not in shown and shown.endswith("s")
    quiet = Term()
    quiet.isatty = lambda: False
    ProgressBar(stream=quiet)("reading", 1, 2)
    assert quiet.line == []
