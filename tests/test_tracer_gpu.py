"""GPU paths: CUDA-event spans resolved off the training thread, NVML samples, CUPTI kernels.
Skipped without CUDA (run on a GPU machine: pytest tests/test_tracer_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch

from megascope import tracer
from megascope.tracer.config import TraceConfig
from megascope.tracer.schema import GPU, KERNELS

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)


@pytest.fixture(autouse=True)
def _no_active_tracer():
    yield
    tracer.deactivate()


def _busy(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1e6 * 1.4))  # ~1.4 cycles/ns at typical clocks; only order matters


def test_cuda_spans_measure_device_time_not_launch_time():
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, 0, TraceConfig(nvml=False), "cuda:0", sink=sink)
    tracer.activate(t)
    tracer.set_step(0)
    with tracer.span("warmup"):  # first CUDA calls are slow to launch: keep them out of the check
        _busy(1)
    torch.cuda.synchronize()
    host_before = t.now_ns()
    with tracer.span("forward"):
        _busy(50)  # launch returns at once; the GPU works ~tens of ms
    launch_returned = t.now_ns()
    with tracer.span("backward"):
        _busy(5)
    torch.cuda.synchronize()
    host_after = t.now_ns()
    t.close()
    rows = {r["name"]: r for r in sink.table("events").to_pylist()}
    fwd, bwd = rows["forward"], rows["backward"]
    assert host_before <= fwd["issue_ns"] <= fwd["start_ns"] + 2_000_000
    assert fwd["end_ns"] - fwd["start_ns"] > 2 * (launch_returned - fwd["issue_ns"])  # device time
    assert bwd["issue_ns"] < fwd["end_ns"]  # backward was issued while forward still ran: a queue
    assert fwd["end_ns"] <= bwd["start_ns"] + 100_000 and bwd["end_ns"] <= host_after + 2_000_000


def test_cuda_event_resolution_keeps_up_and_reuses_events():
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, 0, TraceConfig(nvml=False), "cuda:0", sink=sink)
    tracer.activate(t)
    x = torch.randn(512, 512, device="cuda")
    for rnd in range(2):
        for step in range(10):
            tracer.set_step(rnd * 10 + step)
            for _ in range(10):
                with tracer.span("matmul"):
                    x = torch.tanh(x @ x)
        torch.cuda.synchronize()
        time.sleep(0.3)  # let the resolver return the events to the pool
    t.close()
    table = sink.table("events")
    assert table.num_rows == 200 and t.dropped_events == 0
    assert t.timeline.resolved == 200 and t.timeline.created <= 200  # round 2 reused round 1's events
    for r in table.to_pylist():
        assert r["start_ns"] <= r["end_ns"]


def test_nvml_sampler_fills_the_gpu_table():
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, 0, TraceConfig(nvml=True, nvml_interval_s=0.1), "cuda:0", sink=sink)
    if t.nvml is None or not t.nvml.active:
        t.close()
        pytest.skip("NVML not available here")
    time.sleep(0.6)
    t.close()
    table = sink.table("gpu")
    assert table.schema == GPU and table.num_rows >= 3
    row = table.to_pylist()[-1]
    assert row["mem_used_bytes"] > 0 and row["sm_clock_mhz"] > 0 and row["temp_c"] > 0
    print("nvml sample:", row)


def _cupti_tracer(every: int = 1) -> tuple[tracer.Tracer, tracer.MemorySink]:
    """A tracer recording CUPTI kernel activity into memory; skips where CUPTI cannot run."""
    pytest.importorskip("cupti")
    sink = tracer.MemorySink()
    cfg = TraceConfig(nvml=False, cupti=True, cupti_every=every, flush_interval_s=0.2)
    t = tracer.Tracer(None, 0, cfg, "cuda:0", sink=sink)
    if not t.cupti.active:
        t.close()
        pytest.skip("CUPTI could not be enabled here")
    return t, sink


def test_cupti_kernels_table():
    t, sink = _cupti_tracer()
    tracer.activate(t)
    tracer.set_step(0)
    before = t.now_ns()
    x = torch.randn(256, 256, device="cuda")
    with tracer.span("work"):
        for _ in range(5):
            x = x @ x
    torch.cuda.synchronize()
    after = t.now_ns()
    t.close()
    kernels = sink.table("kernels")
    assert kernels.schema == KERNELS and kernels.num_rows >= 5
    rows = kernels.to_pylist()
    assert any("gemm" in r["name"].lower() or "sgemm" in r["name"].lower() or "cutlass" in r["name"].lower()
               for r in rows), [r["name"] for r in rows][:5]
    inside = [r for r in rows if before - 5_000_000 <= r["start_ns"] <= after + 5_000_000]
    assert len(inside) >= 5, (before, after, rows[:3])


def test_cupti_records_only_while_the_tracer_is_active():
    t, _ = _cupti_tracer()
    x = torch.randn(256, 256, device="cuda")
    tracer.activate(t)
    tracer.deactivate()
    for _ in range(50):
        x = x @ x  # not recorded: no tracer active
    torch.cuda.synchronize()
    t.cupti.flush()
    inactive = t.cupti.kernels
    tracer.activate(t)
    for _ in range(5):
        x = x @ x
    torch.cuda.synchronize()
    t.close()
    tracer.deactivate()
    assert inactive < 5 <= t.cupti.kernels - inactive < 50, (inactive, t.cupti.kernels)


def test_cupti_records_the_kernels_of_every_nth_step_only():
    t, _ = _cupti_tracer(every=2)
    x = torch.randn(256, 256, device="cuda")
    tracer.activate(t)
    per_step = []
    for step in range(4):
        before = t.cupti.kernels
        tracer.set_step(step)
        for _ in range(5):
            x = x @ x
        torch.cuda.synchronize()
        t.cupti.flush()  # forced: the step's records reach the callback now
        per_step.append(t.cupti.kernels - before)
    t.close()
    tracer.deactivate()
    assert per_step[0] >= 5 and per_step[2] >= 5 and per_step[1] < 5 and per_step[3] < 5, per_step
