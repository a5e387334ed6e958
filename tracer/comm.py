"""The comm layer: every collective and point-to-point op of the trainer goes through here.

Signatures mirror torch.distributed plus `group_name` ("tp", "dp", "pp", "world"). Ops on a group of
size 1 become local no-ops or copies (untraced), so callers never special-case a degree of 1.
The tracer hooks in here (one wrapper layer), so call sites need no hand-written spans: each op is
recorded with its kind, group name, bytes, peer and a sequence number

    collective: the n-th op of this rank in `group_name`    -> the same op matches across members
    p2p:        the n-th transfer this rank made to (send) or from (recv) that peer in `group_name`
                -> the k-th send A->B matches the k-th recv on B from A

`name=` / `names=` label ops (default all_reduce, reduce_scatter, all_gather, broadcast, send, recv).
`members` (global ranks of the group) is optional and only used in hang records; without it they are
looked up from the group when a hang is written. Async ops return a work whose completion ends the span
(see comm_spans for what issue/start/end mean and the `<op>.wait` spans).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from megascope.tracer import api
from megascope.tracer.comm_spans import abort, finish, tensor_bytes

_monotonic_ns = time.monotonic_ns  # hot path: tracer.now_ns() inlined as _monotonic_ns() + clock.shift_ns

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _collective(call: Any, tensor: torch.Tensor, nbytes: int, group: ProcessGroup | None, group_name: str,
                name: str, members: list[int] | None, async_op: bool) -> Any:
    """Issue `call()` traced as the next collective of this rank in `group_name`."""
    tracer = api._active
    if tracer is None:
        return call()
    issue_ns = _monotonic_ns() + tracer.clock.shift_ns  # first thing: the moment the op was asked for
    op = tracer.begin_comm(name, "collective", group_name, group, group_name, -1, nbytes, members,
                           tensor.is_cuda, issue_ns)
    try:
        work = call()
    except BaseException:
        abort([op])
        raise
    return finish([op], work if async_op else None, tensor.is_cuda)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, group_name: str, op: ReduceOp.RedOpType = ReduceOp.SUM,
               async_op: bool = False, name: str = "all_reduce", members: list[int] | None = None):
    if _size(group) == 1:
        return None
    return _collective(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                       tensor, tensor_bytes(tensor), group, group_name, name, members, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, group_name: str,
                          op: ReduceOp.RedOpType = ReduceOp.SUM, async_op: bool = False,
                          name: str = "reduce_scatter", members: list[int] | None = None):
    """bytes = the input (the whole tensor being reduced), the NCCL-tests convention."""
    if _size(group) == 1:
        output.copy_(input.view_as(output))
        return None
    return _collective(lambda: _reduce_scatter(output, input, op=op, group=group, async_op=async_op),
                       input, tensor_bytes(input), group, group_name, name, members, async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, group_name: str,
                           async_op: bool = False, name: str = "all_gather",
                           members: list[int] | None = None):
    """bytes = the output (the whole gathered tensor), the NCCL-tests convention."""
    if _size(group) == 1:
        output.copy_(input.view_as(output))
        return None
    return _collective(lambda: _all_gather(output, input, group=group, async_op=async_op),
                       output, tensor_bytes(output), group, group_name, name, members, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, group_name: str, async_op: bool = False,
              name: str = "broadcast", members: list[int] | None = None):
    """src is a global rank."""
    if _size(group) == 1:
        return None
    return _collective(lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                       tensor, tensor_bytes(tensor), group, group_name, name, members, async_op)


def _direction(p2p: dist.P2POp) -> str:
    fn = getattr(p2p.op, "__name__", "")
    return "send" if "send" in fn else "recv"


def batch_isend_irecv(ops: list[dist.P2POp], group_name: str = "pp", names: list[str] | None = None):
    """Batched point-to-point ops; `names` labels each op (e.g. send_forward, recv_backward).
    Returns one work per op (gloo) or the backend's coalesced works (NCCL); wait on all of them."""
    if not ops:
        return []
    if names is not None and len(names) != len(ops):
        raise ValueError(f"batch_isend_irecv: {len(names)} names for {len(ops)} ops; give one name per op")
    tracer = api._active
    if tracer is None:
        return dist.batch_isend_irecv(ops)
    issue_ns = _monotonic_ns() + tracer.clock.shift_ns
    traced = []
    for i, p2p in enumerate(ops):
        direction = _direction(p2p)
        name = names[i] if names is not None else direction
        tensor = p2p.tensor
        traced.append(tracer.begin_comm(name, "p2p", group_name, p2p.group, (group_name, direction, p2p.peer),
                                        p2p.peer, tensor_bytes(tensor), None, tensor.is_cuda, issue_ns))
    try:
        works = dist.batch_isend_irecv(ops)
    except BaseException:
        abort(traced)
        raise
    on_gpu = ops[0].tensor.is_cuda
    # gloo p2p works report is_completed() only after wait(): not watched by the completion tracker, wait() ends them
    if len(works) == len(ops):
        return [finish([op], work, on_gpu, has_completion=False) for op, work in zip(traced, works)]
    # coalesced (NCCL): every op completes with the batch, so each returned work ends all of them
    return [finish(traced, work, on_gpu, has_completion=False) for work in works]
