"""Process-group creation time (MegaScale 3.5): the tp/dp/pp groups of a dp x tp x pp layout created
the classic way (every rank calls new_group for every group: new_subgroups_by_enumeration) against
megascope's way (each rank creates only its own groups with use_local_synchronization=True).

    python benchmarks/group_init.py [--world 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist

from megascope.samples.distributed import run_distributed


def _group_time(rank: int, world: int, method: str, dims_tuple: tuple[int, int, int]) -> float:
    from megascope.trainer.parallel.parallel_dims import ParallelDims

    dims = ParallelDims(*dims_tuple)
    t0 = time.perf_counter()
    dims.build_groups(method)
    elapsed = time.perf_counter() - t0
    dist.barrier()
    return elapsed


def measure(method: str, world: int, layout: tuple[int, int, int]) -> float:
    """Seconds until the slowest rank has its groups."""
    return max(run_distributed(_group_time, world, method, layout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layouts = {8: [(2, 2, 2), (8, 1, 1), (2, 1, 4)], 4: [(2, 1, 2)]}.get(args.world, [(args.world, 1, 1)])
    print(f"## Group creation time, world {args.world}, gloo on {os.cpu_count()} CPU cores "
          f"(slowest rank, median of {args.repeats})\n")
    print("| layout dp x tp x pp | enumeration (s) | local synchronization (s) | speed-up |")
    print("|---|---|---|---|")
    for layout in layouts:
        res = {m: statistics.median(measure(m, args.world, layout) for _ in range(args.repeats))
               for m in ("enumeration", "local")}
        print(f"| {layout[0]} x {layout[1]} x {layout[2]} | {res['enumeration']:.3f} | {res['local']:.3f} | "
              f"{res['enumeration'] / res['local']:.2f}x |")


if __name__ == "__main__":
    main()
