"""`megascope watch RUN`: follow a run while it trains and report findings as they appear and end."""

from __future__ import annotations

import argparse
import sys
import urllib.parse

from megascope.analyzer.bind_address import is_loopback
from megascope.analyzer.report.analyze_cli import positive_int, settings_of
from megascope.analyzer.settings import WATCH_WINDOW, SettingsError
from megascope.cli import DefaultsHelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "watch", help="live diagnosis beside a running job: findings, webhook, Prometheus /metrics",
        formatter_class=DefaultsHelpFormatter,
        description="Follow a run directory while the job writes it: run the detectors over a sliding window of "
                    "recent steps and announce each finding once when it appears and once when it ends (stdout, "
                    "RUN/findings.jsonl, --webhook, --on-finding). Stops by itself when the run is finished "
                    "(every rank recorded run.json's last step; then it prints what `megascope analyze` finds), "
                    "after --idle-exit seconds without a new segment, or on Ctrl-C. See docs/watch.md.")
    p.add_argument("run_dir", metavar="RUN", help="run directory being written (it may not exist yet), or an "
                                                  "object-store URL (s3://bucket/prefix), followed through a local "
                                                  "mirror under $MEGASCOPE_CACHE_DIR (default ~/.cache/megascope) "
                                                  "synced every --poll")
    p.add_argument("--window", type=positive_int, default=WATCH_WINDOW, help="recent complete steps the detectors see")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help="how often to look for new segments")
    p.add_argument("--webhook", metavar="URL", help="POST each record as JSON to this http(s) URL (retried with "
                                                    "backoff on a background thread)")
    p.add_argument("--on-finding", metavar="CMD", help="run CMD (no shell) for each record: JSON on stdin, "
                                                       "MEGASCOPE_EVENT/KIND/SUMMARY in the environment")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="the watcher's HTTP port (0: any free port; default: off): Prometheus /metrics, /status "
                        "(what it follows, how far behind it is) and /settings (GET; POST JSON to change window, "
                        "webhook and detector settings while it runs; docs/watch.md)")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                   help="address of the HTTP port; any address but loopback needs --token-file")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding a secret every HTTP request must send as 'Authorization: Bearer SECRET' "
                        "(read from a file, not the command line, which other users can see)")
    p.add_argument("--idle-exit", type=float, default=None, metavar="SECONDS",
                   help="stop (with the final verdict) after this long without a new segment: for runs whose "
                        "run.json names no step count, or that hung")
    p.add_argument("--no-summary", action="store_true", help="do not extend the persisted rank-step summary "
                                                             "(the dashboard's heatmap) on each tick")
    p.add_argument("--judge-cpu", type=float, default=0.5, metavar="SECONDS",
                   help="CPU seconds per step of the job the detectors may take: the window is judged every step "
                        "while a judgement costs at most this, every few steps past it (a 12,288-rank window "
                        "takes seconds); new steps are read and summarized as they land either way")
    p.add_argument("--threads", type=positive_int, default=None, help="DuckDB threads, >= 1 (default: all cores)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="change one detector setting, as `megascope analyze --set` takes it, e.g. "
                        "--set detect.straggler.min_ratio=1.05 (repeatable; docs/config.md)")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (one line), None when they are fine."""
    if args.poll <= 0:
        return f"--poll must be > 0 seconds, got {args.poll}"
    if args.judge_cpu <= 0:
        return f"--judge-cpu must be > 0 seconds, got {args.judge_cpu}"
    if args.idle_exit is not None and args.idle_exit <= 0:
        return f"--idle-exit must be > 0 seconds, got {args.idle_exit}"
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port must be 0-65535, got {args.metrics_port}"
    if args.webhook:
        url = urllib.parse.urlparse(args.webhook)
        if url.scheme not in ("http", "https") or not url.netloc:
            return f"--webhook must be an http(s) URL, got '{args.webhook}'"
    try:
        settings_of(args.settings)
    except SettingsError as exc:
        return str(exc)
    if not is_loopback(args.bind) and not args.token_file:
        return (f"--bind {args.bind} serves the watcher's settings beyond this host: give --token-file FILE "
                "(a secret clients send as 'Authorization: Bearer SECRET'), or keep the default 127.0.0.1")
    return None


def read_token(path: str | None) -> str | None:
    """The secret in --token-file (stripped); ValueError (one line) when it cannot be read or is empty."""
    if path is None:
        return None
    try:
        token = open(path, encoding="utf-8").read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--token-file {path}: cannot read it ({exc})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: expected one secret without spaces, e.g. from "
                         "`python -c 'import secrets; print(secrets.token_urlsafe())'`")
    return token


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megascope.analyzer.data.remote_run import follow
    from megascope.analyzer.data.store import RunOpenError
    from megascope.analyzer.watch.watcher import WatchConfig, Watcher
    from megascope.tracer.storage import is_url
    problem, token = check_args(args), None
    try:
        token = read_token(args.token_file)
    except ValueError as exc:
        problem = problem or str(exc)
    path, follower = Path(args.run_dir), None
    if problem is None and is_url(args.run_dir):  # a URL: watch its local mirror, synced every --poll
        try:
            path, follower = follow(args.run_dir, args.poll, require_run=False)
        except RunOpenError as exc:
            problem = str(exc)
    if problem is None and path.exists() and not path.is_dir():
        problem = f"{path} is a file, not a run directory"
    if problem is None and not path.parent.is_dir():
        problem = f"{path.parent} does not exist; pass the run directory the job writes (its --run-dir)"
    if problem:
        print(f"megascope watch: {problem}", file=sys.stderr)
        if follower is not None:
            follower.stop()
        return 2
    cfg = WatchConfig(window=args.window, poll_s=args.poll, webhook=args.webhook, on_finding=args.on_finding,
                      metrics_port=args.metrics_port, idle_exit_s=args.idle_exit, summary=not args.no_summary,
                      threads=args.threads, judge_cpu_s=args.judge_cpu, settings=settings_of(args.settings),
                      bind=args.bind, token=token,
                      follows=args.run_dir if follower is not None else None)
    try:
        watcher = Watcher(path, cfg)
    except OSError as exc:
        print(f"megascope watch: {exc}", file=sys.stderr)
        return 2
    try:
        return watcher.run()
    except RunOpenError as exc:
        print(f"megascope watch: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"megascope watch: {exc}", file=sys.stderr)
        return 1
    finally:
        if follower is not None:
            follower.stop()
