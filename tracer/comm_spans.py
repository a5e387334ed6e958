"""How one comm op becomes a span (an events row): begin it, end it on return or on its work's
completion. The comm layer (comm.py), the torch.distributed interception and the DDP hook all record ops here.

Times of one op (events columns):
    issue_ns  host time the wrapper was asked for the op, before any bookkeeping or backend call
    start_ns  CPU sync: = issue_ns (the host runs the op inside the call); CPU async: when the backend
              call returned (the op is enqueued on the c10d worker); GPU: the start event on the stream
    end_ns    CPU sync: the call returned; CPU async collective: its completion, observed by the
              completion tracker (tracer events of the training thread, a 0.5 s sweeper) or by
              wait(), whichever saw it first (see completion.py); CPU p2p (gloo reports no
              completion before wait()): wait() returned; GPU: the end event recorded after the call
              (sync) or after wait() made the current stream wait on the op (async)

A CPU wait() that may have blocked is recorded as its own host span, `<op>.wait` (same group, seq and
peer as the op; the ambient step and micro-batch of the waiter), so the time the training thread sat
in wait() is not mistaken for the op's transfer time, nor for the compute span it happens in.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import torch

from megascope.tracer import api
from megascope.tracer.watchdog import CommOp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_monotonic_ns = time.monotonic_ns  # hot path: tracer.now_ns() inlined as _monotonic_ns() + clock.shift_ns


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def begin(name: str, kind: str, group_name: str, group: ProcessGroup | None, seq_key: Any, nbytes: int,
          tensor: torch.Tensor, peer: int = -1, members: list[int] | None = None,
          issue_ns: int | None = None) -> CommOp | None:
    tracer = api._active
    if tracer is None:
        return None
    return tracer.begin_comm(name, kind, group_name, group, seq_key, peer, nbytes, members, tensor.is_cuda,
                             issue_ns)


def abort(ops: list[CommOp | None]) -> None:
    """The call raised: drop the in-flight entries so the watchdog does not report a phantom hang."""
    tracer = api._active
    for op in ops:
        if op is not None and tracer is not None:
            op.start = None
            tracer.end_comm_host(op)


def finish(ops: list[CommOp | None], work: Any, on_gpu: bool, has_completion: bool = True) -> Any:
    """After issuing: end sync ops now; wrap async work so its completion ends the ops.
    has_completion: the work's is_completed() turns true on its own (gloo collectives; not gloo p2p)."""
    # no copy on the hot path when every op was begun (the `in` test is what makes the cast true)
    live = cast("list[CommOp]", ops) if None not in ops else [op for op in ops if op is not None]
    if not live:
        return work
    tracer = api._active
    if tracer is None:  # deactivated between begin and here: nothing records; drop the entries
        for op in live:
            op.done = True
        return work
    if work is None:
        for op in live:
            if on_gpu:
                tracer.end_comm_gpu(op)
            else:
                tracer.end_comm_host(op)
        return None
    traced = TracedWork(work, live, on_gpu, tracer)
    if not on_gpu:
        started = _monotonic_ns() + tracer.clock.shift_ns  # the backend has the op (enqueued on its worker)
        for op in live:
            if op.start is not None:
                op.start = started
        if has_completion and tracer.completion is not None:
            traced.watched = tracer.completion.watch(traced)
    return traced


class TracedWork:
    """A torch.distributed Work whose completion ends the traced ops; otherwise the same object."""

    __slots__ = ("_work", "_ops", "_on_gpu", "_tracer", "_ended", "watched")

    def __init__(self, work: Any, ops: list[CommOp], on_gpu: bool, tracer: Any) -> None:
        self._work = work
        self._ops = ops
        self._on_gpu = on_gpu
        self._tracer = tracer  # the tracer that began the ops ends them, even after a deactivate()
        self._ended = False
        self.watched = False
        """The completion tracker observes this work (its is_completed() is meaningful)."""

    def _end(self, end_ns: int | None = None) -> None:
        # first observation wins: a concurrent second call is a no-op in end_comm_host (op.done)
        if self._ended:
            return
        self._ended = True
        tracer = self._tracer
        for op in self._ops:
            if self._on_gpu:
                tracer.end_comm_gpu(op)
            else:
                tracer.end_comm_host(op, end_ns)

    def poll_done(self, now_ns: int | None) -> bool:
        """Completion tracker (training thread or sweeper): end the ops if the work completed."""
        if self._ended:
            return True
        if not self._work.is_completed():
            return False
        self._end(_monotonic_ns() + self._tracer.clock.shift_ns if now_ns is None else now_ns)
        return True

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        work = self._work
        if self._ended or self._on_gpu:  # GPU: wait() only makes the current stream wait; no host block
            result = work.wait(*args, **kwargs)
            self._end()
            return result
        if self.watched and work.is_completed():  # completed before wait(): nothing blocks, no wait span
            self._end()
            return work.wait(*args, **kwargs)
        tracer = self._tracer
        begin_ns = _monotonic_ns()
        result = work.wait(*args, **kwargs)
        shift = tracer.clock.shift_ns
        begin_ns, end_ns = begin_ns + shift, _monotonic_ns() + shift
        self._end(end_ns)
        tracer.record_wait(self._ops[0], begin_ns, end_ns)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> Any:
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
