"""The `megascope` console script: a dispatcher; each subcommand lives in the package it drives.

Only the chosen subcommand's module is imported, so `megascope train` on a GPU box needs neither DuckDB
nor Dash, and start-up stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megascope import __version__

# subcommand -> (module exposing add_parser(subparsers) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megascope.trainer.cli", "train a GPT with dp x tp x pp parallelism, traced into a run directory"),
    "analyze": ("megascope.analyzer.report.analyze_cli", "find stragglers, flaps, hangs and the MFU timeline of a run"),
    "diff": ("megascope.analyzer.report.diff_cli", "what changed between two runs: step time, MFU, phases, findings"),
    "export": ("megascope.analyzer.report.export_cli", "write a Perfetto/Chrome trace of a run"),
    "dashboard": ("megascope.dashboard.cli", "web UI over one or more runs (live or offline)"),
    "import": ("megascope.tracer.importers.cli",
               "turn PyTorch profiler / NDTimeline / flight-recorder dumps into a run"),
    "watch": ("megascope.analyzer.watch.cli", "follow a running job: live findings, webhook, Prometheus metrics"),
    "simulate": ("megascope.samples.simulate_cli", "write a simulated run for any layout, with injected faults"),
    "demo": ("megascope.samples.demo", "train, trace and diagnose a small job end to end"),
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to every option's help, except where there is no value to show (None, an
    empty list, False for a switch) or the help text already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "default" in text:
            return text
        return super()._get_help_string(action) or text


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser of `command` (its module imported); the others are listed by name and help."""
    parser = argparse.ArgumentParser(
        prog="megascope",
        description="Train, trace and diagnose 3D-parallel LLM jobs (MegaScale-style).",
        epilog="megascope COMMAND --help explains each command.")
    parser.add_argument("--version", action="version", version=f"megascope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except BrokenPipeError:
        # the reader went away (`megascope analyze RUN | head`): stop quietly, and point stdout at
        # /dev/null so the interpreter's last flush does not raise again (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"megascope {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
