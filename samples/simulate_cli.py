"""`megascope simulate OUT --dp --tp --pp [--vpp] --steps [--inject SPEC]...`: write a simulated run."""

from __future__ import annotations

import argparse
import sys

from megascope.cli import DefaultsHelpFormatter
from megascope.trainer.robust.faults import SIMULATE_KINDS, usage


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="write a simulated run directory (any layout, injected faults)",
                              formatter_class=DefaultsHelpFormatter,
                              description="Simulate a dp x tp x pp (x vpp) training job with a 1F1B/interleaved "
                                          "timeline, noise and injected faults; writes what the tracer writes.")
    p.add_argument("out", metavar="OUT", help="run directory to create, or an object-store URL (s3://bucket/prefix: "
                                              "written locally, then uploaded with run.json last)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (>1: interleaved 1F1B)")
    p.add_argument("--steps", type=int, default=20, help="training steps to simulate")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the timing noise")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="fault: " + usage(SIMULATE_KINDS))
    p.add_argument("--force", action="store_true", help="overwrite OUT if it already holds a run")
    return p


def run(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from megascope.samples.faults_sim import FaultSpecError
    from megascope.samples.simulator import SimConfig, simulate
    from megascope.tracer.storage import StorageError, is_url, publish, stage_for
    url = args.out if is_url(args.out) else None
    if url:  # staged locally, uploaded whole when complete
        try:
            out = stage_for(url, args.force, "pass --force to overwrite")
        except StorageError as exc:
            print(f"megascope simulate: {exc}", file=sys.stderr)
            return 2
    else:
        out = Path(args.out)
    if not url and (out / "run.json").exists():
        if not args.force:
            print(f"megascope simulate: {out} already holds a run; pass --force to overwrite", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    cfg = SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, steps=args.steps,
                    micro_batches=args.micro_batches, seed=args.seed, inject=args.inject)
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if tty:
            sys.stderr.write(f"\rsimulating step {done}/{total}")
            sys.stderr.flush()

    try:
        simulate(out, cfg, progress)
    except (FaultSpecError, ValueError) as exc:
        print(f"megascope simulate: {exc}", file=sys.stderr)
        return 2
    if tty:
        sys.stderr.write("\n")
    if url:
        try:
            publish(out, url)
        except (StorageError, OSError) as exc:
            print(f"megascope simulate: uploading to {url} failed: {exc}", file=sys.stderr)
            return 2
        out = url
    print(f"wrote {cfg.world} ranks x {cfg.steps} steps to {out}")
    return 0
