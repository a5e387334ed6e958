"""Scale benchmark: a simulated 12,288-rank x 100-step trace analyzed end to end (`megascope analyze
--json`, what-if replays included) in a fresh process; prints wall time and peak RSS.

    python benchmarks/analyzer_scale.py [--dp 192 --tp 8 --pp 8 --steps 100] [--out /tmp/megascope-scale]
                                        [--phases] [--engines]
                                        [--edge [--edge-out /tmp/megascope-scale-edge] [--edge-steps 1000]
                                                [--tile 10:29] [--rebuild-edge]]

Targets: under 60 s and 4 GB on the 2-core dev machine. The wall time depends on
what else runs on the machine: the table gives the load average and the process's CPU seconds (user +
sys, all threads) next to it. `--phases` also runs the same analysis through the Python API in a second
fresh process, timing each phase (wall and CPU seconds): open, event pass, late arrivals, each detector,
hang check, what-if replays, and the rest of the report. `--engines` also analyzes the run with
`--engine ray` on a local Ray cluster started for it (`ray start --head` on 127.0.0.1) with 1 and then 2
worker CPUs (one event-pass batch per task, one DuckDB thread per task), and compares the wall time,
the driver's CPU seconds and peak RSS, and the findings with the local engine's (the workers' CPU is
not the driver's: Ray runs them under its own daemon).

`--edge` adds the summaries-at-the-edge cases (issue 18's target: 12,288 ranks x 1,000 steps in under 60 s
and 4 GB), built once under --edge-out and reused while its build.json matches (--rebuild-edge: again):
  summarized/  run.json and the events, steps, gpu and kernels folders of --out hardlinked (cp -al, no
               data copied), then tracer.edge_summary.summarize_run (the timeline pass, 256 ranks a
               batch): the edge tables of every rank-step, as the ranks' tracers would have written them;
  tiled/       summarized/ hardlinked, then extended to --edge-steps steps: the real steps keep their
               events (the findings and the what-if windows lie there); the steps after them have no
               events, only copies of the --tile stretch of the edge_rank_step, edge_peer_step,
               edge_collectives and steps rows (default 10-29: before the late launch (from 30) and
               the straggler (from 40); it holds two flaps of the p2p link 777-2313, down in steps
               10-12 and 20-22, which recur every 10 steps, so the copies keep the flap's period and
               phase through the last step): steps renumbered, start_ns/end_ns shifted by one global
               offset per tile (collective members stay aligned; at a tile boundary a rank may get some
               ms between two steps, the spread of the ranks' step starts, never an overlap),
               collective seq + 1,000,000 per tile; one more segment per rank and table
               (ParquetSegmentSink: numbering continues): two per rank and table, as the tracer
               writes its summaries (tracer/edge_summary.py SEGMENT_STEPS: one segment per 1,000
               steps and one at close).
It prints the build times, the edge tables' rows and size on disk, `megascope analyze --json` on the raw
run, on summarized/ and on tiled/ side by side (findings compared with the raw run's verdict by verdict;
the reports are kept as --edge-out/report-*.json), and with --phases the phase table of each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
             "sys.argv = ['megascope'] + sys.argv[1:]; "
             "runpy.run_module('megascope', run_name='__main__', alter_sys=True)")
"""`python -m megascope ...` that prints its own peak RSS last on stderr (RUSAGE_CHILDREN keeps the
largest child's so far, not each one's). alter_sys: a `__main__` without `__file__` (`python -c`) looks
interactive to DuckDB, which then draws its progress bar on stdout, into the JSON report."""


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
    try:
        report = json.loads(res.stdout) if res.returncode == 0 else None
    except ValueError as exc:  # something else on stdout: say what, as a failed analysis
        report, res.stderr = None, f"{res.stderr}\nstdout is not one JSON report ({exc}): {res.stdout[:300]!r}"
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
    """Per-phase (wall s, CPU s) of build_report(run) on a fresh Run (called in a child process)."""
    from megascope.analyzer import Run, build_report

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
    timed("event pass", run.derived.rank_step)()
    timed("late arrivals", run.derived.late_arrivals)()
    for det in run.detectors:
        det.detect = timed(f"detect: {type(det).__name__}", det.detect)
    run.hang = timed("hang check", run.hang)
    run.what_if = timed("what-if", run.what_if)
    timed("report", build_report)(run)
    rest = out.pop("report")
    before = ("open", "event pass", "late arrivals")  # timed before the report, outside it
    inner = [sum(v[i] for k, v in out.items() if k not in before) for i in (0, 1)]
    out["report (the rest)"] = [rest[0] - inner[0], rest[1] - inner[1]]
    out["total"] = [time.perf_counter() - w0, cpu() - c0]
    out["peak RSS (MiB)"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0.0]
    return {k: (round(v[0], 2), round(v[1], 2)) for k, v in out.items()}


# ---- summaries at the edge: the 12,288 x 100 run summarized, then tiled to 1,000 steps -------------------

EDGE_TABLES = ("edge_rank_step", "edge_peer_step", "edge_collectives")
TILE_WRITE_ORDER = ("edge_peer_step", "edge_collectives", "steps", "edge_rank_step")
"""edge_rank_step last, as the tracer writes it (its rows say a rank-step's summary is complete)."""
SEQ_PER_TILE = 1_000_000
"""Added to a tiled collective's `seq` per tile: above any real seq, so (group, instance, seq) stays unique."""
TILE_BATCH_RANKS = 512
"""Ranks per tiling batch (~8 M edge_collectives rows in memory)."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ranks(run: Path) -> list[int]:
    return sorted(int(p.name.split("=")[1]) for p in (run / "steps").glob("rank=*"))


def _link_copy(src: Path, dst: Path, tables: tuple[str, ...]) -> None:
    """dst = src's run.json (copied) and tables (hardlinked: cp -al, no data copied)."""
    dst.mkdir(parents=True)
    shutil.copy2(src / "run.json", dst / "run.json")
    for table in tables:
        if (src / table).is_dir():
            subprocess.run(["cp", "-al", str(src / table), str(dst / table)], check=True)


def _table_stats(run: Path, tables: tuple[str, ...]) -> dict[str, tuple[int, int, int]]:
    """table -> (rows, bytes on disk, files), rows from the Parquet footers."""
    import duckdb
    con = duckdb.connect()
    out = {}
    for table in tables:
        files = [e.path for d in os.scandir(run / table) if d.is_dir() for e in os.scandir(d.path)
                 if e.name.endswith(".parquet")]
        rows = con.execute("SELECT coalesce(sum(num_rows), 0) FROM parquet_file_metadata($files)",
                           {"files": files}).fetchone()[0] if files else 0
        out[table] = (int(rows), sum(os.stat(f).st_size for f in files), len(files))
    con.close()
    return out


def _tile_shifts(run: Path, lo: int, hi: int, last: int) -> tuple[int, int]:
    """(shift of the first tile, tile period) in ns, global (every rank shifted alike, so collective
    members stay aligned): the first tile's step lo starts where the real run's step `last` ended, and
    each tile starts where the previous one's stretch ended; the largest over ranks, so no rank's
    steps overlap (a rank's steps may have a few ms between them at a tile boundary instead)."""
    import duckdb
    con = duckdb.connect()
    files = [str(f) for f in run.glob("steps/rank=*/*.parquet")]
    first, period = con.execute(
        "SELECT max(e_last - s_lo), max(s_hi - s_lo) FROM (SELECT rank, "
        "min(start_ns) FILTER (WHERE step = $lo) AS s_lo, min(start_ns) FILTER (WHERE step = $hi + 1) AS s_hi, "
        "max(end_ns) FILTER (WHERE step = $last) AS e_last FROM read_parquet($files, hive_partitioning=false) "
        "WHERE step IN ($lo, $hi + 1, $last) GROUP BY rank)", {"lo": lo, "hi": hi, "last": last, "files": files}
    ).fetchone()
    con.close()
    return int(first), int(period)


def tile(run: Path, lo: int, hi: int, total_steps: int, progress=None) -> dict[str, int]:
    """Extend `run` (with edge tables covering steps 0..last) to `total_steps` steps: copies of the
    stretch lo..hi of the edge tables' and the steps table's rows, steps renumbered from last + 1,
    times shifted (_tile_shifts), collective seq + SEQ_PER_TILE per tile; one extra segment per rank
    and table (tracer/sink.py ParquetSegmentSink, numbering continues). Returns rows written per table."""
    import duckdb
    import numpy as np
    import pyarrow.compute as pc

    from megascope.tracer.schema import TABLES
    from megascope.tracer.sink import ParquetSegmentSink

    con = duckdb.connect()
    last = con.execute("SELECT max(step) FROM read_parquet($f, hive_partitioning=false)",
                       {"f": [str(f) for f in run.glob("edge_rank_step/rank=*/*.parquet")]}).fetchall()[0][0]
    span = hi - lo + 1
    n_tiles = -(-(total_steps - last - 1) // span)
    shift0, period = _tile_shifts(run, lo, hi, last)
    ranks = _ranks(run)
    written = dict.fromkeys(TILE_WRITE_ORDER, 0)
    params = {"lo": lo, "hi": hi, "tiles": n_tiles, "first": last + 1, "span": span, "total": total_steps,
              "shift0": shift0, "period": period, "seq_tile": SEQ_PER_TILE}
    quote = '"'
    exprs = {"step": "s.step - $lo + $first + t.k * $span",
             "start_ns": "s.start_ns + $shift0 + t.k * $period", "end_ns": "s.end_ns + $shift0 + t.k * $period",
             "seq": "s.seq + (t.k + 1) * $seq_tile"}
    for begin in range(0, len(ranks), TILE_BATCH_RANKS):
        batch = ranks[begin:begin + TILE_BATCH_RANKS]
        sinks = {r: ParquetSegmentSink(run, r) for r in batch}
        for table in TILE_WRITE_ORDER:
            schema = TABLES[table]
            files = [str(f) for r in batch for f in sorted((run / table / f"rank={r:05d}").glob("seg-*.parquet"))]
            cols = ", ".join(f'{exprs.get(f.name, f"s.{quote}{f.name}{quote}")} AS "{f.name}"' for f in schema)
            order = {"edge_collectives": "rank, step, start_ns", "edge_peer_step": "rank, step, peer"}.get(
                table, "rank, step")
            sql = (f"SELECT {cols} FROM read_parquet($files, hive_partitioning=false) s, "
                   "(SELECT range AS k FROM range($tiles)) t WHERE s.step BETWEEN $lo AND $hi "
                   f"AND s.step - $lo + $first + t.k * $span < $total ORDER BY {order}")
            bound = {**params, "files": files}
            rows = con.sql(sql, params={k: bound[k] for k in set(re.findall(r"\$(\w+)", sql))}).to_arrow_table()
            rows = rows.cast(schema)
            if table == "edge_collectives" and rows.num_rows:
                assert pc.max(rows["seq"]).as_py() < (n_tiles + 1) * SEQ_PER_TILE
            bounds = np.searchsorted(rows["rank"].to_numpy(), np.asarray(batch + [1 << 30]), side="left")
            for i, rank in enumerate(batch):
                part = rows.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i]))
                if part.num_rows:
                    sinks[rank].write(table, part)
            written[table] += rows.num_rows
        if progress is not None:
            progress(min(begin + TILE_BATCH_RANKS, len(ranks)), len(ranks))
    con.close()
    return {**written, "tiles": n_tiles, "shift0_ns": shift0, "period_ns": period, "last_real_step": last}


def build_edge(src: Path, out: Path, total_steps: int, lo: int, hi: int, rebuild: bool) -> dict:
    """The edge cases, built once: out/summarized (src's events and steps hardlinked, then summarize_run;
    out/summarized.json, written when done, keeps it through a rebuild of the tiles) and out/tiled
    (summarized hardlinked, then tiled to `total_steps`; out/build.json, written last). A stage without
    its file (an interrupted build) is built again."""
    from megascope.tracer.edge_summary import summarize_run

    marker, first = out / "build.json", out / "summarized.json"
    if marker.exists() and not rebuild:
        info = json.loads(marker.read_text())
        if info["total_steps"] == total_steps and info["stretch"] == [lo, hi]:
            return info
    short, long = out / "summarized", out / "tiled"
    if rebuild or not first.exists():
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        _link_copy(src, short, ("events", "steps", "gpu", "kernels"))
        link_s = time.perf_counter() - t
        t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        n = summarize_run(short, batch_ranks=256, progress=lambda d, n_: _say(
            f"  summarize_run: {d:,}/{n_:,} ranks, {time.perf_counter() - t:,.0f} s"))
        c2 = resource.getrusage(resource.RUSAGE_SELF)
        base = {"ranks": n, "link_s": round(link_s, 1), "summarize_s": round(time.perf_counter() - t, 1),
                "summarize_cpu_s": round((c2.ru_utime + c2.ru_stime) - (c.ru_utime + c.ru_stime), 1),
                "stats": {"summarized": _table_stats(short, EDGE_TABLES)}}
        first.write_text(json.dumps(base, indent=2))
        _say(f"  summarize_run: {n:,} ranks in {base['summarize_s']:,.0f} s")
    base = json.loads(first.read_text())
    marker.unlink(missing_ok=True)
    shutil.rmtree(long, ignore_errors=True)
    _link_copy(short, long, ("events", "steps", "gpu", "kernels", *EDGE_TABLES))
    t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    tiled = tile(long, lo, hi, total_steps, lambda d, n_: _say(
        f"  tiling: {d:,}/{n_:,} ranks, {time.perf_counter() - t:,.0f} s"))
    c2 = resource.getrusage(resource.RUSAGE_SELF)
    info = {**base, "total_steps": total_steps, "stretch": [lo, hi], "tile_s": round(time.perf_counter() - t, 1),
            "tile_cpu_s": round((c2.ru_utime + c2.ru_stime) - (c.ru_utime + c.ru_stime), 1), "tiled": tiled}
    info["stats"]["tiled"] = _table_stats(long, (*EDGE_TABLES, "steps"))
    marker.write_text(json.dumps(info, indent=2))
    return info


def _phases_child(run: Path) -> dict[str, tuple[float, float]]:
    """phases(run) in a fresh process."""
    res = subprocess.run([sys.executable, __file__, "--child-phases", str(run)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _findings(rep: dict | None) -> str:
    if rep is None:
        return "analyze failed"
    return ", ".join(f"{f['kind']}:{f['ranks'][:2]}@{f['steps'][0]}" for f in rep["findings"]) or "none"


def _versus(findings: list[dict], raw: list[dict]) -> str:
    """How findings compare with the raw run's: same; same verdicts (kind, ranks, steps) with the fields
    whose values differ; or the verdicts that differ."""
    def verdict(f: dict) -> tuple:
        return f["kind"], tuple(f["ranks"]), f["steps"][0], f["steps"][-1]

    mine, theirs = [verdict(f) for f in findings], [verdict(f) for f in raw]
    if mine != theirs:
        return "different verdicts: " + ", ".join(
            f"{k}:{list(r[:2])} steps {a}-{b}" for k, r, a, b in mine if (k, r, a, b) not in theirs)
    diffs = []
    for mine, theirs in zip(_rounded(findings), _rounded(raw)):
        keys = [k for k in mine if k != "evidence" and mine[k] != theirs.get(k)]
        keys += [f"evidence.{k}" for k, v in mine.get("evidence", {}).items() if v != theirs.get("evidence", {}).get(k)]
        if keys:
            diffs.append(f"{mine['kind']}: {', '.join(keys)}")
    return "same" if not diffs else "same verdicts; values differ: " + "; ".join(diffs)


def edge_cases(args: argparse.Namespace, raw: tuple) -> None:
    """Build (once) and analyze the edge-summary cases; print them beside the raw 100-step case."""
    lo, hi = (int(x) for x in args.tile.split(":"))
    info = build_edge(Path(args.out), Path(args.edge_out), args.edge_steps, lo, hi, args.rebuild_edge)
    short, long = Path(args.edge_out) / "summarized", Path(args.edge_out) / "tiled"
    tiled = info["tiled"]
    real = tiled["last_real_step"] + 1
    print(f"\nEdge-summary build ({info['ranks']:,} ranks; cached in {args.edge_out}, build.json):\n")
    print("| stage | wall (s) | CPU (s) |\n|---|---|---|")
    print(f"| hardlinked copy of the raw run (cp -al) | {info['link_s']:.1f} | |")
    print(f"| summarize_run (timeline pass, 256 ranks a batch) | {info['summarize_s']:,.1f} | "
          f"{info['summarize_cpu_s']:,.1f} |")
    print(f"| tiling: steps {tiled['last_real_step'] + 1}-{args.edge_steps - 1} = {tiled['tiles']} copies of steps "
          f"{lo}-{hi} | {info['tile_s']:,.1f} | {info['tile_cpu_s']:,.1f} |")
    print(f"\n| table | rows, {real} steps | on disk | rows, {args.edge_steps:,} steps | on disk | files |")
    print("|---|---|---|---|---|---|")
    for table in (*EDGE_TABLES, "steps"):
        a = info["stats"]["summarized"].get(table)
        b = info["stats"]["tiled"][table]
        first = f"{a[0]:,} | {a[1] / 2**20:,.1f} MiB" if a else "(raw run's) | "
        print(f"| {table} | {first} | {b[0]:,} | {b[1] / 2**20:,.1f} MiB | {b[2]:,} |")
    cases = [(f"raw events, {real} steps", Path(args.out), raw)]
    for label, run in ((f"edge tables, {real} steps", short), (f"edge tables, {args.edge_steps:,} steps", long)):
        load = os.getloadavg()[0]
        wall, cpu, rss, rep, err = _analyze(run, [])
        if rep is None:
            _say(f"analyze {run} failed:\n{err[-3000:]}")
        cases.append((label, run, (wall, cpu, rss, rep, max(load, os.getloadavg()[0]))))
    raw_findings = raw[3]["findings"] if raw[3] else []
    print("\nEnd to end (`megascope analyze --json`, fresh process, no persisted summary; "
          "target < 60 s, < 4,096 MiB):\n")
    print("| case | wall (s) | CPU (s) | peak RSS (MiB) | load avg | findings | vs raw |")
    print("|---|---|---|---|---|---|---|")
    for label, _, (wall, cpu, rss, rep, load) in cases:
        same = "-" if label.startswith("raw") else "failed" if rep is None else \
            _versus(rep["findings"], raw_findings)
        if rep is not None:  # kept for a closer look (the findings' evidence)
            (Path(args.edge_out) / f"report-{label.split()[0]}-{label.split()[-2].replace(',', '')}.json").write_text(
                json.dumps(rep, indent=1))
        print(f"| {label} | {wall:.1f} | {cpu:.1f} | {rss:,.0f} | {load:.1f} | {_findings(rep)} | {same} |")
    if args.phases:
        results = [(label, _phases_child(run)) for label, run, _ in cases]
        names = list(dict.fromkeys(k for _, r in results for k in r))
        print("\nPhases (Python API, fresh process each; wall / CPU s):\n")
        print("| phase | " + " | ".join(label for label, _ in results) + " |\n|---" * 1 + "|---" * len(results) + "|")
        for name in names:
            cells = []
            for _, r in results:
                w, c = r.get(name, (float("nan"), 0.0))
                cells.append(f"{w:,.0f}" if "MiB" in name else f"{w:,.1f} / {c:,.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |")


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
    ap.add_argument("--edge", action="store_true",
                    help="also build (once) and analyze the summaries-at-the-edge cases (100 and --edge-steps steps)")
    ap.add_argument("--edge-out", default="/tmp/megascope-scale-edge")
    ap.add_argument("--edge-steps", type=int, default=1000)
    ap.add_argument("--tile", default="10:29", help="the stretch of real steps copied past the last one (lo:hi)")
    ap.add_argument("--rebuild-edge", action="store_true", help="build the edge cases again even when cached")
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
        shutil.rmtree(args.edge_out, ignore_errors=True)  # built from this run
        from megascope.samples.simulator import SimConfig, simulate
        t = time.perf_counter()
        simulate(out, SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                                inject=[f for f in FAULTS
                                        if max(int(x) for x in f.split("=")[1].split(",")[0].split("-")) < world]))
        gen_s = time.perf_counter() - t
    n_events = _events(out)
    disk = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    load = os.getloadavg()[0]
    wall, cpu, peak_mb, rep, err = _analyze(out, [])
    load = max(load, os.getloadavg()[0])
    if rep is None:
        print(err, file=sys.stderr)
        return 1
    rows = [("layout", f"dp={args.dp} tp={args.tp} pp={args.pp} ({world} ranks) x {args.steps} steps"),
            ("events", f"{n_events:,} ({disk / 2**20:,.0f} MiB of Parquet)"),
            ("simulate (s)", f"{gen_s:.1f}" if gen_s == gen_s else "cached"),
            ("analyze wall (s)", f"{wall:.1f}  (target < 60)"),
            ("analyze CPU (s)", f"{cpu:.1f}  (user + sys, all threads)"),
            ("load average (1 min, max of start/end)", f"{load:.1f} on {os.cpu_count()} cores"),
            ("analyze peak RSS (MiB)", f"{peak_mb:,.0f}  (target < 4096)"),
            ("findings", _findings(rep)),
            ("cores", str(os.cpu_count()))]
    width = max(len(k) for k, _ in rows)
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.phases and not args.edge:  # --edge prints the raw phases beside the edge cases'
        load = os.getloadavg()[0]
        result = _phases_child(out)
        load = max(load, os.getloadavg()[0])
        print(f"\nPhases (Python API, fresh process; load average {load:.1f}):\n")
        print("| phase | wall (s) | CPU (s) |\n|---|---|---|")
        for name, (w, c) in result.items():
            print(f"| {name} | {w:,.1f} | {c:,.1f} |" if "MiB" not in name else f"| {name} | {w:,.0f} | |")
    if args.edge:
        edge_cases(args, (wall, cpu, peak_mb, rep, load))
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
