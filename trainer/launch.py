"""Driver side of `megascope train`: start dp*tp*pp ranks through torch.distributed's elastic launcher.

The elastic agent (the machinery behind torchrun) does rendezvous, process start, monitoring and
teardown; Ctrl-C reaches it as SIGINT and it stops every rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from megascope.trainer.config import JobConfig


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: JobConfig, args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from megascope.trainer.worker import worker_main

    nnodes = args.nnodes
    if cfg.world_size % nnodes:
        print(f"megascope train: world size {cfg.world_size} (dp*tp*pp) is not divisible by "
              f"--nnodes {nnodes}", file=sys.stderr)
        return 2
    nproc = args.nproc_per_node or cfg.world_size // nnodes
    if nproc * nnodes != cfg.world_size:
        print(f"megascope train: --nproc-per-node {nproc} x --nnodes {nnodes} != dp*tp*pp = "
              f"{cfg.world_size}; change the layout or the launch flags", file=sys.stderr)
        return 2
    if nnodes > 1 and not args.rdzv_endpoint:
        print("megascope train: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)",
              file=sys.stderr)
        return 2
    cfg.run_dir = cfg.run_dir or default_run_dir()
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
    launch_cfg = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=args.rdzv_id or f"megascope-{Path(cfg.run_dir).name}-{uuid.uuid4().hex[:6]}",
        rdzv_backend=args.rdzv_backend, rdzv_endpoint=endpoint,
        rdzv_configs={"rank": args.node_rank} if args.rdzv_backend == "static" else {},
        max_restarts=args.max_restarts, monitor_interval=0.2, start_method="spawn",
    )
    # Each rank gets an even share of this node's cores (2 cores, 8 ranks -> 1 thread each).
    threads = max(1, (os.cpu_count() or 1) // nproc)
    print(f"[megascope] launching {cfg.world_size} ranks (dp={cfg.parallel.dp} tp={cfg.parallel.tp} "
          f"pp={cfg.parallel.pp} vpp={cfg.parallel.vpp}) -> {cfg.run_dir}", flush=True)
    try:
        elastic_launch(launch_cfg, worker_main)(cfg.to_dict(), threads)
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()))
        print(f"megascope train: rank {first.global_rank} failed (exit code {first.exitcode}); "
              f"trace so far is in {cfg.run_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nmegascope train: interrupted; all ranks stopped; trace so far is in {cfg.run_dir}",
              file=sys.stderr)
        return 130
    return 0
