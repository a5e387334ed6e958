"""Tracer API on one process with an in-memory sink: spans, ambient state, schedule, levels, failures."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from megascope import tracer
from megascope.tracer.config import TraceConfig
from megascope.tracer.schema import EVENTS, STEPS


def make(cfg: TraceConfig | None = None, sink=None, **kw) -> tuple[tracer.Tracer, tracer.MemorySink]:
    sink = sink if sink is not None else tracer.MemorySink()
    t = tracer.Tracer(None, 3, cfg or TraceConfig(nvml=False), "cpu", sink=sink, **kw)
    tracer.activate(t)
    return t, sink


@pytest.fixture(autouse=True)
def _no_active_tracer():
    yield
    tracer.deactivate()


def test_spans_carry_ambient_and_explicit_fields():
    t, sink = make()
    tracer.set_step(7)
    tracer.set_microbatch(2, chunk=1)
    with tracer.span("forward"):
        pass
    with tracer.span("send_forward", kind="p2p", group="pp", peer=5, bytes=64, microbatch=4, chunk=0):
        pass
    t.close()
    rows = sink.table("events").to_pylist()
    assert sink.table("events").schema == EVENTS
    assert [(r["rank"], r["step"], r["microbatch"], r["chunk"], r["name"], r["kind"]) for r in rows] == [
        (3, 7, 2, 1, "forward", "compute"), (3, 7, 4, 0, "send_forward", "p2p")]
    assert (rows[1]["group"], rows[1]["peer"], rows[1]["bytes"], rows[1]["seq"]) == ("pp", 5, 64, -1)
    for r in rows:
        assert r["issue_ns"] <= r["start_ns"] <= r["end_ns"]
        assert r["start_ns"] > 1_600_000_000 * 10**9  # Unix epoch ns, not a monotonic reading


def test_decorator_looks_up_the_tracer_at_call_time():
    @tracer.span("optimizer", kind="host")
    def optimizer_step(x: int) -> int:
        return x + 1

    assert optimizer_step(1) == 2  # no tracer yet: plain call
    t, sink = make()
    tracer.set_step(0)
    assert optimizer_step(2) == 3
    t.close()
    assert sink.table("events").column("name").to_pylist() == ["optimizer"]
    assert optimizer_step.__name__ == "optimizer_step"


def test_span_records_even_when_the_body_raises():
    t, sink = make()
    tracer.set_step(0)
    with pytest.raises(KeyError):
        with tracer.span("forward"):
            raise KeyError("boom")
    t.close()
    assert sink.table("events").num_rows == 1


def _threads() -> set[str]:
    import threading

    return {th.name for th in threading.enumerate()}


def test_trace_block_closes_and_flushes_even_when_the_body_raises():
    """`with tracer.trace(...) as t` (as torch.profiler.profile): t is the active Tracer inside; on the
    way out, by an exception too, it is deactivated and closed (threads stopped, buffered rows written),
    and the exception goes on."""
    before = _threads()
    sink = tracer.MemorySink()
    with pytest.raises(KeyError, match="boom"):
        with tracer.trace(None, 3, TraceConfig(nvml=False, flush_interval_s=3600), sink=sink) as t:
            assert isinstance(t, tracer.Tracer) and tracer.active() is t
            assert _threads() > before  # flusher, watchdog, completion sweeper
            tracer.set_step(0)
            with tracer.span("forward"):
                pass
            tracer.record_step(tokens=8)
            assert sink.batches == {}  # still buffered: the exit writes it
            raise KeyError("boom")
    assert tracer.active() is None
    assert sink.table("events").column("name").to_pylist() == ["forward"]
    assert sink.table("steps").column("tokens").to_pylist() == [8]
    assert _threads() == before


def test_trace_writes_the_run_directory_and_gives_the_slot_back(tmp_path):
    outer, _ = make()
    session = tracer.trace(tmp_path / "run", 0, TraceConfig(nvml=False))
    t = session.start()
    assert tracer.active() is t is session.tracer and t is not outer
    with pytest.raises(RuntimeError, match="already started"):
        session.start()
    tracer.set_step(0)
    with tracer.span("forward"):
        pass
    tracer.record_step(tokens=4)
    session.stop()
    session.stop()  # idempotent
    assert tracer.active() is outer  # the tracer active before the block
    segments = sorted((tmp_path / "run").glob("*/rank=*/seg-*.parquet"))
    assert {p.parent.name for p in segments} == {"rank=00000"}
    # the step's summary too (tracer/edge_summary.py; no collective: no edge_collectives rows)
    assert [p.parent.parent.name for p in segments] == ["edge_peer_step", "edge_rank_step", "events", "steps"]
    with tracer.trace(tmp_path / "again", 0, TraceConfig(nvml=False)) as t:
        tracer.set_step(0)
    assert t.stats()["internal_errors"] == 0 and tracer.active() is outer
    outer.close()


def test_no_active_tracer_is_a_noop():
    with tracer.span("forward"):
        pass
    tracer.set_step(1)
    tracer.set_microbatch(0)
    tracer.record_step(tokens=1)
    assert tracer.active() is None


def test_disabled_tracer_records_nothing_and_starts_no_threads():
    import threading

    before = {th.name for th in threading.enumerate()}
    t, sink = make(TraceConfig(enabled=False, nvml=False))
    tracer.set_step(0)
    with tracer.span("forward"):
        pass
    tracer.record_step(tokens=5)
    assert {th.name for th in threading.enumerate()} == before
    t.close()
    assert sink.batches == {}


def test_schedule_every_n_and_level_filter():
    t, sink = make(TraceConfig(nvml=False, every=3))
    for step in range(7):
        tracer.set_step(step)
        with tracer.span("forward"):
            pass
        with tracer.span("layer", level="detail"):
            pass
        tracer.record_step(tokens=10)
    t.close()
    assert sink.table("events").column("step").to_pylist() == [0, 3, 6]  # detail spans filtered at op
    assert sink.table("steps").column("step").to_pylist() == list(range(7))  # steps always written


def test_level_detail_and_level_step():
    t, sink = make(TraceConfig(nvml=False, level="detail"))
    tracer.set_step(0)
    with tracer.span("layer", level="detail"):
        pass
    t.close()
    assert sink.table("events").num_rows == 1
    t, sink = make(TraceConfig(nvml=False, level="step"))
    tracer.set_step(0)
    with tracer.span("forward"):
        pass
    tracer.record_step(tokens=1)
    t.close()
    assert (sink.table("events").num_rows, sink.table("steps").num_rows) == (0, 1)


def test_bad_settings_are_refused_with_a_hint():
    with pytest.raises(ValueError, match="trace.level"):
        make(TraceConfig(nvml=False, level="verbose"))
    with pytest.raises(ValueError, match="trace.every"):
        make(TraceConfig(nvml=False, every=0))
    with pytest.raises(ValueError, match="run_dir or an injected sink"):
        tracer.Tracer(None, 0, TraceConfig(nvml=False))


def test_record_step_defaults_to_the_step_window():
    t, sink = make()
    tracer.set_step(4)
    with tracer.span("forward"):
        pass
    tracer.record_step(tokens=128, loss=2.5, lr=1e-3, model_flops=1e9)
    t.close()
    steps = sink.table("steps")
    assert steps.schema == STEPS
    row = steps.to_pylist()[0]
    event = sink.table("events").to_pylist()[0]
    assert row["step"] == 4 and row["tokens"] == 128 and row["loss"] == 2.5
    assert math.isnan(row["grad_norm"]) and row["dropped_events"] == 0
    assert row["start_ns"] <= event["start_ns"] <= event["end_ns"] <= row["end_ns"]


class FailingSink:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, table: str, batch: pa.Table) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_write_errors_are_counted_and_memory_stays_bounded():
    sink = FailingSink()
    cfg = TraceConfig(nvml=False, flush_events=50, max_buffered_events=200, flush_interval_s=0.01)
    t, _ = make(cfg, sink=sink)
    for step in range(20):  # the loop must run to the end despite every write failing
        tracer.set_step(step)
        for _ in range(30):
            with tracer.span("forward"):
                pass
        tracer.record_step(tokens=1)
        t.flush()
    t.close()
    assert sink.calls > 0 and t.write_errors == sink.calls
    assert t.buffers["events"].pending_rows() <= 200
    assert t.dropped_events >= 20 * 30 - 200
    assert t.internal_errors == 0


def test_internal_errors_are_swallowed():
    t, sink = make()
    t.schedule = lambda step: 1 / 0  # a broken schedule must not reach the training loop
    tracer.set_step(0)
    with tracer.span("forward"):
        pass
    t.close()
    assert t.internal_errors == 1 and sink.table("events").num_rows == 0
