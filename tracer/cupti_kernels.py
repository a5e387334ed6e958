"""Kernel activity from CUPTI (cupti-python, `from cupti import cupti`) into the kernels table.

CUPTI fills its own buffers and hands completed ones to a callback on its thread; a daemon thread
asks for a flush every `flush_s` so kernels reach the store while the job runs. What that costs is
counted (seconds in flushes and in the record callback) and logged at close: on gpu-2b (H200, 11.5k
kernels a step) every third step stalled by 1.7-4.5 s, the mean step +66-76%, the median +0.4-0.8%,
with 8 or 64 MiB buffers and with forced or unforced periodic flushes alike (docs/measurements.md),
so kernel recording stays opt-in. CUPTI timestamps are mapped to the aligned host clock through an
offset measured at start (tightest of a few paired reads of `cupti.get_timestamp()` and
`time.monotonic_ns()`). Only one CUPTI activity client can run per process
(torch.profiler is one too): if enabling fails, recording switches itself off with one log line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from megascope.tracer.clock import HostClock

log = logging.getLogger("megascope.tracer")


def _cupti_to_mono_ns(cupti: Any, samples: int = 7) -> int:
    best_gap, best = None, 0
    for _ in range(samples):
        a = time.monotonic_ns()
        ts = int(cupti.get_timestamp())
        b = time.monotonic_ns()
        if best_gap is None or b - a < best_gap:
            best_gap, best = b - a, (a + b) // 2 - ts
    return best


class CuptiKernelRecorder:
    def __init__(self, device: torch.device, clock: HostClock, emit: Callable[[tuple], None],
                 flush_s: float = 2.0, buffer_mb: int = 8, every: int = 1) -> None:
        self.clock = clock
        self._buffer_bytes = buffer_mb * 1024 * 1024
        self._every = every
        # CUPTI records while all of these hold (enabled at start, as they are)
        self._wanted = {"tracer active": True, "step sampled": True}
        self.emit = emit
        self.kernels = 0
        self.callback_s = 0.0
        self.flush_s = 0.0
        self._cupti: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            log.info("tracer: CUPTI kernel recording off (device %s is not a GPU)", device)
            return
        try:
            from cupti import cupti

            self._kind = cupti.ActivityKind.CONCURRENT_KERNEL
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            cupti.activity_enable(self._kind)
            self._offset = _cupti_to_mono_ns(cupti)
            self._cupti = cupti
        except Exception as exc:
            log.info("tracer: CUPTI kernel recording off (%r); install cupti-python for it", exc)
            return
        self._thread = threading.Thread(target=self._run, args=(flush_s,), name="megascope-cupti",
                                        daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._cupti is not None

    def _buffer_requested(self) -> tuple[int, int]:
        return self._buffer_bytes, 0  # no record limit

    def _buffer_completed(self, activities: list) -> None:
        t0 = time.perf_counter()
        shift = self._offset + self.clock.shift_ns
        for act in activities:
            try:
                if act.kind != self._kind:
                    continue
                self.emit((str(act.name), int(act.stream_id), int(act.correlation_id),
                           int(act.start) + shift, int(act.end) + shift))
                self.kernels += 1
            except Exception as exc:  # called from CUPTI's thread: never raise into it
                log.warning("tracer: skipping a CUPTI record: %r", exc)
        self.callback_s += time.perf_counter() - t0

    def set_recording(self, on: bool) -> None:
        """Switch CUPTI's kernel activity on or off (the tracer's activate/deactivate call it: a tracer
        that is not active records no kernels, and the GPU pays nothing for it)."""
        self._want("tracer active", on)

    def set_step(self, step: int) -> None:
        """Record the kernels launched in every `every`-th step only: the cost is per recorded kernel."""
        self._want("step sampled", step % self._every == 0)

    def _want(self, reason: str, on: bool) -> None:
        was = all(self._wanted.values())
        self._wanted[reason] = on
        now = all(self._wanted.values())
        if self._cupti is None or now == was:
            return
        try:
            (self._cupti.activity_enable if now else self._cupti.activity_disable)(self._kind)
        except Exception as exc:
            log.warning("tracer: CUPTI kernel activity could not be switched %s: %r", "on" if now else "off", exc)

    def _run(self, flush_s: float) -> None:
        while not self._stop.wait(flush_s):
            self.flush()

    def flush(self) -> None:
        """Hand CUPTI's buffers to the callback, the partly filled ones too (forced)."""
        if self._cupti is None:
            return
        t0 = time.perf_counter()
        try:
            self._cupti.activity_flush_all(1)
        except Exception as exc:
            log.warning("tracer: CUPTI flush failed: %r", exc)
        self.flush_s += time.perf_counter() - t0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._cupti is not None:
            self.flush()
            try:
                self._cupti.activity_disable(self._kind)
            except Exception:
                pass
            log.info("tracer: CUPTI recorded %d kernels; %.2f s in its flushes, %.2f s in the record callback",
                     self.kernels, self.flush_s, self.callback_s)
