"""Scale benchmark: a simulated 12,288-rank x 100-step trace analyzed end to end (`megascope analyze
--json`, what-if replays included) in a fresh process; prints wall time and peak RSS.

    python benchmarks/analyzer_scale.py [--dp 192 --tp 8 --pp 8 --steps 100] [--out /tmp/megascope-scale]
                                        [--phases] [--engines]

Targets (DESIGN.md section 6): under 60 s and 4 GB on the 2-core dev machine. The wall time depends on
what else runs on the machine: the table gives the load average and the process's CPU seconds (user +
sys, all threads) next to it. `--phases` also runs the same analysis through the Python API in a second
fresh process, timing each phase (wall and CPU seconds): open, event pass, late arrivals, each detector,
hang check, what-if replays, and the rest of the report. `--engines` also analyzes the run with
`--engine ray` on a local Ray cluster started for it (`ray start --head` on 127.0.0.1) with 1 and then 2
worker CPUs (one event-pass batch per task, one DuckDB thread per task), and compares the wall time,
the driver's CPU seconds and peak RSS, and the findings with the local engine's (the workers' CPU is
not the driver's: Ray runs them under its own daemon).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAULTS = ["straggler:rank=1000,slowdown=0.1,from=40", "late_launch:rank=5000,ms=20,every=3,from=30",
          "flap:ranks=777-2313,down_ms=10,period_steps=10"]


def _events(out: Path) -> int:
    import duckdb
    con = duckdb.connect()
    sql = f"SELECT count(*) FROM read_parquet('{out}/events/rank=*/*.parquet', hive_partitioning=false)"
    return con.execute(sql).fetchone()[0]


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_WITH_RSS = ("import atexit, resource, runpy, sys; atexit.register(lambda: sys.stderr.write("
             "'\\nMAXRSS_KB %d\\n' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)); "
             "sys.argv = ['megascope'] + sys.argv[1:]; runpy.run_module('megascope', run_name='__main__')")
"""`python -m megascope ...` that prints its own peak RSS last on stderr (RUSAGE_CHILDREN keeps the
largest child's so far, not each one's)."""


def _analyze(out: Path, extra: list[str], env: dict | None = None) -> tuple[float, float, float, dict | None, str]:
    """One `megascope analyze --json` in a fresh process, without a persisted summary: (wall s, CPU s of
    the process, its peak RSS MiB, the report or None, stderr)."""
    shutil.rmtree(out / "analysis", ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _WITH_RSS, "analyze", str(out), "--json", *extra],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    report = json.loads(res.stdout) if res.returncode == 0 else None
    rss = [line for line in res.stderr.splitlines() if line.startswith("MAXRSS_KB ")]
    return wall, cpu, int(rss[-1].split()[1]) / 1024 if rss else float("nan"), report, res.stderr


def _rounded(value):
    """Floats to 9 significant digits (sums merged in another order may differ in the last bits)."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def engines(out: Path) -> list[tuple[str, str, str, str, str]]:
    """Rows (engine, wall s, driver CPU s, driver peak RSS MiB, findings vs local) for the local engine
    and Ray with 1 and 2 worker CPUs on a local cluster (127.0.0.1)."""
    ray = str(Path(sys.executable).parent / "ray")
    if not Path(ray).exists():
        return [("ray", "-", "-", "-", "Ray is not installed (pip install 'megascope[ray]')")]
    # single-machine mode: every Ray process binds 127.0.0.1; the cluster checks a token of its own
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32))
    wall, cpu, rss, local, err = _analyze(out, [], env)
    if local is None:
        raise SystemExit(err)
    rows = [("local (DuckDB, all cores)", f"{wall:.1f}", f"{cpu:.1f}", f"{rss:,.0f}", "-")]
    for workers in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        try:
            subprocess.run([ray, "start", "--head", "--num-cpus", str(workers), "--port", str(port),
                            "--node-ip-address", "127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                            "--temp-dir", temp], check=True, capture_output=True, env=env)
            wall, cpu, rss, report, err = _analyze(out, ["--engine", "ray", "--address", f"127.0.0.1:{port}"], env)
        finally:
            subprocess.run([ray, "stop"], capture_output=True, env=env)
            shutil.rmtree(temp, ignore_errors=True)
        same = "analyze failed: " + err.strip().splitlines()[-1][:120] if report is None else \
            ("same" if _rounded(report["findings"]) == _rounded(local["findings"]) else "DIFFERENT")
        rows.append((f"ray, {workers} worker CPU{'s' if workers > 1 else ''}", f"{wall:.1f}", f"{cpu:.1f}",
                     f"{rss:,.0f}", same))
    return rows


def phases(run_dir: str) -> dict[str, tuple[float, float]]:
    """Per-phase (wall s, CPU s) of Run.report() on a fresh Run (called in a child process)."""
    from megascope.analyzer.run import Run

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            w, c = time.perf_counter(), cpu()
            try:
                return fn(*a, **k)
            finally:
                acc = out.setdefault(name, [0.0, 0.0])
                acc[0] += time.perf_counter() - w
                acc[1] += cpu() - c
        return wrapper

    w0, c0 = time.perf_counter(), cpu()
    run = timed("open", Run.open)(run_dir)
    timed("event pass", run._ensure)("rank_step")
    timed("late arrivals", run._ensure)("collectives")
    for det in run.detectors:
        det.detect = timed(f"detect: {type(det).__name__}", det.detect)
    run.hang = timed("hang check", run.hang)
    run.what_if = timed("what-if", run.what_if)
    timed("report", run.report)()
    rest = out.pop("report")
    before = ("open", "event pass", "late arrivals")  # timed before the report, outside it
    inner = [sum(v[i] for k, v in out.items() if k not in before) for i in (0, 1)]
    out["report (the rest)"] = [rest[0] - inner[0], rest[1] - inner[1]]
    out["total"] = [time.perf_counter() - w0, cpu() - c0]
    out["peak RSS (MiB)"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0.0]
    return {k: (round(v[0], 2), round(v[1], 2)) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=192)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="/tmp/megascope-scale")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--phases", action="store_true", help="also time each phase (a second analysis)")
    ap.add_argument("--engines", action="store_true",
                    help="also compare the local engine with --engine ray on 1 and 2 worker CPUs")
    ap.add_argument("--child-phases", metavar="RUN", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_phases:
        print(json.dumps(phases(args.child_phases)))
        return 0
    out = Path(args.out)
    world = args.dp * args.tp * args.pp
    gen_s = float("nan")
    if args.regenerate or not (out / "run.json").exists() or \
            json.loads((out / "run.json").read_text())["topology"]["world"] != world:
        shutil.rmtree(out, ignore_errors=True)
        from megascope.samples.simulator import SimConfig, simulate
        t = time.perf_counter()
        simulate(out, SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                                inject=[f for f in FAULTS
                                        if max(int(x) for x in f.split("=")[1].split(",")[0].split("-")) < world]))
        gen_s = time.perf_counter() - t
    n_events = _events(out)
    disk = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    load = os.getloadavg()[0]
    t, cpu = time.perf_counter(), _cpu_children()
    res = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(out), "--json"],
                         capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, _cpu_children() - cpu
    load = max(load, os.getloadavg()[0])
    if res.returncode:
        print(res.stderr, file=sys.stderr)
        return 1
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rep = json.loads(res.stdout)
    rows = [("layout", f"dp={args.dp} tp={args.tp} pp={args.pp} ({world} ranks) x {args.steps} steps"),
            ("events", f"{n_events:,} ({disk / 2**20:,.0f} MiB of Parquet)"),
            ("simulate (s)", f"{gen_s:.1f}" if gen_s == gen_s else "cached"),
            ("analyze wall (s)", f"{wall:.1f}  (target < 60)"),
            ("analyze CPU (s)", f"{cpu:.1f}  (user + sys, all threads)"),
            ("load average (1 min, max of start/end)", f"{load:.1f} on {os.cpu_count()} cores"),
            ("analyze peak RSS (MiB)", f"{peak_mb:,.0f}  (target < 4096)"),
            ("findings", ", ".join(f"{f['kind']}:{f['ranks'][:2]}@{f['steps'][0]}" for f in rep["findings"]) or "none"),
            ("cores", str(os.cpu_count()))]
    width = max(len(k) for k, _ in rows)
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.phases:
        load = os.getloadavg()[0]
        res = subprocess.run([sys.executable, __file__, "--child-phases", str(out)], capture_output=True, text=True)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return 1
        load = max(load, os.getloadavg()[0])
        print(f"\nPhases (Python API, fresh process; load average {load:.1f}):\n")
        print("| phase | wall (s) | CPU (s) |\n|---|---|---|")
        for name, (w, c) in json.loads(res.stdout.strip().splitlines()[-1]).items():
            print(f"| {name} | {w:,.1f} | {c:,.1f} |" if "MiB" not in name else f"| {name} | {w:,.0f} | |")
    if args.engines:
        load = os.getloadavg()[0]
        rows = engines(out)
        load = max(load, os.getloadavg()[0])
        print("\nEngines (`megascope analyze --json`, fresh processes, no persisted summary; "
              f"load average {load:.1f}):\n")
        print("| engine | wall (s) | driver CPU (s) | driver peak RSS (MiB) | findings vs local |")
        print("|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
