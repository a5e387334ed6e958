"""What a checkpoint costs training, to choose the default cadence (robust.checkpoint_interval_s).

A save is a snapshot into reused host buffers (training thread) and a write + fsync (writer thread).
On CPU ranks that share saturated cores, every CPU-second of it can come out of training, so the
bound used is: cost per save <= ranks per node x CPU seconds per rank's save / cores. CPU seconds are
measured with the thread's CPU clock, which, unlike wall time, does not swing with the machine's load
(on the shared 2-core box wall-time A/B runs of a save every step vs none varied by +-50% of a step).

    python benchmarks/checkpoint_cadence_cost.py [--dp 2 --pp 2] [--ranks-per-node 4] [--cores 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megascope.trainer.config import JobConfig, apply_overrides
from megascope.trainer.modeling.model import GPT
from megascope.trainer.presets import preset
from megascope.trainer.robust.checkpoint_io import host_snapshot, save_file


def shard_elements(name: str, dp: int, pp: int) -> int:
    """fp32 master weights of one rank's ZeRO shard: the model's parameters over pp stages and dp."""
    cfg = JobConfig()
    apply_overrides(cfg, preset(name), "preset")
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg.model).parameters())
    return params // (pp * dp)


def cpu_per_save(elements: int, saves: int = 8) -> list[float]:
    """Thread CPU seconds of snapshot + write + fsync of master weights and two moments."""
    tree = {"optimizer": {k: torch.randn(elements) for k in ("master", "exp_avg", "exp_avg_sq")},
            "rng": {"cpu": torch.get_rng_state()}}
    buffers: dict[str, torch.Tensor] = {}
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(saves):
            t0 = time.thread_time()
            snapshot, _ = host_snapshot(tree, buffers)
            save_file(snapshot, Path(d) / f"shard-{i}.pt")
            out.append(time.thread_time() - t0)
    return out[2:]  # the first saves allocate the buffers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--interval-s", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"| preset | state per rank (MiB) | CPU per save, one rank (ms) | bound per save, {args.ranks_per_node} "
          f"ranks on {args.cores} cores (ms) | share of training at {args.interval_s:g} s |")
    print("|---|---|---|---|---|")
    for name in ("tiny", "small"):
        elements = shard_elements(name, args.dp, args.pp)
        cpu = statistics.median(cpu_per_save(elements))
        bound = cpu * args.ranks_per_node / args.cores
        print(f"| {name} | {3 * elements * 4 / 2**20:.1f} | {1e3 * cpu:.1f} | {1e3 * bound:.1f} | "
              f"{100 * bound / args.interval_s:.3f}% |")
    print(f"\nload average {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
