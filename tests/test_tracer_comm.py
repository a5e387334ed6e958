"""Async comm ops in a single process, with fake works: completion observed off the training thread,
wait spans only for waits that blocked, issue/start/end order, no phantom in-flight entries."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megascope import tracer
from megascope.tracer import comm_spans
from megascope.tracer.completion import CompletionTracker
from megascope.tracer.config import TraceConfig


class FakeWork:
    """A gloo-like work: is_completed() turns true on its own when `complete()` is called."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waits = 0

    def complete(self) -> None:
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if not self.done.wait(10):
            raise RuntimeError("fake work never completed")
        return True


@pytest.fixture
def active():
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, 0, TraceConfig(nvml=False), "cpu", sink=sink)
    tracer.activate(t)
    tracer.set_step(0)
    yield t, sink
    tracer.deactivate()
    t.close()


def _issue(t: tracer.Tracer, work: FakeWork, name: str = "grad_reduce_scatter", has_completion: bool = True):
    issue_ns = t.now_ns()
    op = comm_spans.begin(name, "collective", "dp", None, "dp", 64, torch.empty(16), issue_ns=issue_ns)
    return comm_spans.finish([op], work, on_gpu=False, has_completion=has_completion)


def _rows(t: tracer.Tracer, sink: tracer.MemorySink) -> list[dict]:
    t.close()
    return sink.table("events").to_pylist()


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_completion_before_wait_ends_the_op_at_completion_without_a_wait_span(active):
    t, sink = active
    work = FakeWork()
    traced = _issue(t, work)
    assert traced.watched
    work.complete()
    completed_ns = t.now_ns()
    _until(lambda: t.registry.snapshot() == [])  # the sweeper saw it: no longer in flight
    time.sleep(0.05)
    wait_called_ns = t.now_ns()
    traced.wait()
    rows = _rows(t, sink)
    assert [r["name"] for r in rows] == ["grad_reduce_scatter"]
    op = rows[0]
    assert op["issue_ns"] <= op["start_ns"] <= completed_ns <= op["end_ns"] < wait_called_ns


def test_blocking_wait_is_its_own_host_span_and_ends_the_op(active):
    t, sink = active
    work = FakeWork()
    tracer.set_microbatch(3)
    traced = _issue(t, work)
    tracer.set_microbatch(5)  # the waiter's micro-batch differs from the issuer's
    threading.Timer(0.1, work.complete).start()
    before_wait = t.now_ns()
    traced.wait()
    after_wait = t.now_ns()
    rows = {r["name"]: r for r in _rows(t, sink)}
    op, wait = rows["grad_reduce_scatter"], rows["grad_reduce_scatter.wait"]
    assert (wait["kind"], wait["group"], wait["seq"], wait["bytes"]) == ("host", "dp", op["seq"], 0)
    assert (op["microbatch"], wait["microbatch"]) == (3, 5)
    assert before_wait <= wait["start_ns"] < op["end_ns"] <= wait["end_ns"] <= after_wait
    assert op["start_ns"] <= wait["start_ns"]


def test_issue_precedes_start_of_an_async_op(active):
    t, sink = active
    work = FakeWork()
    issue_ns = t.now_ns()
    op = comm_spans.begin("param_all_gather", "collective", "dp", None, "dp", 64, torch.empty(16),
                          issue_ns=issue_ns)
    time.sleep(0.01)  # the backend call taking host time before the op is enqueued
    traced = comm_spans.finish([op], work, on_gpu=False)
    work.complete()
    traced.wait()
    row = _rows(t, sink)[0]
    assert row["issue_ns"] == issue_ns < row["start_ns"] <= row["end_ns"]
    assert row["start_ns"] - row["issue_ns"] >= 10_000_000


def test_p2p_without_completion_reports_ends_at_wait_with_a_wait_span(active):
    t, sink = active
    work = FakeWork()
    traced = _issue(t, work, name="send_forward", has_completion=False)
    assert not traced.watched
    work.complete()
    time.sleep(0.02)
    assert len(t.registry.snapshot()) == 1  # nobody can see a gloo p2p complete before wait()
    wait_called_ns = t.now_ns()
    traced.wait()
    rows = {r["name"]: r for r in _rows(t, sink)}
    assert rows["send_forward"]["end_ns"] >= wait_called_ns
    assert rows["send_forward.wait"]["start_ns"] >= wait_called_ns


def test_wait_after_deactivate_still_ends_the_op_in_its_tracer(active):
    t, sink = active
    work = FakeWork()
    traced = _issue(t, work)
    tracer.deactivate()
    threading.Timer(0.05, work.complete).start()
    traced.wait()
    assert t.registry.snapshot() == []
    assert [r["name"] for r in _rows(t, sink)][:1] == ["grad_reduce_scatter"]


def test_unsampled_step_records_nothing_but_still_tracks_in_flight(active):
    t, sink = active
    t.schedule = lambda step: step % 2 == 0
    tracer.set_step(1)
    work = FakeWork()
    traced = _issue(t, work)
    assert len(t.registry.snapshot()) == 1
    threading.Timer(0.05, work.complete).start()
    traced.wait()
    assert t.registry.snapshot() == []
    assert _rows(t, sink) == []


def test_a_span_edge_after_completion_ends_the_op_without_the_sweeper(active):
    t, sink = active
    t.completion.sweep_s = 3600.0  # the background sweeper (after its current nap) stays out of it
    time.sleep(0.05)
    work = FakeWork()
    traced = _issue(t, work)
    with tracer.span("forward"):
        work.complete()
        completed_ns = t.now_ns()
        time.sleep(0.05)
    assert t.registry.snapshot() == []  # seen at the span's exit
    time.sleep(0.05)
    traced.wait()
    rows = {r["name"]: r for r in _rows(t, sink)}
    forward, op = rows["forward"], rows["grad_reduce_scatter"]
    assert completed_ns <= op["end_ns"] <= forward["end_ns"]
    assert "grad_reduce_scatter.wait" not in rows


class _Item:
    def __init__(self) -> None:
        self.done = False
        self.ended_at: int | None = None

    def poll_done(self, now_ns: int | None) -> bool:
        if self.done and self.ended_at is None:
            self.ended_at = now_ns
        return self.done


def test_tracker_sweeps_end_only_what_completed():
    tracker = CompletionTracker(sweep_s=3600.0)
    try:
        first, second = _Item(), _Item()
        assert tracker.watch(first) and tracker.watch(second)
        second.done = True
        tracker.sweep(7)
        assert (first.ended_at, second.ended_at, list(tracker.pending)) == (None, 7, [first])
        first.done = True
        tracker.sweep(9)
        assert first.ended_at == 9 and not tracker.pending
    finally:
        tracker.close()


def test_background_sweeper_ends_ops_while_the_training_thread_is_idle():
    tracker = CompletionTracker(sweep_s=0.005)
    try:
        item = _Item()
        tracker.watch(item)
        item.done = True
        _until(lambda: not tracker.pending)
        assert tracker.sweeps >= 1
    finally:
        tracker.close()


def test_tracker_is_bounded_and_drops_a_failing_work():
    class Failing(_Item):
        def poll_done(self, now_ns: int | None) -> bool:
            raise RuntimeError("broken work")

    tracker = CompletionTracker(sweep_s=3600.0, max_pending=2)
    try:
        items = [Failing(), _Item(), _Item()]
        assert [tracker.watch(i) for i in items] == [True, True, False]
        tracker.sweep(1)
        assert list(tracker.pending) == [items[1]]
    finally:
        tracker.close()
