"""The `megascope` console script: a dispatcher; each subcommand lives in the package it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "train": "megascope.trainer.cli",
    "demo": "megascope.samples.demo",
    "analyze": "megascope.analyzer.cli",
    "export": "megascope.analyzer.export_cli",
    "dashboard": "megascope.dashboard.cli",
    "simulate": "megascope.samples.simulate_cli",
    "import": "megascope.tracer.importers.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megascope",
        description="Train, trace and diagnose 3D-parallel LLM jobs (MegaScale-style).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real missing dependency, not an unbuilt subcommand
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args.command]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
