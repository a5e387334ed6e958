"""`megascope export RUN --perfetto FILE [--steps A:B] [--ranks 0,4-7]`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megascope.analyzer.run import Run

WINDOW_STEPS = 2
"""Steps exported without --steps: the onset of the top finding and the one after (a Perfetto trace
of every rank grows by ~10^4 spans a step; two steps show a straggler against its peers)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export a window of a run as Chrome/Perfetto trace JSON",
                              description="Write Chrome/Perfetto trace JSON (open in ui.perfetto.dev): one "
                                          "track per rank, flow arrows for p2p and collective dependencies.")
    p.add_argument("run_dir", metavar="RUN", help="run directory or object-store URL (s3://bucket/prefix: read "
                                                  "through a local mirror under $MEGASCOPE_CACHE_DIR, default "
                                                  "~/.cache/megascope)")
    p.add_argument("--perfetto", metavar="FILE", required=True, help="output .json file")
    p.add_argument("--steps", default=None,
                   help="step window A:B or step A (inclusive; default: 2 steps from the onset of the top finding, "
                        "or after the warm-up step when there is none)")
    p.add_argument("--ranks", default=None, help="ranks, e.g. 0,4-7 (default: all, at most 64)")
    return p


def parse_ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, sep, b = part.partition("-")
        if not a.strip().isdigit() or (sep and not b.strip().isdigit()):
            raise ValueError(f"--ranks: '{part}' is not a rank or a range A-B (e.g. --ranks 0,4-7)")
        if sep and int(b) < int(a):
            raise ValueError(f"--ranks: '{part}' is an empty range (write the lower rank first)")
        out += list(range(int(a), int(b) + 1)) if sep else [int(a)]
    if not out:
        raise ValueError(f"--ranks: '{text}' names no rank (e.g. --ranks 0,4-7)")
    return out


def parse_steps(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        first, last = (int(a), int(b)) if sep else (int(a), int(a))
    except ValueError:
        raise ValueError(f"--steps: '{text}' is not A:B (e.g. --steps 10:12)") from None
    if last < first:
        raise ValueError(f"--steps: '{text}' is an empty window (write the first step first)")
    return first, last


def spans_text(values: list[int]) -> str:
    """'0-3, 8, 10-11' for a sorted list of integers."""
    out: list[str] = []
    start = prev = None
    for v in values:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def check_ranks(ranks: list[int], known: list[int]) -> None:
    """Refuse ranks the run does not have (an empty trace would look like a run without events)."""
    unknown = sorted(set(ranks) - set(known))
    if unknown:
        raise ValueError(f"--ranks: rank(s) {spans_text(unknown)} are not in this run; "
                         f"it has ranks {spans_text(known)}")


def check_steps(steps: tuple[int, int], span: tuple[int, int] | None) -> None:
    if span is None:
        raise ValueError("the run has no steps recorded yet; nothing to export")
    if steps[1] < span[0] or steps[0] > span[1]:
        raise ValueError(f"--steps {steps[0]}:{steps[1]} is outside the run; it has steps {span[0]}-{span[1]}")


def default_window(analysis: Run, span: tuple[int, int]) -> tuple[tuple[int, int], str]:
    """The steps to export without --steps, and why: from the onset of the top finding; without
    findings, the steps after the warm-up step (whose compilation and allocation say little)."""
    findings = analysis.findings()
    if findings:
        top = findings[0]
        first = min(max(int(top.steps[0]), span[0]), span[1])
        who = f"rank{'s' if len(top.ranks) > 1 else ''} {spans_text(sorted(top.ranks)[:16])}"
        why = f"around the top finding ({top.kind}, {who}, from step {top.steps[0]})"
    else:
        first = span[0] + 1 if span[1] > span[0] else span[0]
        why = "after the warm-up step (no findings)"
    return (first, min(first + WINDOW_STEPS - 1, span[1])), why


def run(args: argparse.Namespace) -> int:
    from megascope.analyzer.data.remote_run import local_run_dir
    from megascope.analyzer.data.store import RunOpenError
    from megascope.analyzer.report.perfetto import write_perfetto
    from megascope.analyzer.report.trace import build_trace
    from megascope.analyzer.run import Run
    try:
        ranks = parse_ranks(args.ranks) if args.ranks else None
        steps = parse_steps(args.steps) if args.steps is not None else None
        analysis = Run.open(local_run_dir(args.run_dir))
        row = analysis.store.query("SELECT min(step) AS a, max(step) AS b FROM steps WHERE step >= 0")
        span = None if row.a.isna().iloc[0] else (int(row.a.iloc[0]), int(row.b.iloc[0]))
        if ranks is not None:
            check_ranks(ranks, sorted(int(r) for r in analysis.topology["rank"]))
        if steps is None:
            check_steps((0, 0) if span is None else span, span)
            assert span is not None  # check_steps refuses a run without steps
            steps, why = default_window(analysis, span)
            print(f"megascope export: no --steps: exporting steps {steps[0]}-{steps[1]} {why}; "
                  "pass --steps A:B for another window", file=sys.stderr)
        else:
            check_steps(steps, span)
            assert span is not None  # check_steps refuses a run without steps
            clipped = (max(steps[0], span[0]), min(steps[1], span[1]))
            if clipped != steps:
                print(f"megascope export: the run has steps {span[0]}-{span[1]}; exporting steps "
                      f"{clipped[0]}-{clipped[1]}", file=sys.stderr)
                steps = clipped
        if ranks is None and len(analysis.topology) > 64:
            ranks = sorted(int(r) for r in analysis.topology["rank"])[:64]
            print(f"megascope export: more than 64 ranks; exporting ranks {spans_text(ranks)} (use --ranks)",
                  file=sys.stderr)
        n = write_perfetto(build_trace(analysis, steps, ranks), args.perfetto)
    except (RunOpenError, ValueError, OSError) as exc:
        print(f"megascope export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} spans for steps {steps[0]}-{steps[1]} to {args.perfetto} (open it in https://ui.perfetto.dev)")
    return 0
