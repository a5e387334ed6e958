"""The one scan of the events (sql/event_pass.sql) that rank_step, the p2p links and the collective
instances are all derived from, run over batches of ranks so that its window (each rank's timeline in
time order) stays within a bounded amount of memory on 10^4-rank runs."""

from __future__ import annotations

import pandas as pd

from megascope.analyzer.layout import instance_sql, is_regular
from megascope.analyzer.store import Store, load_sql

BATCH_RANKS = 1024
"""Ranks per batch of the event pass: each batch is one windowed scan of those ranks' segments."""
RANK_COLUMNS = ("rank, step, peer, compute_ns, forward_ns, backward_ns, optimizer_ns, nested_ns, recv_ns, "
                "collective_ns, data_wait_ns, gap_ns, gap_p2p_ns, gap_coll_ns, send_min_ns, sends, recv_min_ns, "
                "n_events")
COLLECTIVE_COLUMNS = ('"group", instance, seq, first_step, op_name, n_events, last_rank, last_issue_ns, '
                      "first_issue_ns, issue_sum_ms, last_end_ns")


def build_event_pass(store: Store, progress=None) -> None:
    """Create the temp tables `_rank_peer_step`, `rank_step` and `collective_instances`."""
    topo = store.manifest["topology"]
    dp, tp = int(topo["dp"]), int(topo["tp"])
    regular = is_regular(store.topology, dp, tp)
    base = run_start_ns(store)
    join = "" if regular else "JOIN topology _t USING (rank)"
    template = load_sql("event_pass").rstrip().rstrip(";")
    batches = store.rank_batches(BATCH_RANKS)
    for i, source in enumerate(batches):
        if progress is not None:
            progress("scanning events", i, len(batches))
        sql = template.format(source=source, instance=instance_sql(store.topology, dp, tp, "_t"),
                              join=join, base=base)
        store.execute("CREATE OR REPLACE TEMP TABLE _batch AS " + sql)
        # keep only what each grouping needs: the wide batch rows would fill DuckDB's memory
        verb = "CREATE OR REPLACE TEMP TABLE {} AS " if i == 0 else "INSERT INTO {} "
        store.execute(verb.format("_rank_peer_step") + f"SELECT {RANK_COLUMNS} FROM _batch WHERE gset = 0")
        store.execute(verb.format("_collective_partials") + f"SELECT {COLLECTIVE_COLUMNS} FROM _batch "
                      "WHERE gset = 1 AND instance IS NOT NULL")
        store.execute("DROP TABLE _batch")
    if progress is not None:
        progress("scanning events", len(batches), len(batches))
    store.execute(load_sql("rank_step"))
    store.execute(load_sql("collectives").format(base=base))
    store.execute("DROP TABLE _collective_partials")


def run_start_ns(store: Store) -> int:
    """A time origin (an hour before the first step start) so sums and encodings of times stay small,
    positive numbers."""
    # one rank's steps suffice (clocks are aligned across ranks; the hour of margin covers skew),
    # and reading one folder is instant where the whole steps table is 10^4 files
    row = store.query(f"SELECT min(start_ns) AS t FROM {store.table_source('steps', [int(store.topology['rank'].iloc[0])])}")
    if not len(row) or pd.isna(row.t.iloc[0]):
        row = store.query("SELECT min(start_ns) AS t FROM steps")
    value = row.t.iloc[0] if len(row) else None
    return 0 if value is None or pd.isna(value) else int(value) - 3_600_000_000_000
