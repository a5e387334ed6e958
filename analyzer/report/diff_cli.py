"""`megascope diff RUN_A RUN_B [--json] [--all]`: what changed from run A to run B (views/run_diff.py)."""

from __future__ import annotations

import argparse
import json
import sys

from megascope.analyzer.data.store import RunOpenError
from megascope.analyzer.report.build import json_safe
from megascope.analyzer.views.run_diff import (
    TOP_RANKS,
    Change,
    DiffInputError,
    RunDiff,
    finding_text,
    layout_text,
    seconds_text,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diff", help="what changed between two runs: step time, MFU, phases per stage, ranks, findings",
        description="Compare run B with run A (e.g. before and after a code or config change): step time and "
                    "MFU, each phase (forward, backward, optimizer, data wait, each collective and pipeline "
                    "transfer kind) per pipeline stage, the ranks whose own time moved most, and the findings "
                    "that appeared or went away. A change is named only when it exceeds the runs' own "
                    "step-to-step spread and is beyond chance for their number of steps (docs/diff.md). "
                    "Runs of different layouts compare what they share and say what they do not.")
    p.add_argument("run_a", metavar="RUN_A", help="the baseline run directory (or s3:// URL)")
    p.add_argument("run_b", metavar="RUN_B", help="the run compared with it (the same run twice: no change)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    p.add_argument("--all", action="store_true", help="also list the changes that stay within the noise")
    return p


def run(args: argparse.Namespace) -> int:
    from megascope.analyzer.run import Run
    from megascope.analyzer.views.run_diff import diff
    try:
        run_a = Run.open(args.run_a)
        run_b = run_a if _same(args.run_a, args.run_b) else Run.open(args.run_b)
        result = diff(run_a, run_b)
    except (RunOpenError, DiffInputError) as exc:
        print(f"megascope diff: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"megascope diff: cannot compare {args.run_a} with {args.run_b}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(json_safe(result.to_dict()), sys.stdout, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        print(render_text(result, args.all))
    return 0


def _same(a: str, b: str) -> bool:
    """The same run named twice: one Run serves both sides (its summary is built once)."""
    from pathlib import Path

    from megascope.tracer.storage import is_url
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def render_text(d: RunDiff, everything: bool = False) -> str:
    lines = [f"run A: {d.a}  ({layout_text(d.layout_a)}, {d.steps_a} steps)",
             f"run B: {d.b}  ({layout_text(d.layout_b)}, {d.steps_b} steps)",
             f"step time {seconds_text(d.step_time.a)} -> {seconds_text(d.step_time.b)} (median a step)"
             + (f", MFU {100 * d.mfu.a:.2f}% -> {100 * d.mfu.b:.2f}%" if d.mfu is not None else "")]
    named = d.named
    lines.append(f"\nWhat changed ({len(named)} beyond the runs' own step-to-step noise):")
    lines += [f"  {c.sentence()}" for c in named] or ["  nothing beyond the runs' own noise"]
    if d.ranks:
        lines.append(f"\nRanks whose own time (compute + data wait + host gaps) moved most (top {TOP_RANKS}):")
        lines += [f"  {_row(c)}" for c in d.ranks]
    if everything:
        lines.append("\nEvery phase (stage, then job-wide):")
        lines += [f"  {_row(c)}" for c in d.stages + d.phases]
    lines.append("\nFindings that appeared in run B:")
    lines += [f"  {finding_text(f)}" for f in d.appeared] or ["  none"]
    lines.append("Findings that went away (in run A only):")
    lines += [f"  {finding_text(f)}" for f in d.went_away] or ["  none"]
    if d.not_compared:
        lines.append("\nNot compared:")
        lines += [f"  {note}" for note in d.not_compared]
    return "\n".join(lines)


def _row(c: Change) -> str:
    mark = "*" if c.named else " "
    return (f"{mark} {c.measure:<34} {c.scope:<9} {seconds_text(c.a):>9} -> {seconds_text(c.b):>9}  "
            f"{seconds_text(c.delta, signed=True):>9}  (named beyond {seconds_text(c.threshold)})")
