"""`megascope export RUN --perfetto FILE [--steps A:B] [--ranks 0,4-7]`."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export a window of a run as Chrome/Perfetto trace JSON",
                              description="Write Chrome/Perfetto trace JSON (open in ui.perfetto.dev): one "
                                          "track per rank, flow arrows for p2p and collective dependencies.")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--perfetto", metavar="FILE", required=True, help="output .json file")
    p.add_argument("--steps", default=None, help="step window A:B (inclusive; default: the first 2 steps)")
    p.add_argument("--ranks", default=None, help="ranks, e.g. 0,4-7 (default: all, at most 64)")
    return p


def parse_ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, sep, b = part.partition("-")
        if not a.strip().isdigit() or (sep and not b.strip().isdigit()):
            raise ValueError(f"--ranks: '{part}' is not a rank or a range A-B (e.g. --ranks 0,4-7)")
        out += list(range(int(a), int(b) + 1)) if sep else [int(a)]
    return out


def parse_steps(text: str | None, first_step: int) -> tuple[int, int]:
    if text is None:
        return first_step, first_step + 1
    a, sep, b = text.partition(":")
    try:
        return (int(a), int(b)) if sep else (int(a), int(a))
    except ValueError:
        raise ValueError(f"--steps: '{text}' is not A:B (e.g. --steps 10:12)") from None


def run(args: argparse.Namespace) -> int:
    from megascope.analyzer.perfetto import write_perfetto
    from megascope.analyzer.run import Run
    from megascope.analyzer.store import RunOpenError
    try:
        analysis = Run.open(args.run_dir)
        first = analysis.store.query("SELECT coalesce(min(step), 0) AS s FROM steps").s.iloc[0]
        steps = parse_steps(args.steps, int(first))
        ranks = parse_ranks(args.ranks) if args.ranks else None
        if ranks is None and len(analysis.topology) > 64:
            ranks = list(range(64))
            print("megascope export: more than 64 ranks; exporting ranks 0-63 (use --ranks)", file=sys.stderr)
        n = write_perfetto(analysis, args.perfetto, steps, ranks)
    except (RunOpenError, ValueError, OSError) as exc:
        print(f"megascope export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} spans for steps {steps[0]}-{steps[1]} to {args.perfetto} (open it in https://ui.perfetto.dev)")
    return 0
