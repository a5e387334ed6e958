"""`megascope dashboard RUN [RUN...] [--host 127.0.0.1] [--port 8050]`: serve the web UI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "dashboard", help="web UI over one or more run directories (live while a job runs)",
        description="Serve the megascope dashboard over the given run directories. Only these "
                    "directories are served; the browser selects among them by index.")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directory (several: compare them)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1: this machine only; "
                             "anything else exposes your traces to the network)")
    parser.add_argument("--port", type=int, default=8050, help="TCP port (default 8050)")
    parser.add_argument("--refresh", type=float, default=3.0, metavar="SECONDS",
                        help="live refresh interval in seconds (the page has a pause toggle)")
    parser.add_argument("--debug", action="store_true", help="Dash debug mode (reloader off)")
    return parser


def run(args: argparse.Namespace) -> int:
    missing = [r for r in args.runs if not (Path(r) / "run.json").is_file()]
    if missing:
        print(f"megascope dashboard: not a run directory (no run.json): {', '.join(missing)}; pass the "
              "directory given to `megascope train --run-dir` or `megascope simulate`", file=sys.stderr)
        return 2
    if args.host not in LOCAL_HOSTS:
        print(f"warning: binding {args.host}: anyone who can reach this machine on port {args.port} can "
              "read these traces (there is no authentication); use --host 127.0.0.1 and an SSH tunnel "
              "unless you mean it", file=sys.stderr)
    from megascope.dashboard.app import create_app  # Dash import is slow: only when serving

    app = create_app(args.runs, refresh_s=args.refresh)
    print(f"megascope dashboard: serving {len(args.runs)} run(s) at http://{_url_host(args.host)}:{args.port}/",
          flush=True)
    app.run(host=args.host, port=args.port, debug=args.debug, use_reloader=False)
    return 0


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
