"""Completion times of asynchronous CPU (gloo) collectives, observed off the training thread.

A gloo async collective completes on a c10d worker thread. A done-callback on its future would run
Python there: it has to take the GIL from the training thread, which stalls that worker (and every
collective queued behind it, and the peers waiting on those) for up to the interpreter's switch
interval; on the tiny preset that cost +4% step time. Instead one daemon thread polls
`is_completed()` of the pending works every `poll_s` while any is pending (it sleeps on an event
otherwise) and ends each op the first time it sees it done: an upper bound on the completion, at most
one poll period plus a GIL hand-off late. The training thread's wait() observes completion too (when
it blocked, its return is the tighter bound); the first observation ends the op.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

log = logging.getLogger("megascope.tracer")


class Watched(Protocol):
    def poll_done(self) -> bool:
        """End the op if its work completed; True once ended (by this call or earlier)."""


class CompletionPoller:
    def __init__(self, poll_s: float = 0.001, max_pending: int = 4096,
                 thread_name: str = "megascope-completion") -> None:
        self.poll_s = poll_s
        self.max_pending = max_pending
        self.polls = 0
        self._pending: deque[Watched] = deque()
        self._wake = threading.Event()
        self._idle = False  # the thread is (about to be) asleep on _wake: only then is set() needed
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def watch(self, item: Watched) -> bool:
        """Training thread: poll `item` until it is done. False (not watched) when too many are
        pending, e.g. a hung group: those ops end at wait() instead."""
        if self._stopping or len(self._pending) >= self.max_pending:
            return False
        self._pending.append(item)
        if self._idle:  # Event.set() costs a few us of Python (Condition); skip it while polling
            self._wake.set()
        return True

    def pending(self) -> int:
        return len(self._pending)

    def poll(self) -> None:
        """One pass over the pending works (also called by close and by tests)."""
        pending = self._pending
        self.polls += 1
        # pop exactly the items present now; the training thread may append concurrently (deque
        # appends and pops are atomic), and what it adds is seen on the next pass
        for _ in range(len(pending)):
            item = pending.popleft()
            try:
                done = item.poll_done()
            except Exception as exc:  # a broken work: stop watching it, its wait() still ends the op
                log.warning("tracer: polling an async collective failed: %r", exc)
                done = True
            if not done:
                pending.append(item)

    def _run(self) -> None:
        while not self._stopping:
            # idle first, then look: an append after the look sees idle and sets the event
            self._idle = True
            if not self._pending:
                self._wake.wait()
            self._idle = False
            self._wake.clear()
            while self._pending and not self._stopping:
                time.sleep(self.poll_s)
                try:
                    self.poll()
                except Exception as exc:  # never let timing take the process down
                    log.warning("tracer: completion poller failed: %r", exc)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; a last pass ends the ops that completed meanwhile (the others end at wait())."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self.poll()
        self._pending.clear()
