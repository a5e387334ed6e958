"""Live findings tell the truth about time, through the real `megascope watch` beside a real `megascope
train` run (4 ranks, gloo): a 3x straggler from step 60 of 200, the watcher started once the job is
past step 100, so its first window (32 steps) begins well after the onset. The live finding carries its
true onset (found before the window, near the injected step), the finding still open at the last step
is reported open at the end (not ended), and the records' times have milliseconds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

ONSET, STEPS, WINDOW = 60, 200, 32


def newest_step(run: Path) -> int:
    """The furthest step every rank wrote (their steps segments; -1 before any): the watcher's newest
    complete step. Rank 0's alone ran ahead of the straggler's by a flush (the watcher then announced at
    step 95, inside the first window, 1 run in 12)."""
    newest = [-1] * 4
    for seg in (run / "steps").glob("rank=*/seg-*.parquet"):
        try:
            steps = pq.read_table(seg, columns=["step"]).column("step").to_pylist()
        except OSError:
            continue  # renamed into place while we looked
        rank = int(seg.parent.name.split("=")[1])
        newest[rank] = max(newest[rank], max(steps, default=-1))
    return min(newest)


def test_live_onset_before_the_window_open_at_the_end_and_ms_times(tmp_path):
    run = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "4", "--steps", str(STEPS),
         "--run-dir", str(run), "--set", "trace.flush_interval_s=1", "--inject",
         f"straggler:rank=1,slowdown=3,from={ONSET}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while newest_step(run) < ONSET + 40 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.poll() is None, "the job ended before the watcher started: " + (job.stderr.read() or "")[-2000:]
        watch = subprocess.run([sys.executable, "-m", "megascope", "watch", str(run), "--no-summary", "--poll", "0.5",
                                "--window", str(WINDOW)], capture_output=True, text=True, timeout=600, check=False)
        assert job.wait(300) == 0, job.stderr.read()[-2000:]
    finally:
        job.kill()
    assert watch.returncode == 0, watch.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "findings.jsonl").read_text().splitlines()]
    mine = [r for r in recs if r["kind"] == "straggler" and r["ranks"] == [1]]
    start = next(r for r in mine if r["event"] == "start")
    final = next(r for r in mine if r["event"] == "final")
    # announced after the window had moved past the onset, yet dated from before the window
    assert start["at_step"] - WINDOW + 1 > ONSET + 5, (start["at_step"], watch.stdout)
    # dated near the injected step, before the window it was announced in: live and final 60, 60 and 50
    # on three runs at load 10-15; at load 17 live 57, while the verdict over the whole run said 35; at
    # load 7.5 live and final 64; at load 10 live 24, the whole run's verdict 2 (rank 1 slow early on:
    # no earlier than the verdict over the whole run, then)
    earliest = min(ONSET - 20, final["steps"][0])
    assert earliest <= start["steps"][0] <= min(ONSET + 8, start["at_step"] - WINDOW), (start, final)
    assert f"since step {start['steps'][0]}" in start["summary"]
    # still slow at the last step: open at the end of the run, never ended
    assert [r["event"] for r in mine if r["event"] in ("end", "open_at_end")] == ["open_at_end"], (mine, watch.stdout)
    # from its onset to the last steps (within the tracker's end_after, 4: the last step may go unflagged)
    first, last = next(r for r in mine if r["event"] == "open_at_end")["steps"]
    assert first == start["steps"][0] and last >= STEPS - 5, (mine, watch.stdout)
    said = [line for line in watch.stdout.splitlines() if "straggler" in line and "Rank 1 " in line]
    assert any("OPEN AT END straggler" in line for line in said), watch.stdout
    assert not any("ENDED straggler" in line for line in said), watch.stdout  # (another rank's noise may end)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"]) for r in recs)
