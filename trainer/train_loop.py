"""The training loop of one rank: data, one 3D-parallel step, the steps table, progress on rank 0."""

from __future__ import annotations


import torch
import torch.distributed as dist

from megascope import tracer as tracing
from megascope.trainer.config import JobConfig
from megascope.trainer.faults import Faults
from megascope.trainer.flops import model_flops_per_step
from megascope.trainer.lr_schedule import learning_rate
from megascope.trainer.parallel_dims import ParallelDims
from megascope.trainer.parallelize import parallelize
from megascope.trainer.progress import Progress
from megascope.trainer.step import train_step


def train(cfg: JobConfig, dims: ParallelDims, device: torch.device, faults: Faults) -> None:
    rank = dist.get_rank()
    state = parallelize(cfg, dims, device, faults)
    loader = build_data_loader(cfg, dims, rank, device)
    flops = model_flops_per_step(cfg.model, cfg.train.global_batch)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    active = tracing.active()
    if active is not None:
        active.sync_clocks(dims.groups["world"])
    progress = Progress(cfg, dims) if rank == 0 else None
    try:
        for step in range(cfg.train.steps):
            faults.at_step_start(step)
            tracing.set_step(step)
            start_ns = tracing.now_ns()  # the aligned clock, comparable across ranks
            with tracing.span("data_wait", kind="host"):
                batch, _ = loader.next()
            lr = learning_rate(cfg.train, step)
            result = train_step(state, batch, lr)
            end_ns = tracing.now_ns()
            tracing.record_step(step=step, start_ns=start_ns, end_ns=end_ns,
                                tokens=tokens // dims.dp, loss=result.loss, lr=lr,
                                grad_norm=result.grad_norm, model_flops=flops)
            if progress is not None:
                progress.step(step, result.loss, lr, result.grad_norm, (end_ns - start_ns) / 1e9)
            every = cfg.trace.clock_sync_every
            if active is not None and every > 0 and (step + 1) % every == 0:
                active.sync_clocks(dims.groups["world"])  # every rank reaches this at the same step
    finally:
        loader.close()
    if progress is not None:
        progress.summary()


def build_data_loader(cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device):
    from megascope.trainer.data import build_loader

    return build_loader(cfg, dims, rank, device)
