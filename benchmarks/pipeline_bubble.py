"""Step time and measured pipeline bubble per schedule, next to the analytical (p-1)/(v*m).

    python benchmarks/pipeline_bubble.py [--steps 6] [--layers 8] [--hidden 256] [--seq-len 128]

Each layout runs as real gloo processes (dp = tp = 1, one thread per rank). On every rank the time
inside forward/backward is summed through the same hook fault injection uses (it wraps exactly the
compute of each micro-batch/chunk); the rest of the schedule's wall time is the bubble:

    measured bubble = (schedule time - compute time) / compute time      (mean over stages)

which is the quantity (p-1)/(v*m) predicts (idle time over ideal time). It also contains the
transfers' host cost and, for interleaving, the cost of more, smaller chunks, so it sits above the
formula. Layouts with more ranks than CPU cores are marked: there, waiting ranks lend their core to
the others and the measurement stops meaning "idle".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megascope.trainer.config import JobConfig
from megascope.trainer.pipelining.schedule_order import analytical_bubble, schedule_name

LAYOUTS = [(1, 1, 8), (2, 1, 4), (2, 1, 8), (2, 2, 4), (2, 2, 8), (2, 4, 8), (4, 1, 8), (4, 2, 8)]
"""(pp, vpp, micro-batches)"""


class ComputeTimer:
    """Duck-typed `Faults` with no faults: sums the wall time of every forward/backward."""

    def __init__(self) -> None:
        self.compute_s = 0.0

    @contextlib.contextmanager
    def compute(self, sync=None) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if sync is not None:
            sync()  # note: a CPU-GPU sync point, so the time is the device's
        self.compute_s += time.perf_counter() - start

    def before_p2p(self, peers: list[int]) -> None:
        pass

    def before_dp_collective(self) -> None:
        pass

    def at_step_start(self, step: int) -> None:
        pass


def make_cfg(args: argparse.Namespace, pp: int, vpp: int, n_micro: int) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"n_layers": args.layers, "hidden": args.hidden, "n_heads": 4, "seq_len": args.seq_len},
        "parallel": {"pp": pp, "vpp": vpp},
        "train": {"global_batch": n_micro * args.micro_batch, "micro_batch": args.micro_batch,
                  "steps": args.steps, "lr": 1e-3, "warmup_steps": 1},
        "trace": {"enabled": False},
    })


def worker(rank: int, world: int, port: int, args: argparse.Namespace, layout: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, measure(rank, args, layout)))
    finally:
        dist.destroy_process_group()


def measure(rank: int, args: argparse.Namespace, layout: tuple) -> dict:
    from megascope.trainer.parallel.parallel_dims import ParallelDims
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.step import train_step

    pp, vpp, n_micro = layout
    cfg = make_cfg(args, pp, vpp, n_micro)
    dims = ParallelDims(1, 1, pp, vpp)
    dims.build_groups()
    timer = ComputeTimer()
    state = parallelize(cfg, dims, torch.device("cpu"), timer)
    run = state.executor.run
    schedule_s = [0.0]

    def timed_run(*a, **kw):
        start = time.perf_counter()
        try:
            return run(*a, **kw)
        finally:
            schedule_s[0] += time.perf_counter() - start

    state.executor.run = timed_run
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (n_micro, args.micro_batch, args.seq_len + 1), generator=g)
    steps = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timer.compute_s, schedule_s[0] = 0.0, 0.0
        dist.barrier()  # every stage starts the step together, as after an optimizer step
        start = time.perf_counter()
        train_step(state, batch, 1e-3)
        steps.append(time.perf_counter() - start)
    return {"step_s": statistics.median(steps[args.warmup:]), "compute_s": timer.compute_s,
            "schedule_s": schedule_s[0]}


def run_layout(args: argparse.Namespace, layout: tuple) -> list[dict]:
    pp = layout[0]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, pp, port, args, layout, queue)) for r in range(pp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(pp))
    for p in procs:
        p.join()
    return [results[r] for r in range(pp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layouts", default="", help="e.g. 2x1x8,2x2x8 (pp x vpp x micro-batches)")
    args = parser.parse_args()
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")] if args.layouts else LAYOUTS
    cores = os.cpu_count() or 1
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, fp32, CPU gloo, {cores} cores, 1 thread per rank")
    print("| schedule | pp | vpp | m | step time (s) | measured bubble | analytical (p-1)/(v*m) |")
    print("|---|---|---|---|---|---|---|")
    for pp, vpp, m in layouts:
        ranks = run_layout(args, (pp, vpp, m))
        step_s = max(r["step_s"] for r in ranks)
        bubble = statistics.mean((r["schedule_s"] - r["compute_s"]) / r["compute_s"] for r in ranks)
        note = " (oversubscribed)" if pp > cores else ""
        print(f"| {schedule_name(pp, vpp)}{note} | {pp} | {vpp} | {m} | {step_s:.3f} | {bubble:.3f} | "
              f"{analytical_bubble(pp, vpp, m):.3f} |", flush=True)


if __name__ == "__main__":
    main()
