"""GPU span timing: pooled CUDA events, resolved off the training thread.

The training thread only records events on the current stream (no synchronization). A daemon thread
polls the oldest pending end event with `query()`, and once complete converts both events to host
time through a reference event whose host time is calibrated on an idle side stream:

    host_ns(ev) = ref_host_ns + ref.elapsed_time(ev) * 1e6

The reference is re-calibrated every `recalibrate_s`, so GPU/host clock drift never accumulates
(elapsed_time is a float32 number of ms: precision degrades with distance from the reference).
Resolved events go back to the pool; the pool grows only to the number of spans in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from megascope.tracer.clock import HostClock

log = logging.getLogger("megascope.tracer")


class CudaTimeline:
    def __init__(self, device: torch.device, clock: HostClock, emit: Callable[[tuple], None],
                 on_complete: Callable[[Any], None], max_pending: int, recalibrate_s: float = 10.0,
                 poll_s: float = 0.02) -> None:
        self.device = device
        self.clock = clock
        self.emit = emit
        self.on_complete = on_complete
        self.max_pending = max_pending
        self.recalibrate_s = recalibrate_s
        self.poll_s = poll_s
        self.dropped = 0
        self.resolved = 0
        self.created = 0
        self._pool: deque[torch.cuda.Event] = deque()
        self._pending: deque[tuple] = deque()
        self._ref: torch.cuda.Event | None = None
        self._ref_mono = 0
        self._ref_at = 0.0
        self._stop = threading.Event()
        self._side_stream = torch.cuda.Stream(device)
        self._calibrate()
        self._thread = threading.Thread(target=self._run, name="megascope-cuda-resolver", daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------
    def record(self) -> torch.cuda.Event:
        """Record a pooled event on the current stream (no sync)."""
        pool = self._pool
        if pool:
            event = pool.pop()
        else:
            event = torch.cuda.Event(enable_timing=True)
            self.created += 1
        event.record()
        return event

    def submit(self, prefix: tuple, issue_ns: int, start: torch.cuda.Event, end: torch.cuda.Event,
               op: Any = None) -> None:
        """Queue a finished span; it is written once `end` has run on the GPU."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            if op is not None:
                self.on_complete(op)
            return
        self._pending.append((prefix, issue_ns, start, end, op))

    # -- resolver thread ---------------------------------------------------------------------
    def _calibrate(self) -> None:
        """Pin a reference event to host time: record it on an idle stream and wait for it."""
        best: tuple[int, int, torch.cuda.Event] | None = None
        with torch.cuda.device(self.device):
            for _ in range(5):
                ref = torch.cuda.Event(enable_timing=True)
                before = time.monotonic_ns()
                ref.record(self._side_stream)
                ref.synchronize()  # off the training thread: blocks only the resolver
                after = time.monotonic_ns()
                if best is None or after - before < best[0]:
                    best = (after - before, (before + after) // 2, ref)
        assert best is not None
        self._ref, self._ref_mono, self._ref_at = best[2], best[1], time.monotonic()

    def _to_aligned_ns(self, event: torch.cuda.Event) -> int:
        assert self._ref is not None
        mono = self._ref_mono + int(round(self._ref.elapsed_time(event) * 1e6))
        return mono + self.clock.shift_ns

    def _resolve_ready(self, block: bool = False) -> None:
        pending = self._pending
        while pending:
            prefix, issue_ns, start, end, op = pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            pending.popleft()
            try:
                self.emit(prefix + (issue_ns, self._to_aligned_ns(start), self._to_aligned_ns(end)))
                self.resolved += 1
            finally:
                if op is not None:
                    self.on_complete(op)
                self._pool.append(start)
                self._pool.append(end)

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.wait(self.poll_s):
            try:
                if time.monotonic() - self._ref_at > self.recalibrate_s:
                    self._calibrate()
                self._resolve_ready()
            except Exception as exc:  # never let timing take the process down
                log.warning("tracer: resolving CUDA events failed: %r", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self._resolve_ready(block=True)
        except Exception as exc:
            log.warning("tracer: resolving the last CUDA events failed: %r", exc)
