"""Tracing glue for the comm wrappers: begin an op, end it on return or on its work's completion.

Sync ops end when the call returns (CPU) or at an end event recorded right after it (GPU: the current
stream waits on the NCCL stream there). Async ops return a TracedWork: on CPU/gloo a done-callback on
the work's future stamps the real completion time (falling back to wait()), on GPU `wait()` records
the end event after making the current stream wait on the op.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from megascope.tracer import api
from megascope.tracer.watchdog import CommOp


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def begin(name: str, kind: str, group_name: str, group: object, seq_key: Any, nbytes: int,
          tensor: torch.Tensor, peer: int = -1, members: list[int] | None = None) -> CommOp | None:
    tracer = api._active
    if tracer is None:
        return None
    return tracer.begin_comm(name, kind, group_name, group, seq_key, peer, nbytes, members, tensor.is_cuda)


def _end_now(op: CommOp, on_gpu: bool, end_ns: int | None = None) -> None:
    tracer = api._active
    if tracer is None:
        op.done = True
        return
    if on_gpu:
        tracer.end_comm_gpu(op)
    else:
        tracer.end_comm_host(op, end_ns)


def abort(ops: list[CommOp | None]) -> None:
    """The call raised: drop the in-flight entries so the watchdog does not report a phantom hang."""
    tracer = api._active
    for op in ops:
        if op is not None and tracer is not None:
            op.start = None
            tracer.end_comm_host(op)


def finish(ops: list[CommOp | None], work: Any, on_gpu: bool) -> Any:
    """After issuing: end sync ops now; wrap async work so its completion ends the ops."""
    live = [op for op in ops if op is not None]
    if not live:
        return work
    if work is None:
        for op in live:
            _end_now(op, on_gpu)
        return None
    return TracedWork(work, live, on_gpu)


class TracedWork:
    """A torch.distributed Work whose completion ends the traced ops; otherwise the same object."""

    def __init__(self, work: Any, ops: list[CommOp], on_gpu: bool) -> None:
        self._work = work
        self._ops = ops
        self._on_gpu = on_gpu
        self._ended = False
        self._lock = threading.Lock()
        if not on_gpu:
            self._watch_future()

    def _watch_future(self) -> None:
        try:
            future = self._work.get_future()
        except Exception:  # some backends' p2p works have no future: wait() ends the span instead
            return
        tracer = api._active
        clock_now = tracer.now_ns if tracer is not None else None
        if clock_now is not None:
            future.add_done_callback(lambda _fut: self._end(clock_now()))

    def _end(self, end_ns: int | None = None) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        for op in self._ops:
            _end_now(op, self._on_gpu, end_ns)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._end()
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> Any:
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
