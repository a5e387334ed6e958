"""Megatron-LM tensor parallelism (+ sequence parallelism) as a transform of the plain GPT.

`apply_tp(model, dims, sequence_parallel)` shards the full model in place (every rank built the same
full model from the same seed, so the result equals the single-process model):

    embed      -> VocabParallelEmbedding   rows split by vocabulary; all-reduce / SP reduce-scatter
    pos        -> replicated; under SP each rank adds the positions of its own sequence chunk
    attn.qkv   -> ColumnParallelLinear     heads split across ranks (rows are per-head interleaved)
    attn.proj  -> RowParallelLinear
    mlp.fc1    -> ColumnParallelLinear     (bias split; the fused bias+GeLU runs on the shard)
    mlp.fc2    -> RowParallelLinear
    ln_*, norm_f  replicated; under SP they run on s/tp tokens
    lm_head    -> ColumnParallelLinear (tied: shares the vocab-parallel embedding shard), logits stay
                  split along the vocabulary
    loss_fn    -> VocabParallelCrossEntropy

Parameter attributes (see tp_layers): tp_sharded, tp_shard_dim, tp_grad_allreduce, and
norm_owner = False on replicated parameters of tp ranks > 0, so a global norm counts each element once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megascope.tracer import comm
from megascope.trainer.modeling.model import GPT, Block
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositions,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    _replicated,
)
from megascope.trainer.parallel.tp_mappings import all_gather_along


def apply_tp(model: GPT, dims: ParallelDims, sequence_parallel: bool) -> None:
    """Shard `model` over dims.groups["tp"] in place; a no-op when tp == 1."""
    if dims.tp == 1:
        return
    _check_divisible(model, dims.tp, sequence_parallel)
    group, sp = dims.groups["tp"], sequence_parallel
    tied = model.lm_head.weight is model.embed.weight
    # Each layer is swapped for its parallel version with setattr (as torch's parallelize_module does):
    # the model declares its attributes with the plain layers' types.
    embed = VocabParallelEmbedding(model.embed, group, sp)
    setattr(model, "embed", embed)
    if sp:
        model.pos = SequenceParallelPositions(model.pos, group)
    for block in model.blocks:
        assert isinstance(block, Block)
        setattr(block.attn, "qkv", ColumnParallelLinear.from_full(block.attn.qkv, group, sp, "attn.qkv"))
        setattr(block.attn, "proj", RowParallelLinear.from_full(block.attn.proj, group, sp, "attn.proj"))
        setattr(block.mlp, "fc1", ColumnParallelLinear.from_full(block.mlp.fc1, group, sp, "mlp.fc1"))
        setattr(block.mlp, "fc2", RowParallelLinear.from_full(block.mlp.fc2, group, sp, "mlp.fc2"))
        for norm in (block.ln_1, block.ln_2):
            if norm is not None:
                _mark_norm(norm, sp)
    _mark_norm(model.norm_f, sp)
    if tied:  # the head's weight is the vocab-parallel embedding shard itself
        setattr(model, "lm_head", ColumnParallelLinear(embed.weight, None, group, sp))
    else:
        setattr(model, "lm_head", ColumnParallelLinear.from_full(model.lm_head, group, sp, "lm_head (vocab_size)"))
    setattr(model, "loss_fn", VocabParallelCrossEntropy(group))
    _mark_norm_owners(model, dist.get_rank(group))


def sync_tp_grads(model: nn.Module, dims: ParallelDims) -> None:
    """All-reduce over the tp group the gradients of replicated parameters that only saw this rank's
    sequence chunk (tp_grad_allreduce). Uses `param.main_grad` (the data-parallel fp32 buffer view)
    when the parameter has one, else `param.grad`. One flat collective; call after backward (and
    after the dp reduction if there is one: the two sums commute), before the optimizer."""
    grads = [g for g in (_grad_of(p) for p in model.parameters() if getattr(p, "tp_grad_allreduce", False))
             if g is not None]
    if dims.tp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, dims.groups["tp"], "tp", name="tp_grad_allreduce")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _grad_of(param: nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def full_tensor(shard: torch.Tensor, param: nn.Parameter, dims: ParallelDims) -> torch.Tensor:
    """Reassemble the full tensor of a tp-sharded parameter (its value or its gradient) on every tp
    rank; returns `shard` itself for replicated parameters. A collective: every tp rank must call it."""
    if not getattr(param, "tp_sharded", False) or dims.tp == 1:
        return shard
    return all_gather_along(shard.detach(), dims.groups["tp"], getattr(param, "tp_shard_dim"), "tp_unshard")


def _mark_norm(norm: nn.Module, sequence_parallel: bool) -> None:
    for p in norm.parameters(recurse=False):
        _replicated(p, partial_grad=sequence_parallel)


def _mark_norm_owners(model: nn.Module, tp_rank: int) -> None:
    for p in model.parameters():
        setattr(p, "norm_owner", bool(getattr(p, "tp_sharded", False)) or tp_rank == 0)


def _check_divisible(model: GPT, tp: int, sequence_parallel: bool) -> None:
    cfg = model.cfg
    checks = [("n_heads", cfg.n_heads), ("vocab_size", cfg.vocab_size), ("MLP width", cfg.hidden * cfg.ffn_mult)]
    if sequence_parallel:
        checks.append(("seq_len (sequence parallelism)", cfg.seq_len))
    for what, value in checks:
        if value % tp:
            raise ValueError(f"{what}={value} is not divisible by tp={tp}; pick a tp that divides it")
