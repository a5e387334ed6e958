"""`megascope analyze RUN [--json] [--html FILE] [--set KEY=VALUE]`: findings first, then the MFU summary."""

from __future__ import annotations

import argparse
import json
import sys

from megascope.analyzer.data.store import RunOpenError
from megascope.analyzer.report.build import build_report, json_safe, render_text
from megascope.analyzer.settings import AnalyzerSettings, SettingsError, apply_set
from megascope.progress import ProgressBar


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("analyze", help="diagnose a run: stragglers, flaps, hangs, MFU",
                              description="Analyze a run directory and report findings (one actionable "
                                          "sentence each) and the MFU timeline.")
    p.add_argument("run_dir", metavar="RUN", help="run directory (from `megascope train` or `megascope simulate`) or "
                                                  "object-store URL (s3://bucket/prefix: read through a local "
                                                  "mirror under $MEGASCOPE_CACHE_DIR, default ~/.cache/megascope)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with plots")
    p.add_argument("--no-what-if", action="store_true", help="skip the what-if replays (faster on huge runs)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="DuckDB threads, and on summaries at the edge the worker processes that aggregate "
                        "the ranks' collective rows, >= 1 (default: all cores)")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="where the event pass's batches of ranks run: this process's DuckDB (default) or Ray "
                        "tasks (each opens the run directory itself, or of a URL mirrors only its batch's ranks on "
                        "its worker; results merged here)")
    p.add_argument("--address", metavar="HOST:PORT", help="Ray cluster to use with --engine ray (default: start a "
                                                          "local one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="change one analyzer setting, e.g. --set detect.straggler.min_ratio=1.05 (repeatable; every "
                        "setting and its default: docs/config.md; the report records the settings used)")
    return p


def settings_of(items: list[str]) -> AnalyzerSettings:
    """The defaults with each --set item applied in order (raises SettingsError)."""
    settings = AnalyzerSettings()
    for item in items:
        apply_set(settings, item)
    return settings


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prints the message and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class EngineChoiceError(ValueError):
    """--engine/--address cannot be used as given; the message says what to do."""


def _engine(args: argparse.Namespace):
    """The event pass's engine for --engine/--address (None: local)."""
    if getattr(args, "engine", "local") != "ray":
        if getattr(args, "address", None):
            raise EngineChoiceError("--address is the Ray cluster of --engine ray; add --engine ray")
        return None
    from megascope.analyzer.data.engine_ray import EngineError, RayEngine
    try:
        return RayEngine(address=args.address)
    except EngineError as exc:
        raise EngineChoiceError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from megascope.analyzer.run import Run
    bar = ProgressBar()
    try:
        settings = settings_of(args.settings)
        bar("opening", 0, 3)
        engine = _engine(args)
        analysis = Run.open(args.run_dir, progress=bar, threads=args.threads, engine=engine, settings=settings)
        bar("analyzing", 1, 3)
        report = build_report(analysis, with_what_if=not args.no_what_if)
        if args.html:
            from megascope.analyzer.report.html import write_html
            from megascope.analyzer.report.plots import plot_data
            bar("html", 2, 3)
            write_html(report, plot_data(analysis), args.html)
        bar("done", 3, 3)
    except (RunOpenError, EngineChoiceError, SettingsError) as exc:
        bar.close()
        print(f"megascope analyze: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        bar.close()
        print(f"megascope analyze: cannot analyze {args.run_dir}: {exc}", file=sys.stderr)
        return 1
    bar.close()
    if args.json:
        json.dump(json_safe(report), sys.stdout, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        print(render_text(report))
        if args.html:
            print(f"HTML report: {args.html}")
    return 0

