"""Per-rank entry point started by the elastic agent: process group, groups, tracer, then the loop."""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from megascope.trainer.config import JobConfig
from megascope.trainer.faults import Faults, parse_specs
from megascope.trainer.parallel_dims import ParallelDims
from megascope.trainer.peak_flops import detect_peak


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def worker_main(cfg_dict: dict[str, Any], threads: int) -> None:
    cfg = JobConfig.from_dict(cfg_dict)
    torch.set_num_threads(threads)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg.train.device, local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    dims = ParallelDims(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp)
    t0 = time.perf_counter()
    dims.build_groups()
    group_init_s = time.perf_counter() - t0
    faults = Faults(parse_specs(cfg.inject, dims.world_size), rank)
    tracer = _start_tracer(cfg, rank, device)
    try:
        _write_manifest(cfg, dims, device, rank, local_rank, threads, group_init_s)
        from megascope.trainer.train_loop import train

        train(cfg, dims, device, faults)
    finally:
        if tracer is not None:
            from megascope import tracer as tracing

            tracing.deactivate()
            tracer.close()
        dist.destroy_process_group()


def _start_tracer(cfg: JobConfig, rank: int, device: torch.device):
    if not cfg.trace.enabled:
        return None
    from megascope import tracer as tracing

    t = tracing.Tracer(cfg.run_dir, rank, cfg.trace, device)
    tracing.activate(t)
    return t


def _write_manifest(cfg: JobConfig, dims: ParallelDims, device: torch.device, rank: int,
                    local_rank: int, threads: int, group_init_s: float) -> None:
    """Rank 0 writes run.json; every rank contributes its host name and local rank."""
    from megascope.trainer.config import micro_batches
    from megascope.tracer.run_dir import write_manifest

    info = [None] * dims.world_size
    dist.all_gather_object(info, (socket.gethostname(), local_rank))
    if rank != 0:
        return
    m = cfg.model
    peak = detect_peak(device, threads)
    write_manifest(cfg.run_dir, {
        "run_id": uuid.uuid4().hex,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": "megascope-trainer",
        "config": cfg.to_dict(),
        "topology": dims.topology([h for h, _ in info], [lr for _, lr in info]),
        "model": {"n_layers": m.n_layers, "hidden": m.hidden, "n_heads": m.n_heads,
                  "seq_len": m.seq_len, "vocab_size": m.vocab_size, "window": m.window,
                  "ffn_mult": m.ffn_mult, "parallel_block": m.parallel_block},
        "micro_batches": micro_batches(cfg),
        "schedule": "none" if dims.pp == 1 else ("interleaved" if dims.vpp > 1 else "1f1b"),
        "peak_flops": peak.to_dict(),
        "clock_offsets_ns": {},
        "group_init_s": group_init_s,
        "injected": list(cfg.inject),
        "versions": {"megascope": _version(), "torch": torch.__version__,
                     "python": platform.python_version(),
                     "cuda": torch.version.cuda, "backend": dist.get_backend()},
    })


def _version() -> str:
    from megascope import __version__

    return __version__
