"""The one scan of the events (sql/event_pass.sql) that rank_step, the p2p links and the collective
instances are all derived from, run over batches of ranks so that its window (each rank's timeline in
time order) stays within a bounded amount of memory on 10^4-rank runs."""

from __future__ import annotations

from megascope.analyzer.layout import instance_sql, is_regular
from megascope.analyzer.store import Store, load_sql

BATCH_RANKS = 2048
"""Ranks per batch of the event pass: each batch is one windowed scan of those ranks' segments."""


def build_event_pass(store: Store, progress=None) -> None:
    """Create the temp tables `_pass`, `_rank_peer_step`, `rank_step` and `collective_instances`."""
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
        verb = "CREATE OR REPLACE TEMP TABLE _pass AS " if i == 0 else "INSERT INTO _pass "
        store.execute(verb + sql)
    if progress is not None:
        progress("scanning events", len(batches), len(batches))
    store.execute(load_sql("rank_step"))
    store.execute(load_sql("collectives").format(base=base))
    store.execute("DROP TABLE _pass")


def run_start_ns(store: Store) -> int:
    """A time origin (the first step start) so sums of issue times stay small numbers."""
    row = store.query("SELECT min(start_ns) AS t FROM steps")
    value = row.t.iloc[0] if len(row) else None
    return int(value) if value is not None and value == value else 0
