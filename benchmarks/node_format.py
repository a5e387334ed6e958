"""What a node-level run format would save the 12,288-rank analysis (issue 28's format question).

Each rank's tracer writes its summaries as its own segments (tracer/edge_summary.py): at 12,288 ranks x
1,000 steps the event pass opens 36,864 files and merges 221 M collective member rows, 16 of each
rank-step's 18 from tensor-parallel all-reduces whose members all sit on one host. This script measures,
on the same job and in fresh processes one after another, the event pass's three tables built

  - as `megascope analyze` builds them today (event_pass.from_edge_summaries: per-rank segments, the
    collective partials in worker processes), and
  - from per-host files: each host's ranks' edge_rank_step and edge_peer_step rows in one segment, and
    its collective members merged into partial rows (edge_partials.partials_of_files, the pass's own
    function) - what a writer on each host could produce at the end of the run - read with the pass's own
    SQL (rank_step_of_edge, the p2p rows' select, split_partials + merge_partials),

checks that both give the same tables, and prints wall and CPU seconds per table, peak RSS and the files
opened, with what building the per-host files costs per host. Nothing in megascope reads per-host files:
this is the measurement a format decision would start from, not a feature.

    python benchmarks/node_format.py [--run /tmp/megascope-scale-edge/generated] [--out /tmp/megascope-node-format]

--run is a summarized run (benchmarks/analyzer_scale.py --edge builds the 12,288 x 1,000 job there); the
per-host files are built once under --out (their tracer writer, zstd and delta encoding) and reused while
built.json matches the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

TABLES = ("rank_step", "_p2p_peer_step", "collective_instances")


def _cpu() -> float:
    """This process's CPU seconds and its joined children's (the partials' worker processes)."""
    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def _hosts(store) -> dict[str, list[int]]:
    """The topology's ranks per host, in rank order."""
    topo = store.topology.sort_values("rank")
    return {str(h): [int(r) for r in g["rank"]] for h, g in topo.groupby("host", sort=False)}


def build(run: Path, out: Path) -> None:
    """The per-host files under `out`, one segment per host and table (the tracer's writer, with the host's
    index for a rank): edge_rank_step and edge_peer_step concatenated, partials/edge_collectives the host's
    collective members as partial rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascope.analyzer.data import event_pass as ep
    from megascope.analyzer.data.edge_partials import partials_of_files
    from megascope.analyzer.data.store import Store
    from megascope.tracer.sink import ParquetSegmentSink

    stamp = {"run": str(run), "run.json mtime": (run / "run.json").stat().st_mtime}
    if (out / "built.json").exists() and json.loads((out / "built.json").read_text()) == stamp:
        return
    store = Store(str(run))
    base, layout = ep.run_start_ns(store), ep.LayoutParams.of(store)
    hosts = _hosts(store)
    (out / "built.json").unlink(missing_ok=True)
    for folder in ("edge_rank_step", "edge_peer_step", "partials"):  # the sink appends after what it finds
        shutil.rmtree(out / folder, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    w0, c0 = time.perf_counter(), _cpu()
    for i, ranks in enumerate(hosts.values()):
        sink = ParquetSegmentSink(out, i)
        for table in ("edge_rank_step", "edge_peer_step"):
            files = [f for r in ranks for f in sorted((run / table / f"rank={r:05d}").glob("seg-*.parquet"))]
            sink.write(table, pa.concat_tables(pq.read_table(f) for f in files))
        folders = (run / "edge_collectives" / f"rank={r:05d}" for r in ranks)
        files = [str(f) for folder in folders for f in sorted(folder.glob("seg-*.parquet"))]
        partials = partials_of_files(files, base, layout.dp, layout.tp, layout.cp, layout.renumber)
        if partials is None:
            raise SystemExit(f"node_format: host {i}'s collective rows do not take the numpy path; nothing to compare")
        # the same writer and table name, under partials/: these rows are the members' merge, not members
        ParquetSegmentSink(out / "partials", i).write("edge_collectives", partials)
        if i % 256 == 0:
            print(f"  built {i + 1}/{len(hosts)} hosts", file=sys.stderr, flush=True)
    per_host = {"hosts": len(hosts), "wall_s": time.perf_counter() - w0, "cpu_s": _cpu() - c0}
    (out / "cost.json").write_text(json.dumps(per_host))
    (out / "built.json").write_text(json.dumps(stamp))


def _checksums(store) -> dict[str, list]:
    """Per table, order-free: the row count, each integer column's sum, each float column's sum to 9
    digits (the issue sums' order differs), each string column's xor of hashes."""
    sums = {}
    for table in TABLES:
        cols = store.query(f"SELECT column_name, column_type FROM (DESCRIBE {table})")
        exprs = ["count(*)::VARCHAR"]
        for c, t in zip(cols.column_name, cols.column_type):
            if t in ("DOUBLE", "FLOAT"):
                exprs.append(f"printf('%.9g', sum(\"{c}\"))")
            elif t == "VARCHAR":
                exprs.append(f'bit_xor(hash("{c}"))::VARCHAR')
            elif t != "BOOLEAN":
                exprs.append(f'sum("{c}")::VARCHAR')
        sums[table] = list(store.con.execute(f"SELECT {', '.join(exprs)} FROM {table}").fetchone())
    return sums


def child(variant: str, run: Path, out: Path) -> dict:
    """The event pass's three tables by `variant` ("per-rank" or "per-host"), timed per table."""
    from megascope.analyzer.data import event_pass as ep
    from megascope.analyzer.data.store import Store

    store = Store(str(run))
    base = ep.run_start_ns(store)
    times: dict[str, list[float]] = {}
    w0, c0 = time.perf_counter(), _cpu()
    if variant == "per-rank":
        sys.path.insert(0, str(Path(__file__).parent))
        from analyzer_scale import StatementTimer

        statements: dict[str, list[float]] = {}
        store.con = StatementTimer(store.con, _cpu, statements)  # the pass's time by the table each statement makes
        try:
            if not ep.from_edge_summaries(store, base):
                raise SystemExit("node_format: the run's edge summaries do not cover it")
        finally:
            store.con = store.con.con
        times["event pass"] = [time.perf_counter() - w0, _cpu() - c0]
        for name in ("rank_step", "_p2p_peer_step"):
            times[name] = statements[f"  event pass: {name}"]
        # the rest of the pass is the collectives: the partials (worker processes, then this one), split, merge
        times["collective_instances"] = [times["event pass"][i] - times["rank_step"][i] - times["_p2p_peer_step"][i]
                                         for i in (0, 1)]
    else:
        ep.define_sql(store)
        plan = ep.PassPlan(int(base), True, False, ep.LayoutParams.of(store))

        def timed(name: str, sql: str) -> None:
            w, c = time.perf_counter(), _cpu()
            store.execute(sql)
            times[name] = [time.perf_counter() - w, _cpu() - c]

        w, c = time.perf_counter(), _cpu()
        # in batches of hosts as the pass takes ranks (BATCH_RANKS): each read once, split, then the merge
        files = sorted(str(f) for f in (out / "partials" / "edge_collectives").glob("*/*.parquet"))
        per_batch = max(1, ep.BATCH_RANKS * len(files) // len(store.topology))
        for i in range(0, len(files), per_batch):
            store.con.execute("CREATE OR REPLACE TEMP TABLE _batch_partials AS "
                              "FROM read_parquet($files, hive_partitioning=false)",
                              {"files": files[i:i + per_batch]})
            ep.split_partials(store, "_batch_partials", ep.EVENT_PASS_TABLES, plan, create=i == 0)
        store.execute("DROP TABLE _batch_partials")
        ep.merge_partials(store, ep.EVENT_PASS_TABLES, plan.base)
        times["collective_instances"] = [time.perf_counter() - w, _cpu() - c]
        # hive_partitioning off, as the Store reads: the host files' folders are named rank=<host index>
        store.execute("CREATE TEMP VIEW _host_rank_step AS "
                      f"FROM read_parquet('{out}/edge_rank_step/*/*.parquet', hive_partitioning=false)")
        timed("rank_step", "CREATE TEMP TABLE rank_step AS FROM rank_step_of_edge('_host_rank_step')")
        store.execute("ALTER TABLE rank_step DROP COLUMN final")
        timed("_p2p_peer_step", f"CREATE TEMP TABLE _p2p_peer_step AS SELECT {ep._P2P_SELECT} "
              f"FROM read_parquet('{out}/edge_peer_step/*/*.parquet', hive_partitioning=false) WHERE peer >= 0")
        times["event pass"] = [time.perf_counter() - w0, _cpu() - c0]
    return {"times": times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "checksums": _checksums(store)}


def _files(folder: Path, tables: tuple[str, ...]) -> int:
    return sum(1 for t in tables for _ in (folder / t).glob("*/*.parquet"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("/tmp/megascope-scale-edge/generated"),
                    help="a summarized run (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/megascope-node-format"),
                    help="where the per-host files are built (default: %(default)s)")
    ap.add_argument("--child", choices=("per-rank", "per-host"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.run, args.out)))
        return 0
    if not (args.run / "edge_rank_step").is_dir():
        print(f"node_format: {args.run} has no edge summaries; build the job with "
              "`python benchmarks/analyzer_scale.py --edge` or pass --run", file=sys.stderr)
        return 2
    build(args.run, args.out)
    results = {}
    for variant in ("per-rank", "per-host"):
        print(f"  {variant} ...", file=sys.stderr, flush=True)
        res = subprocess.run([sys.executable, __file__, "--child", variant, "--run", str(args.run),
                              "--out", str(args.out)], capture_output=True, text=True)
        if res.returncode:
            print(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"{variant} failed", file=sys.stderr)
            return 1
        results[variant] = json.loads(res.stdout.strip().splitlines()[-1])
    rank, host = results["per-rank"], results["per-host"]
    cost = json.loads((args.out / "cost.json").read_text())
    print(f"\nthe event pass's tables of {args.run} ({os.getloadavg()[0]:.1f} load), wall / CPU s:\n")
    print("| table | per-rank segments (today) | per-host files | CPU ratio |")
    print("|---|---|---|---|")
    for name in ("collective_instances", "rank_step", "_p2p_peer_step", "event pass"):
        h = host["times"][name]
        r = rank["times"][name]
        left, ratio = f"{r[0]:.1f} / {r[1]:.1f}", f"{r[1] / h[1]:.2f}x"
        print(f"| {name} | {left} | {h[0]:.1f} / {h[1]:.1f} | {ratio} |")
    print(f"| peak RSS (MiB) | {rank['rss_mib']:,.0f} | {host['rss_mib']:,.0f} | |")
    print(f"| files read | {_files(args.run, ('edge_rank_step', 'edge_peer_step', 'edge_collectives')):,} | "
          f"{_files(args.out, ('edge_rank_step', 'edge_peer_step', 'partials/edge_collectives')):,} | |")
    same = rank["checksums"] == host["checksums"]
    print(f"\nthe same tables (row counts and column sums): {'yes' if same else 'NO'}")
    if not same:
        for table in TABLES:
            if rank["checksums"][table] != host["checksums"][table]:
                print(f"  {table}: {rank['checksums'][table]} against {host['checksums'][table]}")
    print(f"building the per-host files: {cost['cpu_s'] / cost['hosts'] * 1e3:.0f} ms CPU a host "
          f"({cost['hosts']:,} hosts, {cost['wall_s']:.0f} s here in all; on the hosts, in parallel)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
