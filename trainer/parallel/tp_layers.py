"""Megatron tensor-parallel layers built by SHARDING an existing full layer, so a model built from
the same seed on every rank and then sharded equals the single-process model exactly.

Parameter attributes set here (the contract with the optimizer / grad-norm code):
  tp_sharded         True on parameters split across the tp group (tp_shard_dim: the split dim).
  tp_grad_allreduce  True on replicated parameters whose gradient is partial (sequence parallelism);
                     `tensor_parallel.sync_tp_grads` all-reduces them after backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp

from megascope.trainer.modeling.model import PositionEmbedding
from megascope.trainer.parallel import tp_mappings


def _shard(full: torch.Tensor, group: dist.ProcessGroup | None, dim: int, what: str) -> nn.Parameter:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if full.shape[dim] % size:
        raise ValueError(f"{what}: dim {dim} of size {full.shape[dim]} is not divisible by tp={size}")
    shard = nn.Parameter(full.detach().chunk(size, dim=dim)[rank].clone())
    # attributes attached to the Parameter (as Megatron does), hence setattr: torch types declare none of them
    setattr(shard, "tp_sharded", True)
    setattr(shard, "tp_shard_dim", dim)  # where the shards concatenate back (checkpoints, tests)
    return shard


def _replicated(param: nn.Parameter, partial_grad: bool) -> nn.Parameter:
    setattr(param, "tp_sharded", False)
    if partial_grad:
        setattr(param, "tp_grad_allreduce", True)
    return param


class _ParallelLinear(nn.Module):
    """A linear layer holding this rank's shard of the weight (and its bias, sharded or not)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: dist.ProcessGroup | None,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight, self.bias = weight, bias

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, sequence_parallel={self.sequence_parallel}"


class ColumnParallelLinear(_ParallelLinear):
    """Y_i = X W_i^T + b_i with W split by output rows. The input enters the tensor-parallel region:
    all-gathered along the sequence under sequence parallelism, else copied (all-reduce in backward).
    The output stays split along its last dim (no gather)."""

    @classmethod
    def from_full(cls, full: nn.Linear, group: dist.ProcessGroup | None, sequence_parallel: bool,
                  what: str = "linear") -> "ColumnParallelLinear":
        bias = _shard(full.bias, group, 0, what) if full.bias is not None else None
        return cls(_shard(full.weight, group, 0, what), bias, group, sequence_parallel)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return tp_mappings.gather_sequence(x, self.group)
        return tp_mappings.copy_to_tp(x, self.group)

    def forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused bias+activation after the matmul."""
        return F.linear(self._enter(x), self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._enter(x), self.weight, self.bias)



class RowParallelLinear(_ParallelLinear):
    """Y = sum_i X_i W_i^T + b with W split by input columns; the input is already split (it is a
    column-parallel output). The partial sums are reduce-scattered along the sequence under sequence
    parallelism, else all-reduced; the replicated bias is added after the reduction (once)."""

    @classmethod
    def from_full(cls, full: nn.Linear, group: dist.ProcessGroup | None, sequence_parallel: bool,
                  what: str = "linear") -> "RowParallelLinear":
        # Under SP the bias sees only this rank's s/tp tokens: its gradient is partial.
        bias = _replicated(full.bias, sequence_parallel) if full.bias is not None else None
        return cls(_shard(full.weight, group, 1, what), bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = tp_mappings.reduce_scatter_sequence(partial, self.group)
        else:
            out = tp_mappings.reduce_from_tp(partial, self.group)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [rank*V/tp, (rank+1)*V/tp) of the table, looks up the tokens it owns
    (zeros elsewhere), and the partial embeddings are summed: all-reduce, or reduce-scatter along
    the sequence so the output is already in the sequence-parallel layout [b, s/tp, h]."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(full.weight, group, 0, "embedding (vocab_size)")
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        foreign = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill(foreign, 0), self.weight)
        partial = partial.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return tp_mappings.reduce_scatter_sequence(partial, self.group)
        return tp_mappings.reduce_from_tp(partial, self.group)


class SequenceParallelPositions(PositionEmbedding):
    """The same (replicated) position table; this rank's tokens start at rank * s/tp."""

    def __init__(self, full: PositionEmbedding, group: dist.ProcessGroup | None) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.weight = _replicated(full.weight, partial_grad=True)

    def first_position(self, seq_local: int) -> int:
        return dist.get_rank(self.group) * seq_local


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary (Megatron-LM): the max, the
    target logit and the softmax denominator are reduced over the tp group; logits never gathered."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        row_max = tp_mappings.all_reduce_tp(logits.max(dim=-1).values, group, "ce_all_reduce_max", ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = targets - start
        owned = (local_target >= 0) & (local_target < vocab_local)
        local_target = local_target.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * owned
        target_logit = tp_mappings.all_reduce_tp(target_logit, group, "ce_all_reduce_target")
        exp = shifted.exp()
        sum_exp = tp_mappings.all_reduce_tp(exp.sum(dim=-1), group, "ce_all_reduce_sum_exp")
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), owned, local_target)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, owned, local_target = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= owned.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean token cross-entropy of [b, s, V/tp] logits against full [b, s] targets."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), self.group).mean()
