"""The training loop of one rank: resume, data, one 3D-parallel step, the steps table, progress on rank 0,
checkpoints on robust's cadence (trainer/robust/checkpoint_cadence.py; the loop stalls only for the
host copy)."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from megascope import tracer as tracing
from megascope.trainer.config import JobConfig
from megascope.trainer.lr_schedule import learning_rate
from megascope.trainer.modeling.flops import model_flops_per_step
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.parallel.parallelize import parallelize
from megascope.trainer.robust.checkpoint_cadence import CheckpointCadence, agree_max
from megascope.trainer.robust.checkpoint_format import make_checkpoint_manager
from megascope.trainer.robust.faults import Faults
from megascope.trainer.robust.heartbeat import Heartbeat
from megascope.trainer.robust.supervisor import append_incident
from megascope.trainer.step import train_step
from megascope.trainer.step_log import StepLog


def train(cfg: JobConfig, dims: ParallelDims, device: torch.device, faults: Faults,
          heartbeat: Heartbeat | None = None, restart: int = 0) -> None:
    rank = dist.get_rank()
    state = parallelize(cfg, dims, device, faults)
    ckpt = make_checkpoint_manager(cfg, dims, rank, device)  # robust.checkpoint_format: dcp or snapshot
    _beat(heartbeat, status="restoring")
    start_step = ckpt.resume(state)
    if rank == 0 and start_step > 0:
        print(f"[megascope] resumed from checkpoint step {start_step} (attempt {restart})", flush=True)
    loader = build_data_loader(cfg, dims, rank, device, start_step)
    flops = model_flops_per_step(cfg.model, cfg.train.global_batch)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    active = tracing.active()
    if active is not None:
        active.sync_clocks(dims.groups["world"])
    progress = StepLog(cfg, dims) if rank == 0 else None
    cadence = CheckpointCadence(cfg.robust, start_step, agree_max(dims.groups["world"], device))
    try:
        for step in range(start_step, cfg.train.steps):
            _beat(heartbeat, step=step, status="training")
            faults.at_step_start(step)
            tracing.set_step(step)
            start_ns = tracing.now_ns()  # the aligned clock, comparable across ranks
            with tracing.span("data_wait", kind="host"):
                faults.in_data_wait()
                batch, _ = loader.next()
            faults.before_step_work()
            lr = learning_rate(cfg.train, step)
            result = train_step(state, batch, lr)
            end_ns = tracing.now_ns()
            tracing.record_step(step=step, start_ns=start_ns, end_ns=end_ns,
                                tokens=tokens // dims.dp, loss=result.loss, lr=lr,
                                grad_norm=result.grad_norm, model_flops=flops)
            if progress is not None:
                progress.step(step, result.loss, lr, result.grad_norm, (end_ns - start_ns) / 1e9)
            if rank == 0 and restart > 0 and step == start_step:
                append_incident(cfg.run_dir, {"kind": "resumed", "attempt": restart, "step": step,
                                              "detail": f"attempt {restart} completed step {step} "
                                                        f"(resumed from checkpoint step {start_step})"})
            if cadence.due(step, (end_ns - start_ns) / 1e9):
                _beat(heartbeat, status="checkpointing")
                ckpt.save(step + 1, state)
            if rank == 0 and cadence.fixed_at == step:
                print(f"[megascope] {cadence.describe()}", flush=True)
            sync_every = cfg.trace.clock_sync_every
            if active is not None and sync_every > 0 and (step + 1) % sync_every == 0:
                active.sync_clocks(dims.groups["world"])  # every rank reaches this at the same step
    finally:
        loader.close()
        ckpt.close()
    if progress is not None:
        progress.summary()
        if ckpt.stalls_s:
            print(f"checkpoints: {len(ckpt.stalls_s)} saved | training stall per save (s): median "
                  f"{statistics.median(ckpt.stalls_s):.4f} max {max(ckpt.stalls_s):.4f}", flush=True)


def _beat(heartbeat: Heartbeat | None, step: int | None = None, status: str | None = None) -> None:
    if heartbeat is not None:
        heartbeat.update(step=step, status=status)


def build_data_loader(cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device, start_step: int = 0):
    from megascope.trainer.data import build_loader

    return build_loader(cfg, dims, rank, device, start_step=start_step)
