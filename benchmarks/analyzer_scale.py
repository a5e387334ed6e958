"""Scale benchmark: a simulated 12,288-rank x 100-step trace analyzed end to end (`megascope analyze
--json`, what-if replays included) in a fresh process, beside a plain DuckDB scan of the same files
(count and sum of one column of every events and steps segment, fresh process, all cores) and a full read
(every column of the same files decoded: what reading the data once costs); prints wall time, CPU
seconds, peak RSS and the ratios to the scan and the full read.

    python benchmarks/analyzer_scale.py [--dp 192 --tp 8 --pp 8 --steps 100] [--out /tmp/megascope-scale]
                                        [--phases] [--engines [--ray-workers 2]]
                                        [--edge [--edge-out /tmp/megascope-scale-edge] [--edge-steps 1000]
                                                [--edge-summarized] [--rebuild-edge]]

Targets (issue 28): the 100-step raw analysis at most 3x its plain scan; the 1,000-step edge case under
30 s and 3 GB. The wall time depends on what else runs on the 2-core machine: the tables give the load
average and each process's CPU seconds (user + sys, all threads) next to it; compare ratios from one run.
`--phases` also runs each analysis through the Python API in a second fresh process, timing each phase
(wall and CPU seconds): open, event pass (and its DuckDB statements by the table each makes: reading and
aggregating per derived table), late arrivals, each detector, hang check, what-if replays, and the rest of
the report.

`--edge` adds the summaries-at-the-edge case: a --edge-steps job of the same layout written by
samples/edge_gen.py (a streaming generator of the tables each rank's tracer would write: edge_rank_step,
edge_peer_step, edge_collectives and steps, 256 ranks a batch; its faults at known ranks and steps:
a 1.3x straggler on rank 1000 from step 400, a 60 ms late launch on rank 5000 every 2nd step from 300,
the p2p link 777-2313 10 ms slower per transfer on 3 of every 10 steps from step 100), built once under
--edge-out/generated and reused while generated.json matches; the table says whether the verdict names
each fault from its onset, and the scan is of its three edge tables. `--edge-summarized` also analyzes
the raw run summarized post hoc (tracer.edge_summary.summarize_run, built once: minutes), its verdict
compared with the raw run's. `--engines` compares `--engine ray` on a local Ray cluster started for it
(`ray start --head` on 127.0.0.1, --ray-workers worker CPUs; one batch of ranks per task, one DuckDB
thread per task) with the local engine, on the generated case with --edge (each task reads its batch's
summaries) or else on the raw run (each task its batch's events): wall time, the driver's CPU seconds
and peak RSS, and the findings against the local engine's (the workers' CPU is not the driver's: Ray
runs them under its own daemon).
"""

from __future__ import annotations

import argparse
import functools
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


def engines(out: Path, workers_tried: list[int]) -> list[tuple[str, str, str, str, str]]:
    """Rows (engine, wall s, driver CPU s, driver peak RSS MiB, findings vs local) for the local engine
    and Ray with each of `workers_tried` worker CPUs on a local cluster (127.0.0.1)."""
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
    for workers in workers_tried:
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


class StatementTimer:
    """A DuckDB connection that adds each statement's wall and CPU seconds to `out` under "  event pass:
    <the table it makes>" (CREATE ... TABLE x / INSERT INTO x; "(other)" else): where the event pass's
    time goes, reading vs aggregating, per derived table."""

    def __init__(self, con, cpu, out: dict[str, list[float]]) -> None:
        self.con, self._cpu, self._out = con, cpu, out

    def execute(self, sql: str, *args, **kwargs):
        words = sql.split()
        upper = [w.upper() for w in words]
        name = "(other)"
        for marker in ("TABLE", "INTO"):
            if marker in upper[:6] and not upper[0].startswith(("DROP", "ALTER")):
                name = words[upper.index(marker) + 1]
                break
        w, c = time.perf_counter(), self._cpu()
        try:
            return self.con.execute(sql, *args, **kwargs)
        finally:
            acc = self._out.setdefault(f"  event pass: {name}", [0.0, 0.0])
            acc[0] += time.perf_counter() - w
            acc[1] += self._cpu() - c

    def __getattr__(self, attr: str):
        return getattr(self.con, attr)


def phases(run_dir: str) -> dict[str, tuple[float, float]]:
    """Per-phase (wall s, CPU s) of build_report(run) on a fresh Run (called in a child process)."""
    from megascope.analyzer import Run, build_report
    from megascope.analyzer.data import event_pass

    def cpu() -> float:  # the partials' worker processes too, once joined (at the end of the edge pass)
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    out: dict[str, list[float]] = {}

    def timed(name: str, fn):
        @functools.wraps(fn)  # the signature too: the findings pipeline reads what a detector takes
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
    store = run.store
    store.con = StatementTimer(store.con, cpu, out)  # the event pass's own split, by statement
    # the collective partials aggregated in numpy (edge_partials.py) run outside any statement: here the
    # wait for the worker processes' tables (partials_ahead.py; their CPU is the event pass's, counted
    # when they are joined) or the work in this process
    numpy_partials = event_pass._numpy_partials
    event_pass._numpy_partials = timed("  event pass: _batch_partials (numpy)", numpy_partials)
    try:
        timed("event pass", run.derived.rank_step)()
    finally:
        store.con = store.con.con
        event_pass._numpy_partials = numpy_partials
    timed("late arrivals", run.derived.late_arrivals)()
    for det in run.detectors:
        det.detect = timed(f"detect: {type(det).__name__}", det.detect)
    run.hang = timed("hang check", run.hang)
    run.what_if = timed("what-if", run.what_if)
    timed("report", build_report)(run)
    rest = out.pop("report")
    before = ("open", "event pass", "late arrivals")  # timed before the report, outside it
    inner = [sum(v[i] for k, v in out.items() if k not in before and not k.startswith("  ")) for i in (0, 1)]
    out["report (the rest)"] = [rest[0] - inner[0], rest[1] - inner[1]]
    out["total"] = [time.perf_counter() - w0, cpu() - c0]
    out["peak RSS (MiB)"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0.0]
    split = [k for k in out if k.startswith("  ")]  # the event pass's statements, listed under it
    order = [k for k in out if k not in split]
    order[order.index("event pass") + 1:order.index("event pass") + 1] = split
    return {k: (round(out[k][0], 2), round(out[k][1], 2)) for k in order}


# ---- summaries at the edge: the 12,288 x 100 run summarized, then tiled to 1,000 steps -------------------

EDGE_TABLES = ("edge_rank_step", "edge_peer_step", "edge_collectives")


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


def build_summarized(src: Path, out: Path, rebuild: bool) -> dict:
    """out/summarized: src's events and steps hardlinked, then summarize_run (out/summarized.json,
    written when done, marks it built)."""
    from megascope.tracer.edge_summary import summarize_run

    marker, short = out / "summarized.json", out / "summarized"
    if marker.exists() and not rebuild:
        return json.loads(marker.read_text())
    shutil.rmtree(short, ignore_errors=True)
    marker.unlink(missing_ok=True)
    t = time.perf_counter()
    _link_copy(src, short, ("events", "steps", "gpu", "kernels"))
    link_s = time.perf_counter() - t
    t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    n = summarize_run(short, batch_ranks=256, progress=lambda d, n_: _say(
        f"  summarize_run: {d:,}/{n_:,} ranks, {time.perf_counter() - t:,.0f} s"))
    c2 = resource.getrusage(resource.RUSAGE_SELF)
    info = {"ranks": n, "link_s": round(link_s, 1), "build_s": round(time.perf_counter() - t, 1),
            "build_cpu_s": round((c2.ru_utime + c2.ru_stime) - (c.ru_utime + c.ru_stime), 1),
            "stats": _table_stats(short, (*EDGE_TABLES, "steps"))}
    marker.write_text(json.dumps(info, indent=2))
    return info


def build_generated(out: Path, dp: int, tp: int, pp: int, steps: int, rebuild: bool) -> dict:
    """out/generated: samples/edge_gen.py's job (its default faults) written straight as summaries at
    the edge; out/generated.json (written when done) keeps it while the layout and steps match."""
    from megascope.samples.edge_gen import EdgeGenConfig, generate

    marker, run = out / "generated.json", out / "generated"
    cfg = EdgeGenConfig(dp=dp, tp=tp, pp=pp, steps=steps)
    key = {"dp": dp, "tp": tp, "pp": pp, "steps": steps}
    if marker.exists() and not rebuild:
        info = json.loads(marker.read_text())
        if info["config"] == key:
            return info
    shutil.rmtree(run, ignore_errors=True)
    marker.unlink(missing_ok=True)
    t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    generate(run, cfg, progress=lambda what, i, n: _say(f"  edge_gen {what}: {i}/{n} batches, "
                                                         f"{time.perf_counter() - t:,.0f} s"))
    c2 = resource.getrusage(resource.RUSAGE_SELF)
    info = {"config": key, "build_s": round(time.perf_counter() - t, 1),
            "build_cpu_s": round((c2.ru_utime + c2.ru_stime) - (c.ru_utime + c.ru_stime), 1),
            "faults": [{"kind": f.kind, "ranks": f.ranks, "first": f.first} for f in cfg.faults],
            "stats": _table_stats(run, (*EDGE_TABLES, "steps"))}
    marker.write_text(json.dumps(info, indent=2))
    return info


_SCAN = {"events": "count(*), sum(end_ns - start_ns)", "steps": "count(*), sum(end_ns - start_ns)",
         "edge_rank_step": "count(*), sum(step_time_s)",
         "edge_peer_step": "count(*), sum(recv_ns)", "edge_collectives": "count(*), sum(end_ns - start_ns)"}
"""What the plain scan computes per table: a count and a sum over one column, every file read."""


FULL_READ = "min(COLUMNS(*))"
"""The full read computes this per table: every column of every file decoded (the analysis reads most of
them), not the issue's plain scan but the cost of reading the same data once."""


def plain_scan(run: Path, tables: tuple[str, ...], full: bool = False) -> tuple[float, float]:
    """(wall s, CPU s) of a plain DuckDB scan of `tables`' files (count and sum of one column each; with
    `full`, FULL_READ) in a fresh process, all cores: the floor an analysis reading the same files is
    measured against."""
    code = ("import duckdb, sys; con = duckdb.connect(); con.execute('SET enable_progress_bar=false'); "
            "[con.sql(f\"SELECT {q} FROM read_parquet('{sys.argv[1]}/{t}/rank=*/*.parquet', "
            "hive_partitioning=false)\").fetchall() for t, q in zip(sys.argv[2::2], sys.argv[3::2])]")
    args = [a for t in tables for a in (t, FULL_READ if full else _SCAN[t])]
    before = _cpu_children()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(run), *args], check=True)
    return time.perf_counter() - t, _cpu_children() - before


def _truth(rep: dict | None, faults: list[dict]) -> str:
    """Whether each injected fault is named: a finding of its kind on its rank(s) from its first step."""
    if rep is None:
        return "analyze failed"
    kinds = {"straggler": "straggler", "late_launch": "late_launch", "flap": "network_flap"}
    said = []
    for f in faults:
        hit = [g for g in rep["findings"] if g["kind"] == kinds[f["kind"]] and set(f["ranks"]) <= set(g["ranks"])]
        onset = hit[0]["steps"][0] if hit else None
        said.append(f"{f['kind']} {f['ranks']}@{f['first']}: " + ("missed" if not hit else f"named from step {onset}"))
    extra = len(rep["findings"]) - sum(1 for f in faults for g in rep["findings"]
                                       if g["kind"] == kinds[f["kind"]] and set(f["ranks"]) <= set(g["ranks"]))
    return "; ".join(said) + f"; {extra} other finding(s)"


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


def _case(label: str, run: Path, scan_tables: tuple[str, ...], extra: list[str] | None = None) -> dict:
    """One analysis (fresh process) and the plain scan of the files it reads, with the load around them."""
    load = os.getloadavg()[0]
    wall, cpu, rss, rep, err = _analyze(run, extra or [])
    if rep is None:
        _say(f"analyze {run} failed:\n{err[-3000:]}")
    scan_wall, scan_cpu = plain_scan(run, scan_tables)
    return {"label": label, "run": run, "wall": wall, "cpu": cpu, "rss": rss, "report": rep,
            "scan": (scan_wall, scan_cpu), "full": plain_scan(run, scan_tables, full=True),
            "load": max(load, os.getloadavg()[0])}


def _print_cases(cases: list[dict], raw_findings: list[dict] | None, faults: list[dict] | None) -> None:
    print("| case | wall (s) | CPU (s) | peak RSS (MiB) | plain scan wall / CPU (s) | wall / scan "
          "| full read wall / CPU (s) | wall / full read | load avg | findings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        rep = c["report"]
        if c["label"].startswith("generated"):
            said = _truth(rep, faults or [])
        elif c["label"].startswith("summarized") and raw_findings is not None:
            said = f"{_findings(rep)} (vs raw: {'failed' if rep is None else _versus(rep['findings'], raw_findings)})"
        else:
            said = _findings(rep)
        (sw, sc), (fw, fc) = c["scan"], c["full"]
        print(f"| {c['label']} | {c['wall']:.1f} | {c['cpu']:.1f} | {c['rss']:,.0f} | {sw:.1f} / {sc:.1f} | "
              f"**{c['wall'] / sw:.1f}x** | {fw:.1f} / {fc:.1f} | {c['wall'] / fw:.1f}x | {c['load']:.1f} | {said} |")


def edge_cases(args: argparse.Namespace, raw: dict) -> None:
    """The summaries-at-the-edge cases beside the raw one: the raw run summarized (--edge-summarized)
    and the generated --edge-steps job; with --phases the phase table of each."""
    out = Path(args.edge_out)
    cases, raw_findings = [raw], raw["report"]["findings"] if raw["report"] else None
    if args.edge_summarized:
        info = build_summarized(Path(args.out), out, args.rebuild_edge)
        print(f"\nsummarized/ (summarize_run of the raw run): {info['build_s']:,.1f} s, "
              f"{info['build_cpu_s']:,.1f} CPU s")
        cases.append(_case(f"summarized edge tables, {args.steps} steps", out / "summarized", EDGE_TABLES))
    gen = build_generated(out, args.dp, args.tp, args.pp, args.edge_steps, args.rebuild_edge)
    print(f"\ngenerated/ (samples/edge_gen.py, {args.dp * args.tp * args.pp:,} ranks x {args.edge_steps:,} steps; "
          f"cached in {out}): {gen['build_s']:,.1f} s, {gen['build_cpu_s']:,.1f} CPU s to write\n")
    print("| table | rows | on disk | files |\n|---|---|---|---|")
    for table, (rows, size, files) in gen["stats"].items():
        print(f"| {table} | {rows:,} | {size / 2**20:,.1f} MiB | {files:,} |")
    cases.append(_case(f"generated edge tables, {args.edge_steps:,} steps", out / "generated", EDGE_TABLES))
    for c in cases[1:]:
        if c["report"] is not None:  # kept for a closer look (the findings' evidence)
            (out / f"report-{c['run'].name}.json").write_text(json.dumps(c["report"], indent=1))
    print("\nEnd to end (`megascope analyze --json`, fresh process, no persisted summary; targets: raw 100 steps "
          "<= 3x its plain scan; generated 1,000 steps < 30 s and < 3,072 MiB):\n")
    _print_cases(cases, raw_findings, gen["faults"])
    if args.phases:
        load = os.getloadavg()[0]
        results = [(c["label"], _phases_child(c["run"])) for c in cases]
        load = max(load, os.getloadavg()[0])
        names = list(dict.fromkeys(k for _, r in results for k in r))
        print(f"\nPhases (Python API, fresh process each; wall / CPU s; load average {load:.1f}):\n")
        print("| phase | " + " | ".join(label for label, _ in results) + " |\n|---" * 1 + "|---" * len(results) + "|")
        for name in names:
            cells = []
            for _, r in results:
                if name not in r:  # a statement the other case's pass does not run
                    cells.append("-")
                    continue
                w, c = r[name]
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
                    help="also compare the local engine with --engine ray on a local Ray cluster (on the "
                         "generated case with --edge, else on the raw run)")
    ap.add_argument("--ray-workers", default="2", help="worker CPUs of each Ray cluster tried, comma-separated "
                    "(default 2)")
    ap.add_argument("--edge", action="store_true",
                    help="also build (once) and analyze the generated --edge-steps job (samples/edge_gen.py)")
    ap.add_argument("--edge-summarized", action="store_true",
                    help="with --edge: also the raw run summarized post hoc (summarize_run, built once: minutes)")
    ap.add_argument("--edge-out", default="/tmp/megascope-scale-edge")
    ap.add_argument("--edge-steps", type=int, default=1000)
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
        # the summarized case was built from this run (the generated one was not: it stays)
        shutil.rmtree(Path(args.edge_out) / "summarized", ignore_errors=True)
        (Path(args.edge_out) / "summarized.json").unlink(missing_ok=True)
        from megascope.samples.simulator import SimConfig, simulate
        t = time.perf_counter()
        simulate(out, SimConfig(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                                inject=[f for f in FAULTS
                                        if max(int(x) for x in f.split("=")[1].split(",")[0].split("-")) < world]))
        gen_s = time.perf_counter() - t
    n_events = _events(out)
    disk = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    raw = _case(f"raw events, {args.steps} steps", out, ("events", "steps"))
    if raw["report"] is None:
        return 1
    rows = [("layout", f"dp={args.dp} tp={args.tp} pp={args.pp} ({world} ranks) x {args.steps} steps"),
            ("events", f"{n_events:,} ({disk / 2**20:,.0f} MiB of Parquet)"),
            ("simulate (s)", f"{gen_s:.1f}" if gen_s == gen_s else "cached"),
            ("analyze wall (s)", f"{raw['wall']:.1f}"),
            ("analyze CPU (s)", f"{raw['cpu']:.1f}  (user + sys, all threads)"),
            ("plain DuckDB scan of events + steps, wall / CPU (s)", f"{raw['scan'][0]:.1f} / {raw['scan'][1]:.1f}"),
            ("analyze / scan (wall)", f"{raw['wall'] / raw['scan'][0]:.1f}x  (target <= 3x)"),
            ("full read of events + steps (every column), wall / CPU (s)",
             f"{raw['full'][0]:.1f} / {raw['full'][1]:.1f}"),
            ("load average (1 min, max of start/end)", f"{raw['load']:.1f} on {os.cpu_count()} cores"),
            ("analyze peak RSS (MiB)", f"{raw['rss']:,.0f}"),
            ("findings", _findings(raw["report"]))]
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
        edge_cases(args, raw)
    if args.engines:
        run = Path(args.edge_out) / "generated" if args.edge else out
        load = os.getloadavg()[0]
        rows = engines(run, [int(w) for w in args.ray_workers.split(",")])
        load = max(load, os.getloadavg()[0])
        print(f"\nEngines on {run} (`megascope analyze --json`, fresh processes, no persisted summary; "
              f"load average {load:.1f}):\n")
        print("| engine | wall (s) | driver CPU (s) | driver peak RSS (MiB) | findings vs local |")
        print("|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
