"""Per-rank entry point started by the elastic agent: process group, groups, tracer, then the loop."""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascope.tracer.run_dir import update_manifest
from megascope.trainer.config import JobConfig, backend_for, check_backend
from megascope.trainer.modeling.peak_flops import detect_peak
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.robust.faults import Faults, parse_specs
from megascope.trainer.robust.heartbeat import Heartbeat

ONE_SHOT = ("crash", "hang")
"""Fault kinds that fire only in the first attempt (TORCHELASTIC_RESTART_COUNT == 0)."""


def pick_device(choice: str, local_rank: int, share_gpus: bool = False) -> torch.device:
    """The rank's device: GPU `local_rank`, or with `share_gpus` (gloo, which lets ranks share a GPU)
    GPU `local_rank % GPUs`."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
        index = local_rank % torch.cuda.device_count() if share_gpus else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def worker_main(cfg_dict: dict[str, Any], threads: int) -> None:
    cfg = JobConfig.from_dict(cfg_dict)
    torch.set_num_threads(threads)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # first thing: the driver's supervisor learns this rank's pid and host before anything can hang
    heartbeat = Heartbeat(cfg.run_dir, rank, cfg.robust.heartbeat_interval_s, restart, local_rank)
    status = "failed"
    try:
        device = pick_device(cfg.train.device, local_rank, share_gpus=cfg.train.backend == "gloo")
        check_backend(cfg, device.type)  # `auto` resolved only now
        init_process_group(device, backend_for(cfg, device.type), rank, restart)
        restart = agreed_restart(restart, device)
        heartbeat.update(restart=restart)
        dims = ParallelDims(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp)
        t0 = time.perf_counter()
        dims.build_groups()
        group_init_s = time.perf_counter() - t0
        _run(cfg, dims, device, rank, local_rank, threads, restart, group_init_s, heartbeat)
        status = "done"
    finally:
        heartbeat.close(status)
        if dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(device: torch.device, backend: str, rank: int, restart: int) -> None:
    """The default group on the elastic agent's store, under a prefix of its own per attempt: the
    agent's TCPStore outlives a restart, and without the prefix the restarted ranks would read the
    dead attempt's addresses (gloo: 'connectFullMesh ... Connection refused')."""
    device_id = device if backend == "nccl" else None  # binds NCCL's communicator to the rank's GPU
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, device_id=device_id)
        return
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=10))
    dist.init_process_group(backend, store=dist.PrefixStore(f"megascope/attempt_{restart}", store),
                            rank=rank, world_size=world, device_id=device_id)


def agreed_restart(restart: int, device: torch.device) -> int:
    """The attempt number every rank uses: the largest of the ranks' agents' restart counts. A node
    started again after its node was lost runs a new agent (its count starts at 0) beside agents that
    have restarted; the attempt names the run's restart incidents, the heartbeats' attempt and the
    one-shot faults, so the ranks must agree on it. Collective (one all_reduce of one number)."""
    value = torch.tensor([restart], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _run(cfg: JobConfig, dims: ParallelDims, device: torch.device, rank: int, local_rank: int, threads: int,
         restart: int, group_init_s: float, heartbeat: Heartbeat) -> None:
    # One-shot faults (crash, hang) fire in the first attempt only: the restarted group resumes
    # before their step and must not die there again (docs/robust-training.md).
    specs = [s for s in parse_specs(cfg.inject, dims.world_size) if restart == 0 or s.kind not in ONE_SHOT]
    faults = Faults(specs, rank, device)
    tracer = _start_tracer(cfg, rank, device)
    try:
        hosts = _gather_hosts(dims)
        if rank == 0:
            if restart == 0 or not (Path(cfg.run_dir) / "run.json").is_file():
                _write_manifest(cfg, dims, device, hosts, threads, group_init_s)
            else:
                update_manifest(cfg.run_dir, restarts=restart, group_init_s_last=group_init_s)
        if cfg.robust.self_check == "always" or (cfg.robust.self_check == "restart" and restart > 0):
            heartbeat.update(status="self_check", beat_now=True)
            _self_check(cfg, dims, device, rank, hosts, restart)
        from megascope.kernels.attention import sdpa_preference
        from megascope.trainer.train_loop import train

        with sdpa_preference(cfg.train.attention_backend):  # before the blocks are first traced
            train(cfg, dims, device, faults, heartbeat=heartbeat, restart=restart)
    finally:
        if tracer is not None:
            from megascope import tracer as tracing

            tracing.deactivate()
            tracer.close()


def _self_check(cfg: JobConfig, dims: ParallelDims, device: torch.device, rank: int,
                hosts: list[tuple[str, int]], attempt: int) -> None:
    from megascope.trainer.config import ConfigError, validate
    from megascope.trainer.robust.self_check import SelfCheckError, decide, run_self_check

    names = [h for h, _ in hosts]
    nodes = sorted(set(names))
    per_node = dims.world_size // len(nodes)

    def valid_dp(dp: int) -> bool:
        trial = JobConfig.from_dict(cfg.to_dict())
        trial.parallel.dp = dp
        try:
            validate(trial)
            return True
        except ConfigError:
            return False

    record = run_self_check(cfg.run_dir, rank, dims.world_size, device, names, attempt,
                            cfg.robust.self_check_threshold,
                            lambda bad: decide(bad, nodes, per_node, dims.tp, dims.pp, valid_dp))
    decision = record["decision"]
    if rank == 0:
        print(f"[megascope] self-check (attempt {attempt}): flagged ranks {record['flagged_ranks']}, "
              f"decision {decision['action']}: {decision['reason']}"
              + ("" if record["enforced"] else " (recorded only: CPU ranks share cores)"), flush=True)
    if record["enforced"] and decision["action"] != "continue":
        raise SelfCheckError(f"self-check: {decision['reason']} (see {cfg.run_dir}/self_check/)")


def _start_tracer(cfg: JobConfig, rank: int, device: torch.device):
    if not cfg.trace.enabled:
        return None
    from megascope import tracer as tracing

    t = tracing.Tracer(cfg.run_dir, rank, cfg.trace, device)
    tracing.activate(t)
    return t


def _gather_hosts(dims: ParallelDims) -> list[tuple[str, int]]:
    """Every rank's (host name, local rank), in rank order. Collective."""
    info: list[Any] = [None] * dims.world_size
    dist.all_gather_object(info, (socket.gethostname(), int(os.environ.get("LOCAL_RANK", 0))))
    return [tuple(x) for x in info]


def _write_manifest(cfg: JobConfig, dims: ParallelDims, device: torch.device, info: list[tuple[str, int]],
                    threads: int, group_init_s: float) -> None:
    """Rank 0 writes run.json (every rank's host name and local rank gathered before)."""
    from megascope.tracer.run_dir import write_manifest
    from megascope.trainer.config import micro_batches

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
