"""Pipeline parallelism: cut a (tensor-parallel) GPT into pp stages of vpp virtual chunks each.

Megatron-LM's interleaved assignment: the model is cut into pp*vpp equal runs of layers ("virtual
stages"); chunk c of stage p holds virtual stage c*pp + p. With vpp = 1 that is the usual contiguous
split. The token and position embeddings live on virtual stage 0 (chunk 0 of stage 0), the final
LayerNorm, the head and the loss on the last virtual stage (chunk vpp-1 of stage pp-1).

Tied embedding: the head shares the embedding's weight. When pp > 1 the two ends are different
ranks, so the last stage holds its own copy (identical at start: every rank builds the full model from
the same seed). Both copies are trained with the summed gradient: after the data-parallel reduction,
`TiedEmbeddingSync.all_reduce_grads` sums the two copies' gradients over the embedding group
{first stage, last stage} of ranks with the same dp/tp coordinates (Megatron's embedding group).
Both copies are marked `shared_embedding` (the optimizer gives each a bucket of its own, so both are
sharded identically over dp) and the last stage's copy `norm_owner=False` (counted once in the norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megascope.tracer import comm
from megascope.trainer.modeling.model import GPT
from megascope.trainer.parallel.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one model chunk sits in the pipeline."""

    stage: int
    chunk: int
    virtual_stage: int
    n_virtual: int
    first_layer: int
    n_layers: int

    @property
    def is_first(self) -> bool:
        return self.virtual_stage == 0

    @property
    def is_last(self) -> bool:
        return self.virtual_stage == self.n_virtual - 1


def chunk_placements(n_layers: int, pp: int, vpp: int, stage: int) -> list[ChunkPlacement]:
    """The vpp chunks of `stage`, in chunk order, with the layers each holds."""
    if pp < 1 or vpp < 1 or not 0 <= stage < pp:
        raise ValueError(f"bad pipeline layout pp={pp}, vpp={vpp}, stage={stage}")
    n_virtual = pp * vpp
    if n_layers % n_virtual:
        raise ValueError(f"n_layers={n_layers} is not divisible by pp*vpp={n_virtual}; "
                         "change --pp/--vpp or the number of layers")
    per_chunk = n_layers // n_virtual
    if per_chunk < 1:
        raise ValueError(f"pp*vpp={n_virtual} exceeds n_layers={n_layers}: every chunk needs a layer")
    out = []
    for c in range(vpp):
        vs = c * pp + stage
        out.append(ChunkPlacement(stage, c, vs, n_virtual, vs * per_chunk, per_chunk))
    return out


class PipelineChunk(nn.Module):
    """One virtual stage: [embedding] + a run of blocks + [final norm, head, loss].

    forward(x) takes token ids on the first virtual stage and hidden states [b, s_local, h] elsewhere,
    and returns hidden states; `loss(hidden, targets)` (last virtual stage only) applies the head and
    the loss. Both reuse the plain model's own methods, so a pipeline computes exactly what GPT does.
    """

    def __init__(self, model: GPT, placement: ChunkPlacement) -> None:
        super().__init__()
        self.placement = placement
        if placement.is_first:
            self.embed, self.pos = model.embed, model.pos
        start = placement.first_layer
        self.blocks = nn.ModuleList(model.blocks[start:start + placement.n_layers])
        if placement.is_last:
            self.norm_f, self.lm_head, self.loss_fn = model.norm_f, model.lm_head, model.loss_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement.is_first:
            x = GPT.embed_tokens(self, x)  # type: ignore[arg-type]  # duck-typed: embed + pos
        for block in self.blocks:
            x = block(x)
        return x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.placement.is_last:
            raise RuntimeError("loss() is only defined on the last virtual stage (it holds the head)")
        logits = GPT.head(self, hidden)  # type: ignore[arg-type]  # duck-typed: norm_f + lm_head
        return GPT.loss(self, logits, targets)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        p = self.placement
        return (f"stage={p.stage}, chunk={p.chunk}, virtual_stage={p.virtual_stage}, "
                f"layers={p.first_layer}..{p.first_layer + p.n_layers - 1}")


def split_into_chunks(model: GPT, n_layers: int, pp: int, vpp: int, stage: int) -> list[PipelineChunk]:
    """This stage's chunks. Modules of other stages are left behind with `model` (free it after)."""
    chunks = [PipelineChunk(model, p) for p in chunk_placements(n_layers, pp, vpp, stage)]
    if pp > 1 and model.cfg.tie_embeddings:
        _untie_last_stage(chunks)
    return chunks


def _untie_last_stage(chunks: list[PipelineChunk]) -> None:
    """Give the last stage its own copy of the tied weight (the embedding lives on another rank)."""
    for chunk in chunks:
        if chunk.placement.is_first:
            setattr(chunk.embed.weight, "shared_embedding", True)  # a Parameter attribute (see tp_layers)
        if chunk.placement.is_last:
            shared = chunk.lm_head.weight
            copy = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            copy.__dict__.update(shared.__dict__)  # tp_sharded, tp_shard_dim, ...
            setattr(copy, "shared_embedding", True)
            setattr(copy, "norm_owner", False)  # the first stage's copy is the one the global norm counts
            chunk.lm_head.weight = copy


def tied_embedding_weight(chunks: list[PipelineChunk]) -> nn.Parameter | None:
    """This rank's copy of the tied embedding when it is split across stages, else None."""
    for chunk in chunks:
        for module_name in ("embed", "lm_head"):
            module = getattr(chunk, module_name, None)
            if module is not None and getattr(module.weight, "shared_embedding", False):
                return module.weight
    return None


class TiedEmbeddingSync:
    """Sums the gradients of the two copies of a tied embedding over the embedding group
    {rank_of(0, dp, tp), rank_of(pp-1, dp, tp)}. Every rank must construct it (group creation is
    collective); ranks off both ends hold no weight and do nothing in all_reduce_grads."""

    def __init__(self, dims: ParallelDims, rank: int, weight: nn.Parameter | None) -> None:
        self.weight = weight
        self.group = None
        if dims.pp == 1:
            return
        pairs = [[dims.rank_of(0, d, t), dims.rank_of(dims.pp - 1, d, t)]
                 for d in range(dims.dp) for t in range(dims.tp)]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        c = dims.coords(rank)
        if c.pp in (0, dims.pp - 1) and weight is not None:
            self.group = mine

    @property
    def active(self) -> bool:
        return self.group is not None

    def all_reduce_grads(self) -> None:
        """Call after the data-parallel reduction and before the optimizer step. The copy's bucket is
        sharded the same way on both stages, so summing the whole gradient buffer is exact for this
        rank's shard (ZeRO) and for the whole buffer (plain data parallelism), as in Megatron."""
        if self.group is None or self.weight is None:
            return
        grad = getattr(self.weight, "main_grad", None)
        if grad is None:
            grad = self.weight.grad
        if grad is None:
            raise RuntimeError("the tied embedding has no gradient to synchronize; run backward first")
        comm.all_reduce(grad, self.group, "embedding", name="embedding_grad_all_reduce")
