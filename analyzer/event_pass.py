"""The one read of the events that rank_step, the p2p links and the collective instances are all
derived from, run over batches of ranks (bounded memory on 10^4-rank runs). Each batch reads its
events once - through the timeline (sql/event_pass.sql: a window per rank-step, for traces whose spans
nest or overlap) or without it (sql/event_pass_flat.sql: big traces whose spans do not, checked on a
sample) - and its own steps segments, and appends its rows to the run-wide tables. Rank-steps a
damaged segment may have held are then taken out of them (drop_incomplete, sql/incomplete.sql)."""

from __future__ import annotations

import pandas as pd

from megascope.analyzer.layout import MATCHED_GROUPS, instance_sql, is_regular
from megascope.analyzer.store import Store, load_sql
from megascope.tracer.schema import WAIT_SUFFIX

BATCH_RANKS = 1024
"""Ranks per batch of the event pass: each batch reads those ranks' events and steps segments once."""
RANK_COLUMNS = ("rank, step, peer, compute_ns, forward_ns, backward_ns, optimizer_ns, nested_ns, recv_ns, "
                "collective_ns, data_wait_ns, gap_ns, gap_p2p_ns, gap_coll_ns, send_min_ns, sends, recv_min_ns, "
                "n_events")
COLLECTIVE_COLUMNS = ('"group", instance, seq, first_step, op_name, n_events, last_rank, last_issue_ns, '
                      "first_issue_ns, issue_sum_ms, last_end_ns")

STEP_COLUMNS = "rank, step, start_ns, end_ns, tokens, model_flops"
"""The steps columns rank_step.sql reads."""

TIMELINE_ALWAYS_RANKS = 2048
"""Runs up to this size always take the timeline pass (its sort is cheap there)."""
SAMPLE_RANKS = 32
SIMPLE_GAP_SQL = ("greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0) "
                  "- coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0)")
TIMELINE_GAP_SQL = "coalesce(e.gap_s, 0)"
_WAIT_LITERAL = "'" + WAIT_SUFFIX.replace("'", "''") + "'"
"""The name suffix of `<op>.wait` host spans, as an SQL literal (both passes code them as waits)."""


def build_event_pass(store: Store, progress=None) -> None:
    """Create the temp tables `_rank_peer_step`, `rank_step` and `collective_instances`: per batch of
    ranks, one read of its events (aggregated per rank-step-peer and per collective) and of its steps
    (joined into the batch's rank_step rows), appended to the run-wide tables. The rank-steps of
    damaged segments go to `rank_step_incomplete` instead (drop_incomplete)."""
    base = run_start_ns(store)
    timeline = len(store.topology) <= TIMELINE_ALWAYS_RANKS or needs_timeline(store, base)
    batches = store.rank_prefix_batches(BATCH_RANKS) or [None]
    gap = TIMELINE_GAP_SQL if timeline else SIMPLE_GAP_SQL
    for i, prefixes in enumerate(batches):
        if progress is not None:
            progress("scanning events", i, len(batches))
        # the reads, rebuilt on retry (a damaged segment dropped from the batch's source)
        store.run_with_retry(lambda: read_batch(store, prefixes, base, timeline))
        verb = "CREATE OR REPLACE TEMP TABLE {} AS " if i == 0 else "INSERT INTO {} "
        store.execute(batch_rank_step_sql(gap, verb.format("rank_step")))
        store.execute(verb.format("_rank_peer_step") + f"SELECT {RANK_COLUMNS} FROM _batch_peer_step")
        store.execute(verb.format("_collective_partials") + f"SELECT {COLLECTIVE_COLUMNS} FROM _batch_partials")
    for table in ("_batch_events", "_batch_steps", "_batch_peer_step", "_batch_partials"):
        store.execute(f"DROP TABLE IF EXISTS {table}")
    if progress is not None:
        progress("scanning events", len(batches), len(batches))
    store.execute(load_sql("collectives").format(base=base))
    store.execute("DROP TABLE _collective_partials")
    drop_incomplete(store, "rank_step", "_rank_peer_step", "collective_instances")


def drop_incomplete(store: Store, rank_step: str, peer_step: str | None, collectives: str) -> int:
    """Move the rank-steps a damaged events or steps segment may have held (Store.incomplete_ranges)
    out of `rank_step` into `<rank_step>_incomplete`, and delete their p2p rows (`peer_step`, either
    end) and the collective instances they were members of, so no detector judges a rank on part of
    its events. Returns the number of rank-step rows moved."""
    ranges = store.incomplete_ranges()
    moved = f"{rank_step}_incomplete"
    if ranges.empty:
        store.execute(f"CREATE OR REPLACE TEMP TABLE {moved} AS SELECT * FROM {rank_step} WHERE false")
        return 0
    store.con.register("_incomplete_ranges_df", ranges[["rank", "first_step", "last_step"]])
    store.execute("CREATE OR REPLACE TEMP TABLE _incomplete_ranges AS SELECT * FROM _incomplete_ranges_df")
    store.con.unregister("_incomplete_ranges_df")
    topo = store.manifest["topology"]
    dp, tp, cp = int(topo["dp"]), int(topo["tp"]), int(topo.get("cp", 1))  # no cp in run.json: cp = 1
    join = "" if is_regular(store.topology, dp, tp, cp) else "JOIN topology _t USING (rank)"
    groups = ", ".join(f"('{g}')" for g in MATCHED_GROUPS)
    sql = "\n".join(line for line in load_sql("incomplete").splitlines() if not line.startswith("--"))
    for statement in (s.strip() for s in sql.split("\n;\n")):
        if peer_step is None and "{peer_step}" in statement:
            continue
        store.execute(statement.format(rank_step=rank_step, rank_step_incomplete=moved, peer_step=peer_step,
                                       collectives=collectives, groups=groups, join=join,
                                       instance=instance_sql(store.topology, dp, tp, "_t", cp)))
    store.execute("DROP TABLE _incomplete_ranges")
    return int(store.query(f"SELECT count(*) AS n FROM {moved}").n.iloc[0])


def read_batch(store: Store, prefixes: list[str] | None, base: int, timeline: bool,
               first_step: int | None = None) -> None:
    """_batch_peer_step, _batch_partials (event_pass.sql or event_pass_flat.sql) and _batch_steps
    from one batch's segments, from `first_step` on when given (the summary cache's extension of a
    live run). Raw DuckDB calls: run_with_retry sees which segment failed."""
    since = "" if first_step is None else f" WHERE step >= {int(first_step)}"
    source = store.batch_source("events", prefixes)
    if since:
        source = f"(SELECT * FROM {source}{since})"
    if timeline:
        store.con.execute("CREATE OR REPLACE TEMP TABLE _batch AS " + pass_sql(store, source, base, True))
        # keep only what each grouping needs: the wide batch rows would fill DuckDB's memory
        store.con.execute(f"CREATE OR REPLACE TEMP TABLE _batch_peer_step AS SELECT {RANK_COLUMNS} FROM _batch "
                          "WHERE gset = 0")
        store.con.execute(f"CREATE OR REPLACE TEMP TABLE _batch_partials AS SELECT {COLLECTIVE_COLUMNS} "
                          "FROM _batch WHERE gset = 1 AND instance IS NOT NULL")
        store.con.execute("DROP TABLE _batch")
    else:
        for statement in flat_pass_sql(store, source, base):
            store.con.execute(statement)
        store.con.execute("DROP TABLE _batch_events")
    # only the columns rank_step.sql reads (10^5 small files: every column chunk costs)
    store.con.execute(f"CREATE OR REPLACE TEMP TABLE _batch_steps AS SELECT {STEP_COLUMNS} FROM "
                      + store.batch_source("steps", prefixes) + since)


def batch_rank_step_sql(gap: str, verb: str) -> str:
    """rank_step.sql over one batch: its steps (_batch_steps) and its events' rows (_batch_peer_step)."""
    sql = load_sql("rank_step").replace("{gap}", gap)
    for old, new in (("CREATE OR REPLACE TEMP TABLE rank_step AS", verb),
                     ("FROM _rank_peer_step", "FROM _batch_peer_step"),
                     ("FROM steps s", "FROM _batch_steps s")):
        if old not in sql:
            raise RuntimeError(f"rank_step.sql no longer holds '{old}'; update event_pass.batch_rank_step_sql")
        sql = sql.replace(old, new)
    return sql


def flat_pass_sql(store: Store, source: str, base: int) -> list[str]:
    """The statements of event_pass_flat.sql over one source (no timeline: no sort)."""
    sql = _format_pass(load_sql("event_pass_flat"), store, source, base)
    return [s.strip() for s in sql.split("\n;\n") if s.strip()]


def pass_sql(store: Store, source: str, base: int, timeline: bool = True) -> str:
    """The event pass over one source; without `timeline` the window (a sort of every event) is
    replaced by NULLs: nothing counts as nested, and gaps come from the step residual instead."""
    sql = load_sql("event_pass").rstrip().rstrip(";")
    if not timeline:
        head, rest = sql.split("), _timeline AS (", 1)
        sql = (head + "), _timeline AS (SELECT *, NULL::BIGINT AS busy, NULL::BIGINT AS coll_end, "
               "NULL::BIGINT AS comm_end, NULL::BIGINT AS prev_end, NULL::BIGINT AS prev_start FROM _coded"
               + rest.split("-- timeline:end", 1)[1])
    return _format_pass(sql, store, source, base)


def _format_pass(sql: str, store: Store, source: str, base: int) -> str:
    """Fill an event-pass statement's placeholders; both passes code roles with sql/_event_role.sql."""
    topo = store.manifest["topology"]
    dp, tp, cp = int(topo["dp"]), int(topo["tp"]), int(topo.get("cp", 1))  # no cp in run.json: cp = 1
    join = "" if is_regular(store.topology, dp, tp, cp) else "JOIN topology _t USING (rank)"
    role = "\n".join(line for line in load_sql("_event_role").splitlines() if not line.startswith("--"))
    return sql.format(source=source, instance=instance_sql(store.topology, dp, tp, "_t", cp), join=join, base=base,
                      wait_suffix=_WAIT_LITERAL, async_op=async_op_sql(store),
                      event_role=role.format(wait_suffix=_WAIT_LITERAL))


def has_wait_spans(store: Store) -> bool:
    """Whether the trace has `<op>.wait` rows: the CPU tracer's (gloo), whose p2p ops end when the host
    called wait(), not when the bytes arrived. The first rank's events are checked (a few files)."""
    first = store.table_source("events", [int(store.topology["rank"].iloc[0])])
    row = store.query(f"SELECT count(*) AS n FROM (SELECT 1 FROM {first} WHERE kind = 'host' "
                      f"AND ends_with(name, {_WAIT_LITERAL}) LIMIT 1)")
    return bool(len(row) and int(row.n.iloc[0]) > 0)


def async_op_sql(store: Store) -> str:
    """SQL telling an async op of the CPU tracer (its start, the enqueue, after its issue; a sync op's
    start is its issue) on traces that have `<op>.wait` rows, else `false`. An async op without a wait
    row completed before wait(): it never blocked the rank. GPU traces (start: a CUDA event, after the
    host issue even for sync ops) have no wait rows, and their issue_ns column is then not read."""
    return "issue_ns < start_ns" if has_wait_spans(store) else "false"


def needs_timeline(store: Store, base: int, tolerance: float = 0.01) -> bool:
    """Does this trace need the timeline (a sort of 10^8 events on big runs)? Run both passes on a
    sample of ranks (every stage, a few replicas): the sort-free one is exact when no span nests in
    compute and the step residual equals the timeline's gaps (no async span hides or fakes host
    time), within `tolerance` of the step on 99% of the sampled rank-steps."""
    topo = store.topology
    picks = topo.groupby("pp")["rank"].apply(lambda r: list(r.iloc[:: max(1, len(r) // 4)][:4]))
    sample = sorted(int(r) for ranks in picks for r in ranks)[:SAMPLE_RANKS]
    source = store.table_source("events", sample)
    steps = store.table_source("steps", sample)
    frames = {}
    for mode in (True, False):
        sums = store.query(f"""SELECT rank, step, sum(nested_ns) AS nested_ns, sum(gap_ns) AS gap_ns,
                                      sum(compute_ns + recv_ns + collective_ns + data_wait_ns) AS covered_ns
                               FROM ({pass_sql(store, source, base, mode)}) WHERE gset = 0 GROUP BY ALL""")
        frames[mode] = sums.set_index(["rank", "step"]).sort_index()
    st = store.query(f"SELECT rank, step, end_ns - start_ns AS step_ns FROM {steps}").set_index(["rank", "step"])
    tl = frames[True].join(st, how="inner")
    if tl.empty or (tl.nested_ns > 0).any():
        return True
    residual = (tl.step_ns - frames[False].covered_ns.reindex(tl.index)).clip(lower=0)
    off = (residual - tl.gap_ns).abs() > tolerance * tl.step_ns
    return bool(off.mean() > 0.01)


def run_start_ns(store: Store) -> int:
    """A time origin (an hour before the first step start) so sums and encodings of times stay small,
    positive numbers."""
    # one rank's steps suffice (clocks are aligned across ranks; the hour of margin covers skew),
    # and reading one folder is instant where the whole steps table is 10^4 files
    first_rank = int(store.topology["rank"].iloc[0])
    row = store.query(f"SELECT min(start_ns) AS t FROM {store.table_source('steps', [first_rank])}")
    if not len(row) or pd.isna(row.t.iloc[0]):
        row = store.query("SELECT min(start_ns) AS t FROM steps")
    value = row.t.iloc[0] if len(row) else None
    return 0 if value is None or pd.isna(value) else int(value) - 3_600_000_000_000
