"""The summary line in the job's own log (tracer/step_summary.py): what it says about step times and a
watcher's findings, that it reaches stdout and the `logging` logger `megascope` from a real Tracer,
that it never raises into or holds up the training thread, and through `megascope train --watch`
that a real watcher's straggler shows as chronic in the job's own output."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

import pytest

from megascope import tracer
from megascope.analyzer.watch.sinks import JsonlSink
from megascope.tracer.config import TraceConfig
from megascope.tracer.run_dir import FINDINGS_FILE
from megascope.tracer.step_summary import QUEUED, STALL_RATIO, LiveVerdicts, StepSummary, summary_line


def record(event: str, kind: str, ranks: list[int], steps: list[int], severity: float, at: int) -> dict:
    """A record as the watcher writes it (docs/watch.md, Records)."""
    return {"kind": kind, "ranks": ranks, "hosts": ["node0"], "steps": steps, "severity": severity,
            "summary": f"{kind} on {ranks}", "evidence": {}, "event": event, "at_step": at,
            "time": "2026-11-27T19:00:00Z", "run_id": "r"}


def test_line_gives_step_times_chronic_ranks_and_one_off_stalls(tmp_path):
    sink = JsonlSink(tmp_path / FINDINGS_FILE)  # the watcher's own writer
    sink.send(record("start", "straggler", [5], [8, 10], 1.3, 10))
    sink.send(record("start", "late_launch", [3], [12, 14], 1.1, 14))
    sink.send(record("start", "straggler", [2], [11, 13], 1.2, 13))
    sink.send(record("end", "straggler", [2], [11, 16], 1.2, 21))  # an episode that ended: one-off
    verdicts = LiveVerdicts(tmp_path / FINDINGS_FILE)
    assert verdicts.refresh()
    window = [(s, 0.5) for s in range(10, 20)]
    window[4] = (14, 0.5 * STALL_RATIO + 0.1)  # one step over the stall ratio
    line = summary_line(window, verdicts)
    assert line.startswith("[megascope] steps 10-19 | step time (s) min 0.500 median 0.500 max 1.100 | ")
    assert ("chronic: rank 5 straggler severity 1.30 since step 8; "
            "rank 3 late_launch severity 1.10 since step 12") in line
    assert "one-off: step 14 1.100 s (2.2x median); rank 2 straggler severity 1.20 steps 11-16 (ended)" in line
    assert line.endswith("| 2 findings open") and "\n" not in line


def test_without_a_watcher_the_line_says_so_and_still_has_the_times(tmp_path):
    verdicts = LiveVerdicts(tmp_path / FINDINGS_FILE)
    assert not verdicts.refresh()
    line = summary_line([(0, 1.0), (1, 1.2), (2, 0.8)], None)
    assert "min 0.800 median 1.000 max 1.200" in line and "no live verdicts" in line
    assert "one-off: none" in line


def test_records_are_read_incrementally_a_partial_line_waits_and_a_new_file_starts_over(tmp_path):
    path = tmp_path / FINDINGS_FILE
    first = json.dumps(record("start", "straggler", [1], [3, 5], 2.0, 5)) + "\n"
    path.write_text(first + "not json\n" + json.dumps(record("end", "straggler", [1], [3, 9], 2.0, 9))[:40])
    verdicts = LiveVerdicts(path)
    verdicts.refresh()
    assert [v.ranks for v in verdicts.open()] == [[1]]  # the garbage line skipped, the partial one not read
    assert verdicts.offset == len(first) + len("not json\n")
    with open(path, "w") as f:  # a new watcher's file, shorter than what was read
        f.write(json.dumps(record("start", "late_launch", [0], [2, 4], 1.5, 4)) + "\n")
    verdicts.refresh()
    assert [(v.kind, v.ranks) for v in verdicts.open()] == [("late_launch", [0])]


def test_a_real_tracer_prints_and_logs_every_n_steps(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="megascope")
    t = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False, summary_every=4), "cpu", sink=tracer.MemorySink())
    for step in range(9):
        t.set_step(step)
        t.record_step()
    t.close()  # the lines built meanwhile are written at the next step or, for the last, at close
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[megascope] steps")]
    logged = [r.getMessage() for r in caplog.records if r.name == "megascope"]
    assert [x.split(" |")[0] for x in printed] == ["[megascope] steps 0-3", "[megascope] steps 4-7"]
    assert logged == printed and t.summary is not None and t.summary.lines == 2


def test_other_ranks_and_zero_print_nothing(tmp_path):
    other = tracer.Tracer(tmp_path, 1, TraceConfig(nvml=False), "cpu", sink=tracer.MemorySink())
    off = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False, summary_every=0), "cpu", sink=tracer.MemorySink())
    try:
        assert other.summary is None and off.summary is None
    finally:  # their threads must not outlive the test (test_tracer_api counts threads)
        other.close()
        off.close()


def test_a_failing_line_is_counted_and_a_stuck_records_file_never_holds_the_training_thread(tmp_path):
    def broken(line: str) -> None:
        raise OSError("stdout closed")

    summary = StepSummary(tmp_path, 2, out=broken)
    for step in range(6):
        summary.step(step, 0.1)  # never raises
    summary.close()
    assert summary.failures == 3 and summary.lines == 0

    release, reading = threading.Event(), threading.Event()

    class StuckFile(LiveVerdicts):  # the records file on a filesystem that hangs until released
        def refresh(self) -> bool:
            reading.set()
            release.wait(30)
            return False

    summary = StepSummary(tmp_path, 1, out=lambda line: None)
    summary.verdicts = StuckFile(tmp_path / FINDINGS_FILE)
    summary.step(0, 0.1)
    assert reading.wait(30)
    for step in range(1, 50):  # the thread is stuck reading: QUEUED more windows wait, the rest skipped
        summary.step(step, 0.1)
    assert summary.skipped == 49 - QUEUED and summary.lines == 0
    release.set()
    summary.close()
    assert summary.lines == 1 + QUEUED and summary.failures == 0


@pytest.mark.slow
def test_train_with_a_watcher_names_the_straggler_as_chronic_in_its_own_log(tmp_path):
    run = tmp_path / "run"
    # the straggler set-up of tests/test_train_watch.py (dp=4, rank 1 3x slower from step 3: the
    # watcher names it within a few steps), run longer so that later lines come after its announcement
    proc = subprocess.run([sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "4",
                           "--steps", "40", "--run-dir", str(run), "--set", "trace.flush_interval_s=1",
                           "--set", "trace.summary_every=5", "--inject", "straggler:rank=1,slowdown=3,from=3",
                           "--watch", "--watch-args=--poll 0.5"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[megascope] steps")]
    # every line due, in order (a line skipped because QUEUED wait would fail here: none should under load 14)
    assert [x.split(" |")[0] for x in lines] == [f"[megascope] steps {s}-{s + 4}" for s in range(0, 40, 5)]
    chronic = [x for x in lines if "chronic: rank 1 straggler" in x]
    assert chronic, "\n".join(lines)
    assert not any("chronic: rank 0" in x or "chronic: rank 2" in x or "chronic: rank 3" in x for x in lines)
