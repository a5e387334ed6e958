"""Tracer overhead: the same training job with tracing off and on, interleaved (ABAB...), side by side.

    python benchmarks/tracer_overhead.py [--preset tiny] [--dp 2] [--tp 1] [--pp 2] [--rounds 400] [--steps 2]

Prints step time off/on, the ratio, overhead %, spans per step and cost per span, plus microbenchmarks
of the training thread's cost (ns) per span (no tracer, active on CPU, active with CUDA events when a
GPU exists) and per async comm op (issue + wait, with and without a blocking wait).
The job is the real trainer's step (parallelized GPT, every collective and p2p op traced through the
comm layer) on a gloo group, tracing toggled between interleaved blocks inside the same processes.
Each round runs an off block and an on block back to back (order alternating), so slow drifts of a
shared machine's load cancel. For step time, the training thread's CPU time and the process's CPU
time it prints on/off as the ratio of the means over all rounds with a 95% bootstrap interval over
rounds (per-step noise here is +-10%: the interval says what a run can resolve), and the median of
the per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascope import tracer
from megascope.samples.distributed import run_distributed
from megascope.tracer import comm_spans
from megascope.trainer.cli import parse_set
from megascope.trainer.config import JobConfig, TraceConfig, apply_overrides, micro_batches, validate
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.parallel.parallelize import parallelize
from megascope.trainer.presets import preset
from megascope.trainer.robust.faults import Faults
from megascope.trainer.step import train_step


def make_config(args: argparse.Namespace) -> JobConfig:
    cfg = JobConfig()
    apply_overrides(cfg, preset(args.preset), source="preset")
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = args.dp, args.tp, args.pp
    cfg.train.device = args.device
    cfg.trace.nvml = args.device == "cuda"  # the default tracing: CUDA events + NVML on a GPU
    apply_overrides(cfg, parse_set(args.set), source="--set")
    validate(cfg, world_size=args.dp * args.tp * args.pp)
    return cfg


def modes(args: argparse.Namespace) -> tuple[str, ...]:
    """off: no tracer active; on: the default tracing; cupti: the default tracing plus CUPTI kernel activity."""
    return ("off", "on", "cupti") if args.cupti else ("off", "on")


def job(rank: int, world: int, args: argparse.Namespace, trace_dir: str) -> dict:
    """The real trainer's step (megascope.trainer.step.train_step on a parallelized GPT), in blocks of
    `steps` steps with tracing off, then on (order alternating per round), in the same processes so
    model, data and placement are identical; returns rank 0's step times and the spans recorded.
    One Tracer lives through the whole run (its threads started, as in an always-on job) and is
    activated for the "on" blocks only; its idle threads also run during the "off" blocks. With --cupti
    a second Tracer, recording CUPTI kernel activity, is active for a third block per round ("cupti")."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # a timed-out run says where it was
    # the threads `megascope train` gives a rank (trainer/launch.py), not run_distributed's one. On an
    # H100 host (16 cores) this A/B took ~135 s to its first round, `megascope train` ~75 s to its
    # second step; the 2B model's CPU initialization on one thread is the likely difference (unmeasured)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = make_config(args)
    dims = ParallelDims(args.dp, args.tp, args.pp)
    dims.build_groups()
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state = parallelize(cfg, dims, device, Faults([], rank))
    g = torch.Generator().manual_seed(rank // args.tp)
    m, b, s = micro_batches(cfg), cfg.train.micro_batch, cfg.model.seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (m, b, s + 1), generator=g).to(device)
    names = modes(args)
    rounds: list[dict[str, list[float]]] = []
    by_role = {mode: dict.fromkeys(_cpu_by_role(), 0.0) for mode in names}
    step = 0
    for _ in range(args.warmup):
        train_step(state, batch, cfg.train.lr)
    tracers = {"on": tracer.Tracer(trace_dir, rank, cfg.trace, device)}
    if args.cupti:
        with_cupti = dataclasses.replace(cfg.trace, cupti=True)
        tracers["cupti"] = tracer.Tracer(str(Path(trace_dir) / "cupti"), rank, with_cupti, device)
        tracer.activate(tracers["cupti"])
        tracer.deactivate()  # CUPTI records only while this tracer is active
    for rnd in range(args.rounds):
        rounds.append({key + mode: [] for key in ("", "cpu_", "thread_") for mode in names})
        for mode in names[rnd % len(names):] + names[:rnd % len(names)]:  # rotate the order per round
            before = _cpu_by_role()
            if mode != "off":
                tracer.activate(tracers[mode])
            for _ in range(args.steps):
                dist.barrier()
                tracer.set_step(step)
                start, cpu_start, thread_start = time.perf_counter(), time.process_time(), time.thread_time()
                with tracer.span("data_wait", kind="host"):
                    pass  # batches are prepared up front; keep the span the real loop records
                result = train_step(state, batch, cfg.train.lr)  # ends in a device sync (the loss)
                tracer.record_step(tokens=result.tokens, loss=result.loss, grad_norm=result.grad_norm)
                rounds[-1][mode].append(time.perf_counter() - start)
                rounds[-1]["cpu_" + mode].append(time.process_time() - cpu_start)
                rounds[-1]["thread_" + mode].append(time.thread_time() - thread_start)
                step += 1
            tracer.deactivate()
            after = _cpu_by_role()
            for role in after:
                by_role[mode][role] += after[role] - before[role]
        if rank == 0 and args.progress:  # a run cut short still shows what it measured
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{mode} {statistics.fmean(rounds[-1][mode]) * 1e3:.1f} ms" for mode in names), flush=True)
    on = tracers["on"]
    wakeups = on.completion.sweeps if on.completion is not None else 0
    kernels = tracers["cupti"].cupti.kernels if "cupti" in tracers and tracers["cupti"].cupti else 0
    for t in tracers.values():
        t.close()
    spans = sum(tb.num_rows for tb in _read_events(trace_dir, rank))
    return {"rounds": rounds, "spans": spans, "wakeups": wakeups, "kernels": kernels,
            "by_role": by_role}


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this process: the training thread, the tracer's threads (megascope-*),
    and everything (gloo's threads and the rest = process - training - tracer)."""
    tracer_s = 0.0
    for th in threading.enumerate():
        if th.name.startswith("megascope-") and th.native_id is not None:
            try:  # on-CPU ns of the thread (first field of schedstat; /proc/.../stat counts 10 ms ticks)
                tracer_s += int(Path(f"/proc/self/task/{th.native_id}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                pass  # the thread ended, or no /proc (not Linux): counted under "other"
    return {"training": time.thread_time(), "tracer": tracer_s, "process": time.process_time()}


def _read_events(trace_dir: str, rank: int) -> list:
    import pyarrow.parquet as pq

    folder = Path(trace_dir) / "events" / f"rank={rank:05d}"
    tables = [pq.read_table(p) for p in sorted(folder.glob("seg-*.parquet"))]
    for p in folder.glob("seg-*.parquet"):
        p.unlink()  # count each block's spans once
    return tables


def run_job(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as trace_dir:
        return run_distributed(job, args.dp * args.tp * args.pp, args, trace_dir, timeout=3600)[0]


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


class _DoneWork:
    """A work that has already completed (the common case at wait() for gradient reductions)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class _PendingWork(_DoneWork):
    """A work whose is_completed() is false until wait(): wait() is recorded as a blocking wait."""

    def is_completed(self) -> bool:
        return False


def microbench_comm(blocking: bool, n: int = 20_000) -> float:
    """Training-thread ns per traced async op: begin, finish (wrap + hand to the completion tracker), wait.
    blocking: the wait is recorded as a <op>.wait span too. Excludes the backend call itself."""
    t = tracer.Tracer(None, 0, TraceConfig(nvml=False, max_buffered_events=10 * n),
                      "cpu", sink=tracer.MemorySink())
    tracer.activate(t)
    tracer.set_step(0)
    buf = torch.empty(16)
    work = _PendingWork() if blocking else _DoneWork()
    start = time.perf_counter_ns()
    for _ in range(n):
        op = comm_spans.begin("grad_reduce_scatter", "collective", "dp", None, "dp", 64, buf,
                              issue_ns=t.now_ns())
        comm_spans.finish([op], work, False).wait()
    elapsed = time.perf_counter_ns() - start
    tracer.deactivate()
    t.close()
    return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="trainer preset")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=400,
                   help="interleaved off/on pairs; 400-800 resolve about +-1%% on this 2-core machine")
    p.add_argument("--steps", type=int, default=2, help="steps per block (short blocks: more pairs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-only", action="store_true", help="only the ns-per-span microbenchmark")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config field of the preset, as `megascope train --set`")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the job runs (cuda: one GPU per rank, default tracing = CUDA events + NVML)")
    p.add_argument("--progress", action="store_true", help="print each round's mean step time per mode")
    p.add_argument("--cupti", action="store_true",
                   help="a third block per round: the default tracing plus CUPTI kernel activity (GPU)")
    args = p.parse_args()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # a timed-out run says where it was
    devices = ["none", "cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    print("| microbenchmark (training thread) | ns |\n|---|---:|")
    for device in devices:
        label = {"none": "span, no active tracer", "cpu": "span, active, CPU clock"}.get(
            device, "span, active, CUDA events")
        print(f"| {label} | {microbench(device):.0f} |")
    print(f"| async op, completed before wait (1 span) | {microbench_comm(False):.0f} |")
    print(f"| async op, blocking wait (op + .wait span) | {microbench_comm(True):.0f} |")
    if args.micro_only:
        return
    result = run_job(args)
    rounds = result["rounds"]
    n_on = sum(len(r["on"]) for r in rounds)
    spans_per_step = result["spans"] / n_on
    print(f"\njob: megascope trainer, preset {args.preset}, dp={args.dp} tp={args.tp} pp={args.pp} on "
          f"{args.device} (gloo); {args.rounds} rounds x {args.steps} steps per mode, interleaved; rank 0; "
          f"{spans_per_step:.0f} spans/step; completion sweeps/step (background thread, when something was "
          f"pending) {result['wakeups'] / n_on:.1f}")
    print("B/A = ratio of the means over all rounds; the 95% interval resamples whole rounds "
          "(bootstrap), so it is what the run can resolve")
    print("| statistic | A | B | A (ms) | B (ms) | B/A (95% CI) | overhead % | median of per-round ratios | "
          "cost per span (ns) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    pairs = [("off", "on")] + ([("off", "cupti"), ("on", "cupti")] if args.cupti else [])
    for label, key in (("step time (wall)", ""), ("training thread CPU", "thread_"),
                       ("process CPU (all threads)", "cpu_")):
        for a, b in pairs:
            stat = paired_ratio(rounds, key, a, b)
            per_span = (stat.on - stat.off) / spans_per_step * 1e9 if spans_per_step and b == "on" else float("nan")
            print(f"| {label} | {a} | {b} | {stat.off * 1e3:.2f} | {stat.on * 1e3:.2f} | {stat.ratio:.4f} "
                  f"({stat.low:.4f}-{stat.high:.4f}) | {(stat.ratio - 1) * 100:+.2f} | {stat.median:.4f} | "
                  f"{per_span:.0f} |")
    if args.cupti:
        n_cupti = sum(len(r["cupti"]) for r in rounds)
        kernels_per_step = result["kernels"] / max(n_cupti, 1)
        stat = paired_ratio(rounds, "", "on", "cupti")
        print(f"\nCUPTI kernel activity: {kernels_per_step:.0f} kernels/step recorded; cost per kernel "
              f"{(stat.on - stat.off) / max(kernels_per_step, 1) * 1e9:.0f} ns of step time "
              f"(cupti - on, 95% CI of the ratio {stat.low:.4f}-{stat.high:.4f})")
    print_cpu_by_role(result["by_role"], {mode: sum(len(r[mode]) for r in rounds) for mode in modes(args)})


@dataclass
class PairedRatio:
    off: float
    on: float
    ratio: float
    low: float
    high: float
    median: float


def paired_ratio(rounds: list[dict[str, list[float]]], key: str, a: str = "off", b: str = "on",
                 resamples: int = 2000) -> PairedRatio:
    """b/a (modes, e.g. on/off) as the ratio of the means over all rounds (each round runs a block of
    every mode back to back), its 95% bootstrap interval over rounds, and the median of the per-round
    ratios. The result's `off` and `on` fields are the means of a and b."""
    off = np.array([statistics.fmean(r[key + a]) for r in rounds])
    on = np.array([statistics.fmean(r[key + b]) for r in rounds])
    picks = np.random.default_rng(0).integers(0, len(rounds), (resamples, len(rounds)))
    boot = on[picks].sum(axis=1) / off[picks].sum(axis=1)
    low, high = np.quantile(boot, [0.025, 0.975])
    return PairedRatio(off.mean(), on.mean(), on.sum() / off.sum(), float(low), float(high),
                       float(np.median(on / off)))


def print_cpu_by_role(by_role: dict[str, dict[str, float]], steps: dict[str, int]) -> None:
    """Where the extra CPU goes (rank 0, summed over all blocks of a mode, per step)."""
    names = list(steps)
    print("\nCPU per step by thread, rank 0 (us): where tracing costs")
    print("| thread | " + " | ".join(names) + " | on - off |\n|---|" + "---:|" * (len(names) + 1))
    for role, label in (("training", "training thread"), ("tracer", "tracer threads (megascope-*)"),
                        ("other", "other threads (gloo, ...)"), ("process", "process")):
        def per_step(mode: str) -> float:
            d = by_role[mode]
            value = d["process"] - d["training"] - d["tracer"] if role == "other" else d[role]
            return 1e6 * value / max(steps[mode], 1)
        values = [per_step(mode) for mode in names]
        print(f"| {label} | " + " | ".join(f"{v:.0f}" for v in values) + f" | {values[1] - values[0]:+.0f} |")


if __name__ == "__main__":
    main()
