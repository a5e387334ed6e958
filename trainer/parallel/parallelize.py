"""Compose the parallelisms: plain model -> tensor/sequence parallel -> pipeline chunks -> ZeRO optimizer.

`parallelize(cfg, dims, device, faults)` is the one place that decides the order; each step is a
transform owned by its own module (torchtitan's layout). The result, `TrainState`, is everything a
training step needs; `trainer/step.py` runs one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from megascope.trainer.config import ConfigError, JobConfig, check_layout, micro_batches
from megascope.trainer.modeling.compile import compile_blocks, compile_loss
from megascope.trainer.modeling.model import GPT
from megascope.trainer.modeling.recompute import apply_recompute
from megascope.trainer.parallel.data_parallel import DistributedOptimizer
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.parallel.tensor_parallel import apply_tp
from megascope.trainer.pipelining.p2p import PipeComm
from megascope.trainer.pipelining.pipeline import (
    PipelineChunk,
    TiedEmbeddingSync,
    split_into_chunks,
    tied_embedding_weight,
)
from megascope.trainer.pipelining.schedule_order import Action, build_schedule, schedule_name
from megascope.trainer.pipelining.schedules import ScheduleExecutor
from megascope.trainer.robust.faults import Faults


@dataclass
class TrainState:
    """One rank's share of the job: its model chunks, optimizer, schedule and pipeline links."""

    cfg: JobConfig
    dims: ParallelDims
    device: torch.device
    rank: int
    chunks: list[PipelineChunk]
    """This stage's virtual chunks, in chunk order (one when vpp == 1)."""
    optimizer: DistributedOptimizer
    schedule: list[Action]
    """This stage's forward/backward order for one step."""
    executor: ScheduleExecutor
    pipe: PipeComm | None
    """Pipeline transfers (None when pp == 1)."""
    tied: TiedEmbeddingSync
    faults: Faults
    n_micro: int
    """Micro-batches per step on this data-parallel rank: global_batch / (micro_batch * dp)."""

    @property
    def stage(self) -> int:
        return self.dims.coords(self.rank).pp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.dims.pp - 1

    @property
    def schedule_name(self) -> str:
        return schedule_name(self.dims.pp, self.dims.vpp)


def parallelize(cfg: JobConfig, dims: ParallelDims, device: torch.device, faults: Faults) -> TrainState:
    """Build this rank's model chunks and optimizer. Collective: every rank of the job calls it."""
    check_dims(cfg, dims)
    rank = dist.get_rank()
    stage = dims.coords(rank).pp
    sequence_parallel = cfg.parallel.sequence_parallel and dims.tp > 1

    # 1. The full plain model, bit-identical on every rank (same seed, built on the CPU generator),
    #    so the sharded/split result equals the single-process model.
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    # 2. Tensor (+ sequence) parallelism: swaps linears/embedding/loss for sharded ones, in place.
    apply_tp(model, dims, sequence_parallel)
    # 3. Pipeline: keep this stage's vpp chunks (Megatron's interleaved assignment); the tied head
    #    gets its own copy on the last stage. The rest of the model is dropped with `model`.
    chunks = split_into_chunks(model, cfg.model.n_layers, dims.pp, dims.vpp, stage)
    del model
    apply_recompute(chunks, cfg.parallel.recompute)
    if cfg.train.compile:
        compile_blocks(chunks)
    if cfg.train.compile_loss:
        compile_loss(chunks)
    tied = TiedEmbeddingSync(dims, rank, tied_embedding_weight(chunks))
    # 4. Data parallelism: ZeRO-2 buffers and buckets per chunk, so each chunk's reduce-scatter starts
    #    as soon as its last micro-batch's backward is done (overlapping the interleaved schedule).
    optimizer = DistributedOptimizer(chunks, dims, cfg.parallel, cfg.train,
                                     before_dp_collective=faults.before_dp_collective)

    n_micro = micro_batches(cfg)
    pipe = _pipe_comm(cfg, dims, rank, device, sequence_parallel, faults)
    schedule = build_schedule(dims.pp, dims.vpp, stage, n_micro)
    executor = ScheduleExecutor(
        chunks, pipe, dims.pp, stage, n_micro,
        set_grad_sync=lambda chunk, last: optimizer.set_sync(last, chunk=chunk),
        faults=faults, autocast=_autocast(cfg, device))
    return TrainState(cfg, dims, device, rank, chunks, optimizer, schedule, executor, pipe, tied,
                      faults, n_micro)


def check_dims(cfg: JobConfig, dims: ParallelDims) -> None:
    """The dims and the process group match the config, and the config's layout splits (config.check_layout:
    a config built in code may not have been validated), with a message that says what to change."""
    p = cfg.parallel
    if (dims.dp, dims.tp, dims.pp, dims.vpp) != (p.dp, p.tp, p.pp, p.vpp):
        raise ConfigError(f"ParallelDims dp={dims.dp} tp={dims.tp} pp={dims.pp} vpp={dims.vpp} does not match "
                          f"the config's dp={p.dp} tp={p.tp} pp={p.pp} vpp={p.vpp}; build both from one config")
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"dp*tp*pp = {dims.world_size} but the process group has {dist.get_world_size()} ranks")
    check_layout(cfg)


def boundary_shape(cfg: JobConfig, tp: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """Shape of the hidden state passed between stages: [micro_batch, s_local, h]."""
    seq = cfg.model.seq_len // tp if sequence_parallel else cfg.model.seq_len
    return (cfg.train.micro_batch, seq, cfg.model.hidden)


def _pipe_comm(cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device,
               sequence_parallel: bool, faults: Faults) -> PipeComm | None:
    if dims.pp == 1:
        return None
    # Activations cross stages in fp32: the residual stream stays fp32 under bf16 autocast.
    return PipeComm(dims, rank, boundary_shape(cfg, dims.tp, sequence_parallel), torch.float32, device,
                    cfg.parallel.scatter_gather and not sequence_parallel, faults)


def _autocast(cfg: JobConfig, device: torch.device) -> Callable[[], ContextManager]:
    if cfg.train.dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def model_chunks_as_module(state: TrainState) -> nn.Module:
    """The chunks as one module (each parameter once), for whole-stage operations."""
    return nn.ModuleList(state.chunks)
