"""Completion times of asynchronous CPU (gloo) collectives, observed without waking anyone per op.

A gloo async collective completes on a c10d worker thread, and nothing tells Python when without a
thread paying for it. Measured on the tiny preset (2-core machine, 4 ranks), per observation:
  - a done-callback on the work's future runs Python on gloo's worker, which must take the GIL from the
    training thread: it stalls that worker and every collective queued behind it (+4% step time);
  - a thread polling is_completed() every 1 ms, or blocking in wait() and waking at each completion,
    costs a wake-up and two GIL hand-offs each (~30 us of CPU there; +2-7% CPU per step);
  - any thread wake-up costs 0.1-0.27 ms of CPU in this VM (/proc schedstat of a thread sleeping 50 ms
    at a time; 0.09 ms under load): a 50 ms sweeper alone took 3.3 ms of CPU per second, idle or not.
So completion is observed where it is nearly free: the training thread checks `is_completed()` of the
pending works (a C++ call, ~0.2 us each, only while some are pending) at its own tracer events (span
edges, comm issues, step boundaries); wait() checks its own work, or observes it at its return; and a
sweeper thread checks every `sweep_s` (0.5 s), for a training thread that does untraced work (or sleeps)
meanwhile.
The first observation ends the op: the recorded end is an upper bound, late by at most the distance to
the next tracer event on the training thread (sub-ms to a few ms in the trainer) or `sweep_s`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Protocol

log = logging.getLogger("megascope.tracer")


class Watched(Protocol):
    def poll_done(self, now_ns: int | None) -> bool:
        """End the op (at now_ns, or now when None) if its work completed; True once ended."""


class CompletionTracker:
    def __init__(self, sweep_s: float = 0.5, max_pending: int = 4096,
                 thread_name: str = "megascope-completion") -> None:
        self.sweep_s = sweep_s
        self.max_pending = max_pending
        self.sweeps = 0
        """Sweeps by the background thread that found something pending."""
        self.pending: deque[Watched] = deque()
        """Works not yet seen complete; read by the training thread's hot path (truthiness only)."""
        self.closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def watch(self, item: Watched) -> bool:
        """Training thread: end `item`'s ops once its work is seen complete. False (not watched) when
        too many are pending, e.g. a hung group: those ops end at wait() instead."""
        if self.closed or len(self.pending) >= self.max_pending:
            return False
        self.pending.append(item)
        return True

    def sweep(self, now_ns: int | None = None) -> None:
        """End every pending op whose work has completed. Called by the training thread and the sweeper
        concurrently: deque pops and appends are atomic, each item is held by one of them at a time, and
        ending an op twice is a no-op (first wins)."""
        pending = self.pending
        for _ in range(len(pending)):
            try:
                item = pending.popleft()
            except IndexError:  # the other sweeper took the last ones
                return
            try:
                done = item.poll_done(now_ns)
            except Exception as exc:  # a broken work: stop watching it, its wait() still ends the op
                log.warning("tracer: checking an async collective failed: %r", exc)
                done = True
            if not done:
                pending.append(item)

    def _run(self) -> None:
        while not self._stop.wait(self.sweep_s):
            if self.pending:
                self.sweeps += 1
                try:
                    self.sweep()
                except Exception as exc:  # never let timing take the process down
                    log.warning("tracer: completion sweep failed: %r", exc)

    def close(self) -> None:
        """Stop the thread; a last sweep ends the ops that completed meanwhile (the others end at wait())."""
        self.closed = True
        self._stop.set()
        self._thread.join(5.0)
        self.sweep()
        self.pending.clear()
