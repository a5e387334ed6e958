"""Scale benchmark: a simulated 12,288-rank x 100-step trace analyzed end to end (`megascope analyze
--json`, what-if replays included) in a fresh process; prints wall time and peak RSS.

    python benchmarks/analyzer_scale.py [--dp 192 --tp 8 --pp 8 --steps 100] [--out /tmp/megascope-scale]
                                        [--phases]

Targets (DESIGN.md section 6): under 60 s and 4 GB on the 2-core dev machine. The wall time depends on
what else runs on the machine: the table gives the load average and the process's CPU seconds (user +
sys, all threads) next to it. `--phases` also runs the same analysis through the Python API in a second
fresh process, timing each phase (wall and CPU seconds): open, event pass, late arrivals, each detector,
hang check, what-if replays, and the rest of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

FAULTS = ["straggler:rank=1000,slowdown=0.1,from=40", "late_launch:rank=5000,ms=20,every=3,from=30",
          "flap:ranks=777-2313,down_ms=10,period_steps=10"]


def _events(out: Path) -> int:
    import duckdb
    con = duckdb.connect()
    sql = f"SELECT count(*) FROM read_parquet('{out}/events/rank=*/*.parquet', hive_partitioning=false)"
    return con.execute(sql).fetchone()[0]


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def phases(run_dir: str) -> dict[str, tuple[float, float]]:
    """Per-phase (wall s, CPU s) of Run.report() on a fresh Run (called in a child process)."""
    from megascope.analyzer.run import Run

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            w, c = time.perf_counter(), cpu()
            try:
                return fn(*a, **k)
            finally:
                acc = out.setdefault(name, [0.0, 0.0])
                acc[0] += time.perf_counter() - w
                acc[1] += cpu() - c
        return wrapper

    w0, c0 = time.perf_counter(), cpu()
    run = timed("open", Run.open)(run_dir)
    timed("event pass", run._ensure)("rank_step")
    timed("late arrivals", run._ensure)("collectives")
    for det in run.detectors:
        det.detect = timed(f"detect: {type(det).__name__}", det.detect)
    run.hang = timed("hang check", run.hang)
    run.what_if = timed("what-if", run.what_if)
    timed("report", run.report)()
    rest = out.pop("report")
    before = ("open", "event pass", "late arrivals")  # timed before the report, outside it
    inner = [sum(v[i] for k, v in out.items() if k not in before) for i in (0, 1)]
    out["report (the rest)"] = [rest[0] - inner[0], rest[1] - inner[1]]
    out["total"] = [time.perf_counter() - w0, cpu() - c0]
    out["peak RSS (MiB)"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0.0]
    return {k: (round(v[0], 2), round(v[1], 2)) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=192)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="/tmp/megascope-scale")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--phases", action="store_true", help="also time each phase (a second analysis)")
    ap.add_argument("--child-phases", metavar="RUN", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_phases:
        print(json.dumps(phases(args.child_phases)))
        return 0
    out = Path(args.out)
    world = args.dp * args.tp * args.pp
    gen_s = float("nan")
    if args.regenerate or not (out / "run.json").exists() or \
            json.loads((out / "run.json").read_text())["topology"]["world"] != world:
        shutil.rmtree(out, ignore_errors=True)
        from megascope.samples.simulator import SimConfig, simulate
        t = time.perf_counter()
        simulate(out, SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                                inject=[f for f in FAULTS
                                        if max(int(x) for x in f.split("=")[1].split(",")[0].split("-")) < world]))
        gen_s = time.perf_counter() - t
    n_events = _events(out)
    disk = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    load = os.getloadavg()[0]
    t, cpu = time.perf_counter(), _cpu_children()
    res = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(out), "--json"],
                         capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, _cpu_children() - cpu
    load = max(load, os.getloadavg()[0])
    if res.returncode:
        print(res.stderr, file=sys.stderr)
        return 1
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rep = json.loads(res.stdout)
    rows = [("layout", f"dp={args.dp} tp={args.tp} pp={args.pp} ({world} ranks) x {args.steps} steps"),
            ("events", f"{n_events:,} ({disk / 2**20:,.0f} MiB of Parquet)"),
            ("simulate (s)", f"{gen_s:.1f}" if gen_s == gen_s else "cached"),
            ("analyze wall (s)", f"{wall:.1f}  (target < 60)"),
            ("analyze CPU (s)", f"{cpu:.1f}  (user + sys, all threads)"),
            ("load average (1 min, max of start/end)", f"{load:.1f} on {os.cpu_count()} cores"),
            ("analyze peak RSS (MiB)", f"{peak_mb:,.0f}  (target < 4096)"),
            ("findings", ", ".join(f"{f['kind']}:{f['ranks'][:2]}@{f['steps'][0]}" for f in rep["findings"]) or "none"),
            ("cores", str(os.cpu_count()))]
    width = max(len(k) for k, _ in rows)
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.phases:
        load = os.getloadavg()[0]
        res = subprocess.run([sys.executable, __file__, "--child-phases", str(out)], capture_output=True, text=True)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return 1
        load = max(load, os.getloadavg()[0])
        print(f"\nPhases (Python API, fresh process; load average {load:.1f}):\n")
        print("| phase | wall (s) | CPU (s) |\n|---|---|---|")
        for name, (w, c) in json.loads(res.stdout.strip().splitlines()[-1]).items():
            print(f"| {name} | {w:,.1f} | {c:,.1f} |" if "MiB" not in name else f"| {name} | {w:,.0f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
