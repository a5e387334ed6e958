"""Detection latency of `megascope watch`: steps from an injected fault's onset to its first alert.

Each case is a simulated run (samples/simulator.py) landed one step at a time into a live directory
(tests/watch_feed.Feeder: per-rank segments split by step, renamed into place as the tracer does), with
one watcher poll after each step, as a watcher beside a job sees it when it keeps up. Latency = the
watcher's last complete step when it first announced a finding of the expected kind naming the
culprit, minus the onset. A hang has no later step: its latency is whether the first poll after
the in-flight records landed named it. Clean runs count every finding as false.

    python benchmarks/watch_latency.py [--seeds 0 1 2] [--case NAME]...
    python benchmarks/watch_latency.py --cost-ranks 1024 [--cost-ranks 12288]

Prints a Markdown table (docs/measurements.md's) and the seconds per tick with the load average next to it.
--cost-ranks: the cost of a watcher's first tick on a finished simulated run of that many ranks (tp=8,
pp=2): list the segments, read them all, summarize every step, judge the last window; wall and CPU
seconds, and the peak RSS. What a watcher beside a growing run spends per step is
benchmarks/watch_scale.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascope.analyzer.watch.watcher import WatchConfig, Watcher  # noqa: E402
from megascope.samples.independent_gen import GenSpec, HostPause, Noise, SlowRank, import_run  # noqa: E402
from tests.watch_feed import Feeder, simulate_steps  # noqa: E402

STEPS = 30
ONSET = 10


@dataclass
class Case:
    name: str
    layout: dict
    inject: list[str]
    kind: str | None
    """Expected finding kind (None: a clean run)."""
    culprit: int | None = None
    gen: GenSpec | None = None
    """A trace from samples/independent_gen.py (shares nothing with the simulator), imported with
    `megascope import ndtimeline`, instead of a simulated run."""


# held-out traces: heavy-tailed compute noise, GC pauses and p2p jitter (the accuracy suite's style)
HELD_OUT_NOISE = Noise(kind="student_t", sigma=0.03, gc_prob=0.05, gc_s=0.004, p2p_sigma=0.2)
HELD_OUT = GenSpec(dp=4, tp=1, pp=2, steps=STEPS, micro=4, noise=HELD_OUT_NOISE)


def held_out(*faults) -> GenSpec:
    return GenSpec(**{**HELD_OUT.__dict__, "faults": list(faults)})


CASES = [
    Case("straggler 20%", dict(dp=4, tp=1, pp=2), [f"straggler:rank=5,slowdown=0.2,from={ONSET}"], "straggler", 5),
    Case("straggler 10%", dict(dp=4, tp=1, pp=2), [f"straggler:rank=5,slowdown=0.1,from={ONSET}"], "straggler", 5),
    Case("late launch 15 ms every 2nd step", dict(dp=4, tp=2, pp=2),
         [f"late_launch:rank=5,ms=15,every=2,from={ONSET}"], "late_launch", 5),
    Case("network flap (2 of every 6 steps)", dict(dp=2, tp=1, pp=4),
         [f"flap:ranks=1-3,down_ms=20,period_steps=6,len=2,from={ONSET}"], "network_flap", 1),
    Case("hang", dict(dp=2, tp=2, pp=2), [f"hang:rank=5,at={ONSET}"], "hang", 5),
    Case("clean", dict(dp=4, tp=1, pp=2), [], None),
    Case("held-out trace: straggler 1.3x", {}, [], "straggler", HELD_OUT.rank(1, 1),
         held_out(SlowRank(dp=1, stage=1, fwd=1.3, bwd=1.3, first=ONSET))),
    Case("held-out trace: host pauses 20 ms (p=0.5)", {}, [], "late_launch", HELD_OUT.rank(2, 0),
         held_out(HostPause(dp=2, stage=0, prob=0.5, pause_s=0.02, first=ONSET))),
    Case("held-out trace: clean", {}, [], None, None, held_out()),
]


def run_case(case: Case, seed: int, tmp: Path) -> tuple[int | None, int, list[float]]:
    """(latency in steps or None when missed, false findings, seconds per tick)."""
    if case.gen is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # the importer's "imported N ranks" line
            src = import_run(GenSpec(**{**case.gen.__dict__, "seed": seed}), tmp / "gen")
    else:
        src = simulate_steps(tmp / "src", steps=STEPS, inject=case.inject, seed=seed, **case.layout)
    live = tmp / "live"
    feeder = Feeder(src, live)
    watcher = Watcher(live, WatchConfig(summary=False), out=open(os.devnull, "w"), log=lambda m: None)
    ticks: list[float] = []
    try:
        while feeder.next < feeder.total:
            feeder.feed(1)
            t0 = time.perf_counter()
            watcher.poll()
            ticks.append(time.perf_counter() - t0)
        if case.kind == "hang":
            feeder.feed_inflight()  # the watchdog's records, once the stuck ops outlast its timeout
            watcher.poll()
    finally:
        watcher.close()
    starts = [r for r in watcher.records if r["event"] == "start"]
    hits = [r for r in starts if r["kind"] == case.kind and case.culprit in r["ranks"]]
    false = len([r for r in starts if r not in hits])
    latency = None
    if hits:
        latency = 0 if case.kind == "hang" else hits[0]["at_step"] - ONSET
    return latency, false, ticks


def tick_cost(ranks: int, window: int = 32) -> None:
    """One tick of a watcher that just caught up with a finished run of `ranks` ranks."""
    dp = max(1, ranks // 16)
    with tempfile.TemporaryDirectory(prefix="watch-cost-") as tmp:
        t0 = time.perf_counter()
        src = simulate_steps(Path(tmp) / "run", dp=dp, tp=8, pp=2, steps=window + 8, micro_batches=8)
        sim_s = time.perf_counter() - t0
        watcher = Watcher(src, WatchConfig(summary=False, window=window), out=open(os.devnull, "w"),
                          log=lambda m: None)
        wall, cpu = time.perf_counter(), time.process_time()
        watcher.poll()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        watcher.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"| {dp * 16} | {window} | {wall:.1f} | {cpu:.1f} | {rss:.0f} | (simulated in {sim_s:.0f} s; load {load})",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--case", action="append", help="only these cases (by name prefix)")
    parser.add_argument("--cost-ranks", type=int, action="append", help="measure one tick's cost at this size")
    args = parser.parse_args()
    if args.cost_ranks:
        print("| ranks | window (steps) | tick wall s | tick CPU s | peak RSS MB (process) |")
        print("|---|---|---|---|---|")
        for ranks in args.cost_ranks:
            tick_cost(ranks)
        return 0
    cases = [c for c in CASES if not args.case or any(c.name.startswith(p) for p in args.case)]
    print("| fault (8-16 ranks, onset step 10) | detected | latency (steps) | false findings |")
    print("|---|---|---|---|")
    all_ticks: list[float] = []
    for case in cases:
        latencies, missed, false = [], 0, 0
        for seed in args.seeds:
            with tempfile.TemporaryDirectory(prefix="watch-latency-") as tmp:
                latency, wrong, ticks = run_case(case, seed, Path(tmp))
            all_ticks += ticks
            false += wrong
            if latency is None:
                missed += case.kind is not None
            else:
                latencies.append(latency)
        n = len(args.seeds)
        detected = "-" if case.kind is None else f"{n - missed}/{n}"
        lat = "-" if not latencies else (f"{min(latencies)}-{max(latencies)}" if len(set(latencies)) > 1
                                         else str(latencies[0]))
        print(f"| {case.name} | {detected} | {lat} | {false} |", flush=True)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    print(f"\nseconds per tick: median {statistics.median(all_ticks):.2f}, max {max(all_ticks):.2f} "
          f"({len(all_ticks)} ticks; load average {' '.join(load)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
