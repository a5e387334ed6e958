"""The comm layer: every collective and point-to-point op of the trainer goes through here.

Signatures mirror torch.distributed plus `group_name` ("tp", "dp", "pp", "world"). Ops on a group of
size 1 become local no-ops or copies, so callers never special-case a parallelism degree of 1.
The tracer hooks in here (one wrapper layer), so call sites need no hand-written spans.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group: object) -> int:
    return dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group: object, group_name: str, op: ReduceOp = ReduceOp.SUM,
               async_op: bool = False, name: str = "all_reduce"):
    if _size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: object, group_name: str,
                          op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
                          name: str = "reduce_scatter"):
    if _size(group) == 1:
        output.copy_(input.view_as(output))
        return None
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: object, group_name: str,
                           async_op: bool = False, name: str = "all_gather"):
    if _size(group) == 1:
        output.copy_(input.view_as(output))
        return None
    return _all_gather(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: object, group_name: str, async_op: bool = False,
              name: str = "broadcast"):
    """src is a global rank."""
    if _size(group) == 1:
        return None
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def batch_isend_irecv(ops: list[dist.P2POp], group_name: str = "pp", names: list[str] | None = None):
    """Batched point-to-point ops; `names` labels each op (e.g. send_forward, recv_backward)."""
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)
