"""The straggler fault on a GPU rank: extra matrix products on the rank's stream (trainer/robust/faults.py),
so the GPU is busy for the delay, not idle as under a host sleep."""

from __future__ import annotations

import pytest
import torch

from megascope.trainer.robust.faults import Faults, GpuDelay, parse_spec

needs_gpu = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)


def _device_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@needs_gpu
def test_gpu_delay_keeps_the_gpu_busy_for_about_the_asked_time() -> None:
    delay = GpuDelay(torch.device("cuda"))
    delay.run(0.001)  # calibrates
    busy = _device_ms(lambda: delay.run(0.050))
    assert 35 <= busy <= 70, busy  # whole products, measured once: within ~30%


@needs_gpu
def test_straggler_on_a_gpu_rank_stretches_device_time_by_its_slowdown() -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def work() -> None:
        for _ in range(20):
            a @ a

    def stretched(faults: Faults) -> float:
        def run() -> None:
            with faults.compute():
                work()
        return _device_ms(run)

    slow = Faults([parse_spec("straggler:rank=0,slowdown=2", 1)], 0, torch.device("cuda"))
    clean = Faults([], 0, torch.device("cuda"))
    stretched(slow), stretched(clean)  # warm-up and calibration
    ratio = stretched(slow) / stretched(clean)
    assert 1.6 <= ratio <= 2.4, ratio


def test_cpu_straggler_still_sleeps() -> None:
    """A CPU rank has no GpuDelay: the slowdown is a sleep proportional to the region."""
    import time

    faults = Faults([parse_spec("straggler:rank=0,slowdown=3", 1)], 0, torch.device("cpu"))
    start = time.perf_counter()
    with faults.compute():
        time.sleep(0.05)
    assert time.perf_counter() - start >= 0.14
