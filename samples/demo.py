"""`megascope demo`: the main job for a newcomer, end to end on a laptop-sized machine.

Trains the tiny GPT on 8 CPU ranks (dp=2, tp=2, pp=2: all three parallelisms) with two faults
injected: rank 3 made 1.6x slower from step 8 (a straggler) and the pipeline link 1<->5 going down
for 40 ms per transfer every 8 steps (a flapping link). Traces it, analyzes the trace (both faults
should be named, their victims not), writes an HTML report and a Perfetto trace, and serves the
dashboard on the run (the URL is printed; Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megascope.cli import DefaultsHelpFormatter
from megascope.cli import main as megascope
from megascope.tracer.run_dir import run_entries

DEFAULT_RUN_DIR = "runs/demo"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="train, trace and diagnose a small 3D-parallel job with a straggler and a flapping link",
        formatter_class=DefaultsHelpFormatter,
        description="End to end on a laptop: train a tiny GPT on 8 CPU ranks (dp=2, tp=2, pp=2) with a "
                    "straggler and a flapping pipeline link injected, analyze the trace, write an HTML "
                    "report and a Perfetto trace, then serve the dashboard on the run.")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                   help="where the run goes: a new or empty directory (the default becomes runs/demo-2, -3, ... "
                        "when runs/demo holds an earlier run)")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--clean", action="store_true", help="no injected fault (the analysis should find nothing)")
    p.add_argument("--no-dashboard", action="store_true", help="stop after the analysis instead of serving "
                   "the dashboard")
    p.add_argument("--port", type=int, default=8050, help="dashboard port on 127.0.0.1")


MIN_STEPS = 12
"""The straggler starts at step 8; a few steps after it make it visible."""


def run(args: argparse.Namespace) -> int:
    if args.steps < MIN_STEPS and not args.clean:
        print(f"megascope demo: --steps {args.steps} ends before the injected straggler shows (it starts at "
              f"step 8); pass --steps {MIN_STEPS} or more, or --clean", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    if args.run_dir == DEFAULT_RUN_DIR:  # `make demo` twice: train refuses to mix runs, so take the next free name
        n = 1
        while run_entries(run_dir):
            n += 1
            run_dir = Path(f"{DEFAULT_RUN_DIR}-{n}")
        if n > 1:
            print(f"{DEFAULT_RUN_DIR} holds an earlier run: this one goes to {run_dir}", flush=True)
    train = ["train", "--preset", "tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", str(args.steps),
             "--run-dir", str(run_dir)]
    if not args.clean:
        train += ["--inject", "straggler:rank=3,slowdown=1.6,from=8",
                  "--inject", "flap:ranks=1-5,down_ms=40,period_steps=8"]
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
    print(f"\nReport: {report}\nPerfetto trace: {trace} (open it at ui.perfetto.dev)", flush=True)
    if args.no_dashboard:
        print(f"Dashboard: megascope dashboard {run_dir}", flush=True)
        return 0
    print("\n== dashboard (Ctrl-C stops it)", flush=True)
    return megascope(["dashboard", str(run_dir), "--port", str(args.port)])
