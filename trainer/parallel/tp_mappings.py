"""The autograd-aware collectives of Megatron tensor and sequence parallelism.

Each function is the identity, a split, a gather or a reduction in forward and its adjoint in backward
(Megatron-LM's mappings). Every collective goes through `megascope.tracer.comm` with group_name "tp";
on a tensor-parallel group of size 1 they all reduce to identities.

    copy_to_tp           fwd identity                 bwd all-reduce
    reduce_from_tp       fwd all-reduce               bwd identity
    scatter_to_tp        fwd keep my chunk of `dim`   bwd all-gather along `dim`
    gather_from_tp       fwd all-gather along `dim`   bwd keep my chunk
    gather_sequence      fwd all-gather along seq     bwd reduce-scatter along seq   (SP, before column-parallel)
    reduce_scatter_sequence  fwd reduce-scatter seq   bwd all-gather along seq       (SP, after row-parallel)

Sequence is dim 1 of [b, s, h]. The collectives work on dim 0, so the tensor is moved to
[s, b, h] for the transfer (one copy each way; Megatron keeps [s, b, h] throughout to avoid it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from megascope.tracer import comm

SEQ_DIM = 1


def _size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def all_reduce_tp(x: torch.Tensor, group: ProcessGroup | None, name: str = "tp_all_reduce",
                  op: ReduceOp.RedOpType = ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place all-reduce over the tp group (the input may be needed by autograd)."""
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, group, "tp", op=op, name=name)
    return out


def all_gather_along(x: torch.Tensor, group: ProcessGroup | None, dim: int, name: str) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, moved, group, "tp", name=name)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, group: ProcessGroup | None, dim: int, name: str) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {size} tp ranks; "
                         "it must be divisible by tp (seq_len % tp == 0 for sequence parallelism)")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, moved, group, "tp", name=name)
    return out.movedim(0, dim)


def _chunk_along(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {size} tp ranks; "
                         "it must be divisible by tp")
    return x.chunk(size, dim=dim)[_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tp(grad, ctx.group, "tp_all_reduce_grad"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_tp(x, group, "tp_all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _chunk_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim, "tp_all_gather_grad"), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim, "tp_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return _chunk_along(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, group, SEQ_DIM, "sp_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.group, SEQ_DIM, "sp_reduce_scatter_grad"), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along(x, group, SEQ_DIM, "sp_reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, SEQ_DIM, "sp_all_gather_grad"), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    return _ScatterToTP.apply(x, group, dim % x.dim())


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    return _GatherFromTP.apply(x, group, dim % x.dim())


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (e.g. a full-sequence input entering the SP region)."""
    return _ScatterToTP.apply(x, group, SEQ_DIM)
