"""A sustained slowdown applied from outside (issue 13 case 2): a real `megascope train --dp 2 --pp 2`
job, one rank stopped by a SIGSTOP/SIGCONT duty cycle from a share of the run on (no `--inject`: the
trainer does not know), then `analyze`. Prints the job's median step time before and after the onset,
the rank's compute ratio against its stage peer, and the findings; the verdict is a straggler (or a
late launch: a stop outside compute spans is host time) on that rank with its onset near the start
of the duty cycle, and nothing else. `--clean` runs the same job without the stops.

    python benchmarks/external_slowdown.py [--steps 1800] [--rank 1] [--duty 0.3] [--period-ms 20]
                                           [--onset 0.45] [--clean] [--run-dir DIR]

Takes minutes (1,800 steps of ~0.1 s on the 2-core dev box): not part of the test suite.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megascope.analyzer import Run
from megascope.trainer.robust.heartbeat import read_heartbeats


def _beat(run_dir: Path, rank: int) -> dict | None:
    # the ranks beat through the job's control store; a tool outside the job reads the driver's view
    # (RUN/health.json) or, for a rank started without a store, its heartbeat file
    return read_heartbeats(run_dir).get(rank)


def train_with_stops(run_dir: Path, steps: int, rank: int, duty: float, period_s: float, onset: float) -> int | None:
    """Run the job; from step onset x steps on, stop `rank` for duty x period of every period. Returns
    the step the stops began at (None: never, e.g. --clean)."""
    cmd = [sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
           "--steps", str(steps), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    began = None
    pid = None
    try:
        while proc.poll() is None:
            beat = _beat(run_dir, rank)
            step = int(beat.get("step") or 0) if beat else 0
            if beat and duty > 0 and step >= onset * steps:
                pid = pid or int(beat["pid"])
                began = began if began is not None else step
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(duty * period_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                time.sleep((1 - duty) * period_s)
            else:
                time.sleep(0.05)
    except ProcessLookupError:
        pass  # the rank exited between two beats
    finally:
        if proc.poll() is None:
            proc.wait()
    return began


def summarize(run_dir: Path, rank: int, began: int | None) -> None:
    run = Run.open(run_dir)
    steps = run.steps()
    per_step = steps.groupby("step").apply(lambda s: (s.end_ns.max() - s.start_ns.min()) / 1e9)
    if began is not None:
        before, after = per_step[per_step.index < began], per_step[per_step.index >= began]
        print(f"median step time: {before.median():.4f} s before step {began}, {after.median():.4f} s after "
              f"({100 * (after.median() / before.median() - 1):+.1f}%)")
    rs = run.rank_steps()
    rs = rs.assign(work=rs.forward_s + rs.backward_s)
    stage = int(rs.loc[rs["rank"] == rank, "pp"].iloc[0])
    peers = rs[(rs.pp == stage)].pivot_table(index="step", columns="rank", values="work")
    other = [c for c in peers.columns if c != rank]
    if other and began is not None:
        ratio = (peers[rank] / peers[other].median(axis=1)).loc[began:]
        print(f"rank {rank} compute / its stage peer after the onset: median {ratio.median():.2f} "
              f"(log-ratio {math.log(ratio.median()):.2f})")
    findings = run.findings()
    print(f"{len(findings)} finding(s):")
    for f in findings:
        print(f"  {f.kind} ranks {f.ranks[:6]} steps {list(f.steps)} severity {f.severity:.2f}: {f.summary}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--duty", type=float, default=0.3, help="share of each period the rank is stopped")
    ap.add_argument("--period-ms", type=float, default=20.0,
                    help="stop-resume period; short periods spread the stops over every span (100 ms: a 30 ms "
                         "stop lands in one span per step and the medians barely move)")
    ap.add_argument("--onset", type=float, default=0.45, help="share of the run before the stops begin")
    ap.add_argument("--clean", action="store_true", help="no stops (the same job, for false findings)")
    ap.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slowdown-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "run"
        t0 = time.time()
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        began = train_with_stops(run_dir, args.steps, args.rank, 0.0 if args.clean else args.duty,
                                 args.period_ms / 1e3, args.onset)
        print(f"trained {args.steps} steps in {time.time() - t0:.0f} s (load {load} at the start); "
              f"stops on rank {args.rank}: {'none' if began is None else f'from step {began}'}")
        summarize(run_dir, args.rank, began)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
