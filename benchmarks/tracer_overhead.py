"""Tracer overhead: the same training job with tracing off and on, interleaved (ABAB...), side by side.

    python benchmarks/tracer_overhead.py [--world 2] [--tp 2] [--rounds 8] [--steps 8] [--layers 4]

Prints step time off/on, the ratio, overhead %, spans per step and cost per span, plus a
microbenchmark of ns per span (no tracer, active on CPU, active with CUDA events when a GPU exists).
The job is a function `job(rank, world, args, trace_dir) -> Block results`; today it is a GPT-like MLP
stack on gloo that issues the ops a 3D-parallel step issues (forward/backward spans per micro-batch,
per-layer tp all-reduces, bucketed async dp reduce-scatters, an all-gather, data wait, optimizer).
Swap JOB for the real trainer's step once megascope.trainer exposes one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascope import tracer  # noqa: E402
from megascope.tracer import comm  # noqa: E402
from megascope.trainer.config import TraceConfig  # noqa: E402


class MlpStack(torch.nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(hidden, 4 * hidden) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, tp_group: object) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            y = down(F.gelu(up(x)))
            with torch.no_grad():  # the row-parallel all-reduce of a tensor-parallel layer
                comm.all_reduce(y, tp_group, "tp")
            x = x + y
        return x


def _groups(rank: int, world: int, tp: int) -> tuple[object, object]:
    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


def _train_step(model: MlpStack, opt: torch.optim.Optimizer, args: argparse.Namespace,
                tp_group: object, dp_group: object, dp: int) -> None:
    with tracer.span("data_wait", kind="host"):
        batches = [torch.randn(args.batch, args.hidden) for _ in range(args.microbatches)]
    for mb, x in enumerate(batches):
        tracer.set_microbatch(mb)
        with tracer.span("forward"):
            loss = model(x, tp_group).pow(2).mean()
        with tracer.span("backward"):
            loss.backward()
    grads = [p.grad.reshape(-1) for p in model.parameters()]
    flat = torch.cat(grads)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % (dp * args.buckets)))
    shard = torch.empty(flat.numel() // dp)
    works, bucket = [], flat.numel() // args.buckets
    for b in range(args.buckets):  # ZeRO-2 style: bucketed async reduce-scatter
        part = flat[b * bucket:(b + 1) * bucket]
        works.append(comm.reduce_scatter_tensor(shard[b * bucket // dp:(b + 1) * bucket // dp], part,
                                                dp_group, "dp", async_op=True))
    for w in works:
        if w is not None:
            w.wait()
    with tracer.span("optimizer", kind="host"):
        opt.step()
        opt.zero_grad(set_to_none=False)
    comm.all_gather_into_tensor(flat, shard, dp_group, "dp")
    comm.all_reduce(torch.zeros(1), dp_group, "dp", name="grad_norm")


def job(rank: int, world: int, args: argparse.Namespace, trace_dir: str) -> dict:
    """Interleaved blocks of `steps` steps, tracing off then on, `rounds` times; rank 0's step times."""
    torch.manual_seed(rank % args.tp)
    tp_group, dp_group = _groups(rank, world, args.tp)
    model = MlpStack(args.layers, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    cfg = TraceConfig(nvml=False)
    times: dict[str, list[float]] = {"off": [], "on": []}
    spans = 0
    step = 0
    for _ in range(args.warmup):
        _train_step(model, opt, args, tp_group, dp_group, world // args.tp)
    for rnd in range(args.rounds):
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            t = tracer.Tracer(trace_dir, rank, cfg, "cpu") if mode == "on" else None
            if t is not None:
                tracer.activate(t)
            for _ in range(args.steps):
                dist.barrier()
                tracer.set_step(step)
                start = time.perf_counter()
                _train_step(model, opt, args, tp_group, dp_group, world // args.tp)
                times[mode].append(time.perf_counter() - start)
                tracer.record_step(tokens=args.batch * args.microbatches)
                step += 1
            if t is not None:
                tracer.deactivate()
                t.close()
                spans += sum(b.num_rows for b in _read_events(trace_dir, rank))
    return {"times": times, "spans": spans}


def _read_events(trace_dir: str, rank: int) -> list:
    import pyarrow.parquet as pq

    folder = Path(trace_dir) / "events" / f"rank={rank:05d}"
    tables = [pq.read_table(p) for p in sorted(folder.glob("seg-*.parquet"))]
    for p in folder.glob("seg-*.parquet"):
        p.unlink()  # count each block's spans once
    return tables


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, trace_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = job(rank, world, args, trace_dir)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run_job(args: argparse.Namespace) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as trace_dir:
        procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, trace_dir, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=1800)
        for p in procs:
            p.join()
    return result


def microbench(device: str, n: int = 100_000) -> float:
    """ns per `with span(...)`, no sink I/O in the loop (the flusher runs as in production)."""
    t = tracer.Tracer(None, 0, TraceConfig(nvml=False, max_buffered_events=10 * n),
                      device, sink=tracer.MemorySink()) if device != "none" else None
    if t is not None:
        tracer.activate(t)
        tracer.set_step(0)
    if device.startswith("cuda"):  # warm the event pool: steady state, as in a training loop
        for _ in range(1000):
            with tracer.span("warmup"):
                pass
        torch.cuda.synchronize()
        time.sleep(0.2)
        n = min(n, 1000)  # spans in flight per step are far fewer than 100k; keep the pool warm
    start = time.perf_counter_ns()
    for _ in range(n):
        with tracer.span("forward"):
            pass
    elapsed = time.perf_counter_ns() - start
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if t is not None:
        tracer.deactivate()
        t.close()
    return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-only", action="store_true", help="only the ns-per-span microbenchmark")
    args = p.parse_args()
    if args.world % args.tp:
        p.error(f"--world {args.world} must be a multiple of --tp {args.tp}")
    devices = ["none", "cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    print("| span microbenchmark | ns per span |\n|---|---:|")
    for device in devices:
        label = {"none": "no active tracer", "cpu": "active, CPU clock"}.get(device, "active, CUDA events")
        print(f"| {label} | {microbench(device):.0f} |")
    if args.micro_only:
        return
    result = run_job(args)
    off, on = result["times"]["off"], result["times"]["on"]
    spans_per_step = result["spans"] / len(on)
    med_off, med_on = statistics.median(off), statistics.median(on)
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    print(f"\njob: gloo world {args.world} (tp {args.tp} x dp {args.world // args.tp}), {args.layers} layers, "
          f"hidden {args.hidden}, {args.microbatches} micro-batches; {args.rounds} rounds x {args.steps} "
          f"steps per mode, interleaved; rank 0 step times")
    print("| statistic | off (ms) | on (ms) | on/off | overhead % | spans/step | cost per span (us) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, a, b in (("median", med_off, med_on), ("mean", mean_off, mean_on)):
        per_span = (b - a) / spans_per_step * 1e6 if spans_per_step else float("nan")
        print(f"| {label} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.4f} | {(b / a - 1) * 100:+.2f} | "
              f"{spans_per_step:.0f} | {per_span:.2f} |")


if __name__ == "__main__":
    main()
