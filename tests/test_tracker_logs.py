"""The summary window in TensorBoard (tracer/tracker_logs.py, `trace.tensorboard_dir`), read back with
TensorBoard's own reader (EventAccumulator), never ours: a real `megascope train --watch` run's scalars
equal rank 0's own steps table (step time min / median / max per window, MFU as the trainer's formula
gives it from run.json) and its text names the straggler the live watcher opened; a watcher's record
with a cause and a cost reads as such; without the package the job runs on and says so in one line."""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megascope import tracer
from megascope.analyzer.watch.sinks import JsonlSink
from megascope.tracer.config import TraceConfig
from megascope.tracer.run_dir import FINDINGS_FILE
from megascope.tracer.step_summary import StepSummary
from megascope.tracer.tracker_logs import MISSING, TensorBoardLog, open_tracker

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
EVERY = 5


def _read(log_dir: Path):
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def _texts(acc) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("megascope/findings/text_summary")}


class _Written(TensorBoardLog):
    """TensorBoardLog that says when a window is written (the summary thread writes it, after the step)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.written = threading.Semaphore(0)

    def window(self, w) -> None:
        super().window(w)
        self.written.release()


def test_a_watchers_finding_with_cause_and_cost_reads_as_such(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / FINDINGS_FILE)  # the watcher's own writer, its record format (docs/watch.md)
    evidence = {"explained_by": "data_loading", "explained_ms": 24.13, "cost_s": 0.384, "gpu_hours": 0.000853}
    base = {"kind": "straggler", "ranks": [1], "hosts": ["node0"], "severity": 2.0, "summary": "",
            "evidence": evidence, "time": "2026-12-08T00:00:00Z", "run_id": "r"}
    tracker = _Written(tmp_path / "tb", tmp_path)
    summary = StepSummary(tmp_path, EVERY, out=lambda line: None, tracker=tracker)
    records = {1: {**base, "steps": [3, 6], "event": "start", "at_step": 6},  # before window 2 (steps 5-9)
               2: {**base, "steps": [3, 11], "event": "end", "at_step": 12}}
    for window in range(3):
        if window in records:
            sink.send(records[window])
        for step in range(window * EVERY, (window + 1) * EVERY):
            summary.step(step, 0.1 * (1 + step % EVERY))
        assert tracker.written.acquire(timeout=30)
    summary.close()
    acc = _read(tmp_path / "tb")
    assert _scalars(acc, "megascope/step_time_s/median") == pytest.approx({4: 0.3, 9: 0.3, 14: 0.3})
    assert _scalars(acc, "megascope/step_time_s/max") == pytest.approx({4: 0.5, 9: 0.5, 14: 0.5})
    assert _scalars(acc, "megascope/findings_open") == {4: 0, 9: 1, 14: 0}
    assert "megascope/mfu" not in acc.Tags()["scalars"]  # no run.json, no peak: no MFU rather than a wrong one
    said = "rank 1 straggler steps 3-{} (data_loading 24.1 ms a step; costs 0.384 s, 0.000853 GPU-hours)"
    assert _texts(acc) == {9: "opened: " + said.format(6), 14: "ended: " + said.format(11)}


def test_without_tensorboard_the_job_runs_on_and_says_so_once(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    caplog.set_level(logging.WARNING, logger="megascope")
    assert open_tracker("", tmp_path) is None and not caplog.records  # not asked for: not a word
    t = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False, summary_every=2, tensorboard_dir=str(tmp_path / "tb")),
                      "cpu", sink=tracer.MemorySink())
    for step in range(6):
        t.set_step(step)
        t.record_step()
    t.close()
    assert [r.getMessage() for r in caplog.records if r.name == "megascope"] == [MISSING]
    assert t.summary is not None and t.summary.lines == 3 and t.summary.failures == 0
    assert not (tmp_path / "tb").exists()


@pytest.mark.slow
def test_a_real_run_s_curves_are_its_steps_table_and_its_text_names_the_live_straggler(tmp_path: Path) -> None:
    run, tb = tmp_path / "run", tmp_path / "tb"
    # tests/test_step_summary.py's watched straggler (dp=4, rank 1 3x slower from step 3): named within steps
    proc = subprocess.run([sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "4",
                           "--steps", "40", "--run-dir", str(run), "--set", "trace.flush_interval_s=1",
                           "--set", f"trace.summary_every={EVERY}", "--set", f"trace.tensorboard_dir={tb}",
                           "--inject", "straggler:rank=1,slowdown=3,from=3", "--watch", "--watch-args=--poll 0.5"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = _read(tb)
    steps = pq.read_table(run / "steps" / "rank=00000").to_pandas().sort_values("step")
    seconds = ((steps.end_ns - steps.start_ns) / 1e9).tolist()
    manifest = json.loads((run / "run.json").read_text())
    peak = manifest["peak_flops"]["per_device"] * manifest["topology"]["world"]
    mfu = (steps.model_flops / (peak * (steps.end_ns - steps.start_ns) / 1e9)).tolist()
    windows = {s + EVERY - 1: slice(s, s + EVERY) for s in range(0, 40, EVERY)}
    for name, of in (("min", min), ("median", statistics.median), ("max", max)):  # float32 in the event file
        want = {at: of(seconds[w]) for at, w in windows.items()}
        assert _scalars(acc, f"megascope/step_time_s/{name}") == pytest.approx(want, rel=1e-6), name
    assert _scalars(acc, "megascope/mfu") == pytest.approx({at: statistics.median(mfu[w])
                                                            for at, w in windows.items()}, rel=1e-5)
    opened = [text for text in _texts(acc).values() if "opened: rank 1 straggler" in text]
    assert opened, _texts(acc)
    assert not any(f"rank {r} " in text for text in _texts(acc).values() for r in (0, 2, 3)), _texts(acc)
