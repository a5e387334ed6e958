"""`megascope demo`: the main job for a newcomer, end to end on a laptop-sized machine.

Trains the tiny GPT on 4 CPU ranks (dp=2, pp=2) with one rank made 1.6x slower from step 8, traces
it, analyzes the trace (the straggler should be named, its victims not), writes an HTML report and a
Perfetto trace, and says how to open the dashboard.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megascope.cli import main as megascope


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="train, trace and diagnose a small job with an injected straggler",
        description="End to end on a laptop: train a tiny GPT (dp=2, pp=2) with a straggler injected "
                    "on one rank, analyze the trace, write an HTML report and a Perfetto trace.")
    p.add_argument("--run-dir", default="runs/demo", help="where the run goes")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--clean", action="store_true", help="no injected fault (the analysis should find nothing)")
    p.add_argument("--dashboard", action="store_true", help="open the dashboard on the run at the end")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    train = ["train", "--preset", "tiny", "--dp", "2", "--pp", "2", "--steps", str(args.steps),
             "--run-dir", str(run_dir)]
    if not args.clean:
        train += ["--inject", "straggler:rank=1,slowdown=1.6,from=8"]
    print(f"== 1/3 training: megascope {' '.join(train)}", flush=True)
    if rc := megascope(train):
        return rc
    report = run_dir / "report.html"
    print(f"\n== 2/3 analysis: megascope analyze {run_dir} --html {report}", flush=True)
    if rc := megascope(["analyze", str(run_dir), "--html", str(report)]):
        return rc
    trace = run_dir / "trace.perfetto.json"
    print(f"\n== 3/3 export: megascope export {run_dir} --perfetto {trace}", flush=True)
    if rc := megascope(["export", str(run_dir), "--perfetto", str(trace)]):
        return rc
    print(f"\nReport: {report}\nPerfetto trace: {trace} (open it at ui.perfetto.dev)\n"
          f"Dashboard: megascope dashboard {run_dir}", flush=True)
    if args.dashboard:
        return megascope(["dashboard", str(run_dir)])
    return 0
