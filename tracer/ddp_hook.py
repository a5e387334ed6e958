"""A DDP communication hook that records each gradient bucket's all-reduce, then runs DDP's default.

DistributedDataParallel's reducer issues its bucket all-reduces from C++, below anything Python can
intercept; a communication hook is the one place DDP hands each bucket to Python. This one does what
DDP's default `allreduce_hook` does (divide by the group size, async all-reduce, return the reduced
bucket through the future) and records the op as the comm layer records its own (tracer/comm_spans.py):
name `grad_all_reduce` (the trainer's name for its gradient all-reduce), kind collective, the group
named from the layout (dp for a plain DDP job), a seq shared with every other op of that group, the
bucket's bytes, and:
    issue_ns  the hook was called (the bucket is ready);
    start_ns  CPU: the async all-reduce call returned (enqueued on gloo's worker); GPU: a CUDA event
              on the current stream before the call (as the comm layer);
    end_ns    CPU: the future's callback ran (the all-reduce completed; the default hook runs a Python
              callback there too, so no extra GIL hand-off on gloo's worker); GPU: an event recorded
              in that callback, on the stream that waits for the NCCL work.
A DDP model takes one communication hook: if the job registered its own, this one is not added
(attach logs it) and the job's hook's Python-level collectives are seen by the interceptor instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megascope.tracer import api, comm_spans
from megascope.tracer.attach_topology import AttachLayout

log = logging.getLogger("megascope.tracer")
_monotonic_ns = time.monotonic_ns
GRAD_ALL_REDUCE = "grad_all_reduce"


@dataclass
class DdpHookState:
    process_group: Any
    group_name: str
    members: list[int]


def _reduced(fut: Any) -> torch.Tensor:
    return fut.value()[0]


def traced_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 (see the docstring)
    """DDP comm hook: `ddp_model.register_comm_hook(state, traced_allreduce_hook)`; state is a
    DdpHookState, bucket a dist.GradBucket, the result a Future of the reduced bucket. Not annotated:
    DDP compares the annotations to dist.GradBucket and Future[Tensor], and this module's postponed
    (string) annotations would not compare equal."""
    group, tensor = state.process_group, bucket.buffer()
    tensor.div_(len(state.members))  # DDP's default: average (divide first, against fp16 overflow)
    tracer = api._active
    if tracer is None:
        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(_reduced)
    issue_ns = _monotonic_ns() + tracer.clock.shift_ns
    on_gpu = tensor.is_cuda
    op = tracer.begin_comm(GRAD_ALL_REDUCE, "collective", state.group_name, group,
                           state.group_name or ("pg", id(group)), -1, comm_spans.tensor_bytes(tensor),
                           state.members, on_gpu, issue_ns)
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
    except BaseException:
        comm_spans.abort([op])
        raise
    if op is None:
        return work.get_future().then(_reduced)
    if not on_gpu and op.start is not None:
        op.start = _monotonic_ns() + tracer.clock.shift_ns  # the backend has the op

    def completed(fut: Any) -> torch.Tensor:
        if on_gpu:
            tracer.end_comm_gpu(op)
        else:
            tracer.end_comm_host(op, _monotonic_ns() + tracer.clock.shift_ns)
        return fut.value()[0]  # raises the all-reduce's error, if any, into DDP

    return work.get_future().then(completed)


def register(model: torch.nn.parallel.DistributedDataParallel, layout: AttachLayout) -> bool:
    """Register the hook on a DistributedDataParallel model; False (and a log line) when it cannot."""
    group = getattr(model, "process_group", None) or dist.group.WORLD
    members = [int(r) for r in dist.get_process_group_ranks(group)]
    state = DdpHookState(group, layout.group_name(members), members)
    if getattr(model, "_comm_hooks", None):
        log.warning("tracer: the DDP model already has a communication hook; its bucket all-reduces are "
                    "traced only where that hook calls torch.distributed from Python")
        return False
    try:
        model.register_comm_hook(state, traced_allreduce_hook)
    except RuntimeError as exc:  # a builtin hook, or the hook registered after backward started
        log.warning("tracer: cannot register the DDP communication hook (%s); DDP's bucket all-reduces "
                    "are not traced", exc)
        return False
    return True
