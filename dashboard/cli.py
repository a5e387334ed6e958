"""`megascope dashboard RUN [RUN...] [--host 127.0.0.1] [--port 8050] [--token T]`: serve the web UI.

Served by waitress (a production WSGI server). Beyond loopback every request needs a token
(dashboard/auth.py): the one given by --token or $MEGASCOPE_DASHBOARD_TOKEN, else a fresh one printed
in the URL at start.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path

from megascope.analyzer.bind_address import is_loopback
from megascope.cli import DefaultsHelpFormatter
from megascope.dashboard.auth import ENV_VAR, choose_token

TOKEN_RE = re.compile(r"^[A-Za-z0-9._~-]{16,}$")
"""A given token: long enough not to be guessed, and safe in a URL and a cookie as it is."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "dashboard", help="web UI over one or more run directories (live while a job runs)",
        formatter_class=DefaultsHelpFormatter,
        description="Serve the megascope dashboard over the given run directories. Only these "
                    "directories are served; the browser selects among them by index. Beyond loopback "
                    "every request needs a token (printed in the URL at start, or given by --token / "
                    f"${ENV_VAR}).")
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run directory (several: compare them), or an object-store URL (s3://bucket/prefix) "
                             "served from a local mirror under $MEGASCOPE_CACHE_DIR (default ~/.cache/megascope) "
                             "synced every --refresh")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind; 127.0.0.1 is this machine only, anything else exposes "
                             "the traces to the network (behind a token)")
    parser.add_argument("--port", type=int, default=8050, help="TCP port")
    parser.add_argument("--token", default=None,
                        help=f"access token (16+ characters of A-Z a-z 0-9 . _ ~ -) required on every request, "
                             f"also on loopback; default: ${ENV_VAR}, else generated when --host is not "
                             "loopback (the environment variable keeps it out of the process list)")
    parser.add_argument("--refresh", type=float, default=3.0, metavar="SECONDS",
                        help="live refresh interval in seconds (the page has a pause toggle)")
    parser.add_argument("--debug", action="store_true",
                        help="Dash debug mode on Flask's development server (loopback only)")
    return parser


def run(args: argparse.Namespace) -> int:
    from megascope.analyzer.data.remote_run import follow_all
    from megascope.analyzer.data.store import RunOpenError

    try:  # object-store runs: served from local mirrors kept in sync while the server runs
        args.runs, followers = follow_all(args.runs, args.refresh)
    except RunOpenError as exc:
        print(f"megascope dashboard: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args)
    finally:
        for follower in followers:
            follower.stop()


def _serve(args: argparse.Namespace) -> int:
    problem = _argument_problem(args)
    if problem:
        print(f"megascope dashboard: {problem}", file=sys.stderr)
        return 2
    from megascope.dashboard.serving import port_problem

    problem = port_problem(args.host, args.port)  # before the slow Dash import and any "serving" line
    if problem:
        print(f"megascope dashboard: {problem}", file=sys.stderr)
        return 2
    token, generated = choose_token(args.host, args.token or os.environ.get(ENV_VAR) or None)
    from megascope.dashboard.app import create_app  # Dash import is slow: only when serving
    from megascope.dashboard.serving import production_server

    app = create_app(args.runs, refresh_s=args.refresh, token=token)
    url = f"http://{_url_host(args.host)}:{args.port}/"
    if args.debug:  # Werkzeug's development server, with Dash's dev tools; loopback only (checked above)
        print(f"megascope dashboard: serving {len(args.runs)} run(s) at {url} (debug)", flush=True)
        app.run(host=args.host, port=args.port, debug=True, use_reloader=False)
        return 0
    try:
        server = production_server(app, args.host, args.port)
    except OSError as exc:  # taken between the check and now
        print(f"megascope dashboard: cannot listen on {args.host}:{args.port} ({exc.strerror}); "
              "pass another --port", file=sys.stderr)
        return 2
    access = f"{url}?token={token}" if generated else url
    note = " (token required: the one you gave)" if token and not generated else ""
    # started in the background by a script (`cmd &` without job control, nohup), the process inherits
    # SIGINT ignored and Python then never raises KeyboardInterrupt: Ctrl-C or a supervisor's SIGINT
    # would not stop it (seen in a CI run started that way)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # from the first line on, Ctrl-C stops it quietly
        print(f"megascope dashboard: serving {len(args.runs)} run(s) at {access}{note}", flush=True)
        if not is_loopback(args.host):
            print(f"megascope dashboard: {args.host} is reachable from the network: anyone with the token can "
                  "read these traces, over plain HTTP (use an SSH tunnel or a TLS proxy on networks you do not "
                  "trust)", file=sys.stderr)
        server.run()  # returns on Ctrl-C (waitress catches KeyboardInterrupt)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print("\nmegascope dashboard: stopped", flush=True)
    return 0


def _argument_problem(args: argparse.Namespace) -> str | None:
    from megascope.analyzer import MANIFEST  # here: `megascope dashboard --help` stays quick

    missing = [r for r in args.runs if not (Path(r) / MANIFEST).is_file()]
    if missing:
        return (f"not a run directory (no run.json): {', '.join(missing)}; pass the directory given to "
                "`megascope train --run-dir` or `megascope simulate`")
    given = args.token or os.environ.get(ENV_VAR)
    if given and not TOKEN_RE.match(given):
        source = "--token" if args.token else f"${ENV_VAR}"
        return f"{source} must be 16 or more characters of A-Z a-z 0-9 . _ ~ - (it goes into a URL and a cookie)"
    if args.debug and not is_loopback(args.host):
        return ("--debug runs Flask's development server with its debugger: loopback only; "
                "drop --debug or use --host 127.0.0.1")
    if not 0 < args.refresh < float("inf"):
        return f"--refresh must be > 0 seconds, got {args.refresh}"
    return None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
