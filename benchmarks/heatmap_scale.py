"""Heatmap at scale: time and peak memory of the rank x step heatmap for 12,288 ranks x 1,000 steps,
per metric and row grouping, through the analyzer facade and the dashboard's figure callback; and
the cost of building, reusing and extending the persisted rank-step summary on a real simulated run.

    python benchmarks/heatmap_scale.py [--dp 96 --tp 8 --pp 16 --steps 1000]
                                       [--build-dp 32 --build-tp 4 --build-pp 8 --build-steps 100]
                                       [--out /tmp/megascope-heatmap] [--repeat 3]

Part 1 (the 2 s target for one heatmap): 786 M raw events cannot be generated on the 2-core dev
box, so the run directory holds the real 12,288-rank run.json, one empty events and one empty steps
segment per rank, and the summary (RUN/analysis/rank_step/) synthesized in DuckDB with the summary's exact
schema (checked against a real summary) from a simple timing model (1F1B stage bubble, noise, rank
1000 slowed 1.3x from step 400). The summary records those segments, so `Run.open` + `Run.heatmap`
take the same path as on a real run whose summary is up to date. Each metric runs in a fresh process
(peak RSS = that process's ru_maxrss, DuckDB included); times are medians over --repeat calls.
"callback" = the dashboard's heatmap callback (pages/heatmap.py update_heatmap, its memo cleared):
the query, the Plotly figure (rows ordered stage-first) and its JSON encoding for the browser.

Part 2: the summary-building path itself, on a real `megascope simulate` run (default 1,024 ranks x
100 steps): full event pass + write, reuse on the next open, and extension after a live run added
10% more steps (the newest steps moved into new segments), each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megascope.analyzer.views import heatmap

METRICS = list(heatmap.METRICS)  # the dashboard's metrics and groupings, one definition (analyzer/views/heatmap.py)
GROUPS = list(heatmap.GROUPS)
STRAGGLER, ONSET, SLOWDOWN = 1000, 400, 1.3

# the summary's columns (analyzer/data/summary_cache.py) from a timing model; {f} forward per micro-batch
_SYNTH = """
WITH _g AS (
    SELECT t.rank, s.range AS step, t.pp, t.dp, t.tp, t.host,
           (hash(t.rank::BIGINT * 1000003 + s.range) % 100000) / 100000.0 AS u,
           (hash(s.range) % 100000) / 100000.0 AS us,
           CASE WHEN t.rank = {straggler} AND s.range >= {onset} THEN {slowdown} ELSE 1.0 END AS slow,
           CASE WHEN s.range >= {onset} THEN {slowdown} - 1.0 ELSE 0.0 END AS job_slow
    FROM topology t, range({steps}) s
), _t AS (
    SELECT *, {mb} * {f} * (1 + 0.04 * (u - 0.5)) * slow AS fwd,
           3 * {mb} * {f} * (1 + ({pp} - 1.0) / {mb}) * (1 + 0.01 * us) + 0.02 + 3 * {mb} * {f} * job_slow AS st
    FROM _g
), _p AS (
    SELECT *, 2 * fwd AS bwd, 0.005::DOUBLE AS opt, 0.004 + 0.002 * u AS coll, 0.0005::DOUBLE AS dw,
           0.0002 + 0.0003 * u AS gap FROM _t
)
SELECT rank::INTEGER AS rank, step::BIGINT AS step, pp::INTEGER AS pp, dp::INTEGER AS dp, tp::INTEGER AS tp,
    host::VARCHAR AS host,
    (1700000000000000000 + step * CAST(st * 1e9 AS BIGINT))::BIGINT AS start_ns,
    (1700000000000000000 + step * CAST(st * 1e9 AS BIGINT) + CAST(st * 1e9 AS BIGINT))::BIGINT AS end_ns,
    st AS step_time_s, ({mb} * 4096)::BIGINT AS tokens, 6.0 * 175e9 * 4096 * {mb} * {dp} AS model_flops,
    fwd + bwd + opt AS compute_s, fwd AS forward_s, bwd AS backward_s, opt AS optimizer_s,
    greatest(st - (fwd + bwd + opt) - coll - dw - gap, 0) AS recv_s, coll AS collective_s,
    0.001::DOUBLE AS nested_wait_s, dw AS data_wait_s, gap AS gap_s, gap / 2 AS gap_p2p_s, gap / 2 AS gap_coll_s,
    fwd + bwd + opt + dw + gap AS own_s, gap AS other_s, (6 * {mb} + 8)::DOUBLE AS n_events,
    CASE WHEN slow > 1 THEN 4 WHEN u < 0.02 THEN 1 ELSE 0 END::BIGINT AS late_count,
    CASE WHEN slow > 1 THEN 3 * {mb} * {f} * (slow - 1) WHEN u < 0.02 THEN 0.0005 * u ELSE NULL END AS lateness_s
FROM _p
"""


def _rss_mb() -> float:
    """Peak RSS of this process since its exec (VmHWM; ru_maxrss would carry over the parent's peak
    through fork, and the parent synthesized the summary in DuckDB)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median_s(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


# ---- part 1: the 12,288 x 1,000 heatmap --------------------------------------------------------------
def make_synthetic_run(out: Path, dp: int, tp: int, pp: int, steps: int) -> float:
    """run.json + one empty segment per rank and table + the synthesized summary; returns seconds."""
    import pyarrow.parquet as pq

    from megascope.analyzer import Run
    from megascope.analyzer.data.summary_cache import write_summary
    from megascope.tracer.run_dir import write_manifest
    from megascope.tracer.schema import TABLES

    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    world = dp * tp * pp
    ranks = [{"rank": r, "pp": r // (dp * tp), "dp": (r // tp) % dp, "tp": r % tp,
              "host": f"node{r // 8:05d}", "local_rank": r % 8} for r in range(world)]
    write_manifest(out, {"run_id": f"synthetic-{dp}x{tp}x{pp}-summary", "source": "benchmarks/heatmap_scale.py",
                         "topology": {"world": world, "dp": dp, "tp": tp, "pp": pp, "vpp": 1, "ranks": ranks},
                         "model": {"n_layers": 96, "hidden": 12288, "n_heads": 96, "seq_len": 4096},
                         "peak_flops": {"per_device": 989e12, "source": "benchmark"}})
    for table in ("events", "steps"):
        empty = TABLES[table].empty_table()
        for r in range(world):
            folder = out / table / f"rank={r:05d}"
            folder.mkdir(parents=True)
            pq.write_table(empty, folder / "seg-000000.parquet")
    run = Run.open(out)
    sql = _SYNTH.format(straggler=STRAGGLER, onset=ONSET, slowdown=SLOWDOWN, steps=steps, mb=8, f=0.010,
                        pp=pp, dp=dp)
    run.store.execute("CREATE OR REPLACE TEMP VIEW _synth AS " + sql)
    _check_schema(run.store)
    write_summary(run.store, "_synth")
    return time.perf_counter() - t0


def _check_schema(store) -> None:
    """The synthesized columns and types are the real summary's (built on a tiny simulated run)."""
    import tempfile

    from megascope.analyzer import Run
    from megascope.samples.simulator import SimConfig, simulate

    with tempfile.TemporaryDirectory() as tmp:
        simulate(Path(tmp) / "r", SimConfig(dp=2, tp=1, pp=2, steps=3))
        real = Run.open(Path(tmp) / "r")
        real.heatmap("compute")
        want = real.store.query("DESCRIBE rank_step_summary")[["column_name", "column_type"]].values.tolist()
    got = store.query("DESCRIBE _synth")[["column_name", "column_type"]].values.tolist()
    if want != got:
        raise SystemExit(f"synthesized summary schema drifted from the real one:\n real {want}\n synth {got}")


def child_metric(run_dir: str, metric: str, repeat: int) -> dict:
    """One metric in a fresh process: open, then every grouping: the analyzer query alone, and the
    dashboard's heatmap callback (query + figure, memo cleared) with the figure's JSON encoding."""
    from megascope.dashboard.app import create_app
    from megascope.dashboard.runs import CATALOG_KEY

    app = create_app([run_dir], refresh_s=3600)
    from megascope.dashboard.pages import heatmap as page  # importable once the app exists
    catalog = app.server.config[CATALOG_KEY]
    t = time.perf_counter()
    with catalog.using(0) as run:
        open_s = time.perf_counter() - t
        t = time.perf_counter()
        run.heatmap(metric, "rank", page.MAX_ROWS, page.MAX_COLS)
        first_s = time.perf_counter() - t
    assert run.summary is not None and run.summary.how == "reused", run.summary
    rows = {}
    with app.server.test_request_context():
        for group in GROUPS:
            query_s, hm = _median_s(lambda: run.heatmap(metric, group, page.MAX_ROWS, page.MAX_COLS), repeat)

            def callback() -> str:
                catalog._memo.clear()  # measure the work, not the memo
                return page.update_heatmap(metric, group, "pp", 0, 0).to_json()

            callback_s, payload = _median_s(callback, repeat)
            rows[group] = {"query_s": query_s, "callback_s": callback_s, "cells": int(hm.values.size),
                           "json_kb": len(payload) / 1024}
    return {"open_s": open_s, "first_s": first_s, "groups": rows, "peak_rss_mb": _rss_mb()}


# ---- part 2: building the summary on a real simulated run --------------------------------------------
def make_build_run(out: Path, dp: int, tp: int, pp: int, steps: int) -> int:
    from megascope.samples.simulator import SimConfig, simulate

    if not (out / "run.json").exists() \
            or json.loads((out / "run.json").read_text())["topology"]["world"] != dp * tp * pp \
            or json.loads((out / "run.json").read_text())["config"]["train"]["steps"] != steps:
        shutil.rmtree(out, ignore_errors=True)
        simulate(out, SimConfig(dp=dp, tp=tp, pp=pp, steps=steps, inject=["straggler:rank=3,slowdown=1.3,from=20"]))
    import duckdb
    return duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{out}/events/rank=*/*.parquet', "
                                    "hive_partitioning=false)").fetchone()[0]


def split_newest_steps(run: Path, first_new: int, held: Path) -> None:
    """Move rows of steps >= first_new into seg-000001 files kept in `held` (a live run's next flush)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    shutil.rmtree(held, ignore_errors=True)
    for table in ("events", "steps"):
        for folder in sorted((run / table).iterdir()):
            seg = folder / "seg-000000.parquet"
            rows = pq.read_table(seg)
            newer = pc.greater_equal(rows["step"], first_new)
            (held / table / folder.name).mkdir(parents=True)
            pq.write_table(rows.filter(newer), held / table / folder.name / "seg-000001.parquet")
            pq.write_table(rows.filter(pc.invert(newer)), seg)


def release(run: Path, held: Path) -> None:
    for table in ("events", "steps"):
        for folder in (held / table).iterdir():
            os.replace(folder / "seg-000001.parquet", run / table / folder.name / "seg-000001.parquet")


def merge_back(run: Path) -> None:
    """Undo split_newest_steps (so reruns start from the simulator's one segment per rank)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for table in ("events", "steps"):
        for folder in sorted((run / table).iterdir()):
            later = folder / "seg-000001.parquet"
            if later.exists():
                seg = folder / "seg-000000.parquet"
                pq.write_table(pa.concat_tables([pq.read_table(seg), pq.read_table(later)]), seg)
                later.unlink()


def child_build(run_dir: str) -> dict:
    from megascope.analyzer import Run

    t = time.perf_counter()
    run = Run.open(run_dir)
    open_s = time.perf_counter() - t
    t = time.perf_counter()
    run.heatmap("compute")
    return {"open_s": open_s, "summary_s": time.perf_counter() - t, "how": run.summary.how,
            "from_step": run.summary.rebuilt_from_step, "parts": run.summary.parts, "peak_rss_mb": _rss_mb()}


def _in_child(kind: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child {kind} {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def heatmap_part(args: argparse.Namespace) -> None:
    """Part 1: the synthesized 12,288 x 1,000 run, one fresh process per metric."""
    world = args.dp * args.tp * args.pp
    synth = args.out / f"synthetic-{world}x{args.steps}"
    from megascope.analyzer.data.store import Store
    from megascope.analyzer.data.summary_cache import is_current
    kept = args.keep and (synth / "run.json").is_file() and is_current(Store(synth))  # else re-synthesize
    gen_s = float("nan") if kept else make_synthetic_run(synth, args.dp, args.tp, args.pp, args.steps)
    size_mb = sum(f.stat().st_size for f in (synth / "analysis" / "rank_step").glob("part-*.parquet")) / 2**20
    print(f"\n## {world:,} ranks x {args.steps:,} steps ({world * args.steps:,} rank-steps; summary file "
          f"{size_mb:.0f} MB, " + ("kept from an earlier run" if kept else f"synthesized in {gen_s:.0f} s") + ")\n")
    print("| metric | open (s) | first heatmap (s) | " + " | ".join(f"by {g}: query / callback (s)" for g in GROUPS)
          + " | peak RSS (MB) |")
    print("|---|---|---|" + "---|" * len(GROUPS) + "---|")
    worst = 0.0
    for metric in METRICS:
        r = _in_child("metric", str(synth), metric, str(args.repeat))
        cells = " | ".join(f"{r['groups'][g]['query_s']:.2f} / {r['groups'][g]['callback_s']:.2f}" for g in GROUPS)
        worst = max(worst, r["first_s"], *(v["callback_s"] for v in r["groups"].values()))
        print(f"| {metric} | {r['open_s']:.2f} | {r['first_s']:.2f} | {cells} | {r['peak_rss_mb']:.0f} |", flush=True)
    print(f"\nslowest heatmap answer (callback, query included): {worst:.2f} s; figure JSON by rank "
          f"{r['groups']['rank']['json_kb']:.0f} KB for {r['groups']['rank']['cells']:,} cells")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=96)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--build-dp", type=int, default=32)
    ap.add_argument("--build-tp", type=int, default=4)
    ap.add_argument("--build-pp", type=int, default=8)
    ap.add_argument("--build-steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("/tmp/megascope-heatmap"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-build", action="store_true", help="part 1 only")
    ap.add_argument("--keep", action="store_true", help="reuse part 1's synthesized run if it is there")
    ap.add_argument("--build-only", action="store_true", help="part 2 only")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        result = child_metric(rest[0], rest[1], int(rest[2])) if kind == "metric" else child_build(rest[0])
        print(json.dumps(result))
        return 0

    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    if not args.build_only:
        heatmap_part(args)
    if args.skip_build:
        return 0

    build = args.out / f"sim-{args.build_dp}x{args.build_tp}x{args.build_pp}x{args.build_steps}"
    events = make_build_run(build, args.build_dp, args.build_tp, args.build_pp, args.build_steps)
    merge_back(build)
    shutil.rmtree(build / "analysis", ignore_errors=True)
    bworld = args.build_dp * args.build_tp * args.build_pp
    print(f"\n## building the summary: `megascope simulate` run, {bworld:,} ranks x {args.build_steps} steps, "
          f"{events:,} events\n")
    print("| case | open (s) | summary (s) | how | peak RSS (MB) |\n|---|---|---|---|---|")
    for case in ("full build", "reuse"):
        r = _in_child("build", str(build))
        print(f"| {case} | {r['open_s']:.2f} | {r['summary_s']:.2f} | {r['how']} | {r['peak_rss_mb']:.0f} |",
              flush=True)
    first_new = args.build_steps - max(1, args.build_steps // 10)
    held = args.out / "held-back"
    split_newest_steps(build, first_new, held)
    shutil.rmtree(build / "analysis", ignore_errors=True)
    r = _in_child("build", str(build))
    print(f"| build on steps 0-{first_new - 1} | {r['open_s']:.2f} | {r['summary_s']:.2f} | {r['how']} | "
          f"{r['peak_rss_mb']:.0f} |", flush=True)
    release(build, held)
    r = _in_child("build", str(build))
    print(f"| + steps {first_new}-{args.build_steps - 1} arrive | {r['open_s']:.2f} | {r['summary_s']:.2f} | "
          f"{r['how']} from step {r['from_step']} ({r['parts']} parts) | {r['peak_rss_mb']:.0f} |")
    merge_back(build)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
