"""Scale benchmark: a simulated 12,288-rank x 100-step trace analyzed end to end (`megascope analyze
--json`, what-if replays included) in a fresh process; prints wall time and peak RSS.

    python benchmarks/analyzer_scale.py [--dp 192 --tp 8 --pp 8 --steps 100] [--out /tmp/megascope-scale]

Targets (DESIGN.md section 6): under 60 s and 4 GB on the 2-core dev machine.
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
    return con.execute(f"SELECT count(*) FROM read_parquet('{out}/events/rank=*/*.parquet', hive_partitioning=false)").fetchone()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=192)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="/tmp/megascope-scale")
    ap.add_argument("--regenerate", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    world = args.dp * args.tp * args.pp
    gen_s = float("nan")
    if args.regenerate or not (out / "run.json").exists() or \
            json.loads((out / "run.json").read_text())["topology"]["world"] != world:
        shutil.rmtree(out, ignore_errors=True)
        from megascope.samples.simulator import SimConfig, simulate
        t = time.perf_counter()
        simulate(out, SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                                inject=[f for f in FAULTS if max(int(x) for x in f.split("=")[1].split(",")[0].split("-")) < world]))
        gen_s = time.perf_counter() - t
    n_events = _events(out)
    disk = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(out), "--json"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode:
        print(res.stderr, file=sys.stderr)
        return 1
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rep = json.loads(res.stdout)
    rows = [("layout", f"dp={args.dp} tp={args.tp} pp={args.pp} ({world} ranks) x {args.steps} steps"),
            ("events", f"{n_events:,} ({disk / 2**20:,.0f} MiB of Parquet)"),
            ("simulate (s)", f"{gen_s:.1f}" if gen_s == gen_s else "cached"),
            ("analyze wall (s)", f"{wall:.1f}  (target < 60)"),
            ("analyze peak RSS (MiB)", f"{peak_mb:,.0f}  (target < 4096)"),
            ("findings", ", ".join(f"{f['kind']}:{f['ranks'][:2]}@{f['steps'][0]}" for f in rep["findings"]) or "none"),
            ("cores", str(os.cpu_count()))]
    width = max(len(k) for k, _ in rows)
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
