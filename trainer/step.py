"""One training step of a 3D-parallel rank: the pipeline schedule over all micro-batches, the gradient
reductions (data parallel, tensor parallel, tied embedding), the optimizer step, the reported loss.

Order of the gradient reductions, and why:
  1. data-parallel reduce-scatter per bucket: launched by the optimizer's hooks during the last
     micro-batch's backward of each chunk (overlaps the rest of the schedule), waited here;
  2. tensor-parallel all-reduce of sequence-parallel partial gradients (shards line up across tp);
  3. tied embedding: sum of the first and last stage's copies (each in a bucket of its own, so the
     two copies are sharded alike across dp);
  4. optimizer step: global-norm clipping, update, parameter all-gather (prefetched for next step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megascope import tracer
from megascope.tracer import comm
from megascope.trainer.parallel.parallelize import TrainState
from megascope.trainer.parallel.tensor_parallel import sync_tp_grads


@dataclass
class StepResult:
    loss: float
    """Mean loss over the step's micro-batches and data-parallel replicas (= the single-process loss);
    NaN on ranks that do not hold it (all but the last stage, and rank 0 which receives it)."""
    grad_norm: float
    """Global gradient norm before clipping (the same on every rank)."""
    tokens: int
    """Tokens this rank's data-parallel replica processed: micro-batches * micro_batch * seq_len."""


def train_step(state: TrainState, batch: torch.Tensor, lr: float) -> StepResult:
    """batch: this data-parallel rank's token ids [n_micro, micro_batch, seq_len + 1] (inputs and
    targets shifted by one). Every rank of the job calls it once per step."""
    if batch.dim() != 3 or batch.shape[0] != state.n_micro:
        raise ValueError(f"batch of shape {tuple(batch.shape)}; expected [{state.n_micro}, micro_batch, "
                         "seq_len + 1] (micro-batches of this data-parallel rank)")
    batch = batch.to(state.device, non_blocking=True)
    tokens, targets = batch[..., :-1], batch[..., 1:]
    opt = state.optimizer
    opt.zero_grad()
    loss_sum = state.executor.run(state.schedule, tokens, targets)
    if state.pipe is not None:
        state.pipe.finish()
    opt.finish_grad_sync()
    sync_tp_grads(nn.ModuleList(state.chunks), state.dims)
    state.tied.all_reduce_grads()
    with tracer.span("optimizer", kind="compute"):  # includes the clipping norm and param all-gathers
        grad_norm = opt.step(lr)
    return StepResult(loss=_reported_loss(state, loss_sum), grad_norm=grad_norm,
                      tokens=state.n_micro * batch.shape[1] * (batch.shape[2] - 1))


def _reported_loss(state: TrainState, loss_sum: torch.Tensor | None) -> float:
    """Average the last stage's loss over dp and hand it to rank 0 (first stage) for printing."""
    dims = state.dims
    coords = dims.coords(state.rank)
    value = torch.full((1,), math.nan, dtype=torch.float32, device=state.device)
    if state.is_last_stage:
        assert loss_sum is not None  # the schedule returns the loss on the last stage
        value.copy_(loss_sum.float().reshape(1))
        comm.all_reduce(value, dims.groups["dp"], "dp", name="loss_all_reduce")
        value.div_(dims.dp)
    if dims.pp > 1 and coords.dp == 0 and coords.tp == 0:
        # Only the pipeline group that contains rank 0 takes part; its other members discard the value.
        comm.broadcast(value, dims.rank_of(dims.pp - 1, 0, 0), dims.groups["pp"], "pp", name="loss_broadcast")
    if not (state.is_last_stage or state.rank == 0):
        return math.nan
    return float(value.item())  # note: this is a CPU-GPU sync point (the loss is printed/recorded)
