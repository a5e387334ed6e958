"""Clock sync cost: one host vs the same ranks spread over simulated hosts (two-level sync).

    python benchmarks/clock_sync.py [--world 8] [--repeat 5] [--rounds 8]

Each layout runs `Tracer.sync_clocks` on a gloo group of `world` ranks, each rank's HostClock told
which simulated host it is on (ranks per host = world / hosts), and prints the median wall time of
one sync at rank 0 and the sequential exchanges the reference leads, side by side. On one machine the
"hosts" share the CPU, so the parallel host-level hops compete for the same 2 cores; on real hosts
they run on separate machines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from megascope.samples.distributed import run_distributed
from megascope.tracer.clock import HostClock
from megascope.tracer.clock_sync import estimate_offsets


def job(rank: int, world: int, per_host: int, repeat: int, rounds: int) -> dict:
    clock = HostClock(host=f"host-{rank // per_host}")
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        result = estimate_offsets(clock, rounds=rounds)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "hosts": result.hosts,
            "max_delay_us": max(result.delays_ns.values()) / 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    print(f"| hosts x ranks per host | sequential exchanges at the reference | sync time (ms, median of "
          f"{args.repeat}) | largest delay (us) |\n|---|---:|---:|---:|")
    for per_host in sorted({args.world, args.world // 2, 2, 1}, reverse=True):
        if per_host < 1 or args.world % per_host:
            continue
        hosts = args.world // per_host
        res = run_distributed(job, args.world, per_host, args.repeat, args.rounds, timeout=600)[0]
        exchanges = (per_host - 1 + hosts - 1) * args.rounds
        print(f"| {hosts} x {per_host} | {exchanges} | {res['seconds'] * 1e3:.1f} | {res['max_delay_us']:.0f} |")


if __name__ == "__main__":
    main()
