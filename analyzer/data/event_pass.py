"""The one read of the events that rank_step, the p2p links and the collective instances are all
derived from, run over batches of ranks (bounded memory on 10^4-rank runs).

The SQL is a small library of named macros (analyzer/data/sql/, one object a file, Perfetto-style): the
event pass in two named variants - `event_pass_timeline` (a window per rank-step, for traces whose spans
nest or overlap) and `event_pass_flat_events` + `flat_peer_step` + `flat_partials` (big traces whose
spans do not, checked on a sample) - and the derived tables `rank_step_of`, `collective_instances_of`,
`late_arrivals_of`, `incomplete_collectives`; a run whose ranks summarized their own events at the edge
is read from those tables instead (`rank_step_of_edge`, `collective_partials_of_members`). Values are
bound as prepared parameters; input relations are passed to the macros by name (`query_table`), and
the tables a function writes are named by its caller from a fixed set (`_table`).

One batch loop (`run_batches`) serves the event pass and the summary cache's extension of a live run:
each batch reads its ranks' events and steps once (`scan_batch`: the batch function, which leaves
`_batch_rank_step`, `_batch_peer_step` and `_batch_partials`) and the loop appends them to the caller's
tables. Where the batches run is an engine's business: in this process (`LocalEngine`) or as Ray tasks
(engine_ray.py, `megascope analyze --engine ray`), which ship the batch's rank patterns, not data, and
return the three tables as Arrow. Rank-steps a damaged segment may have held are then taken out of the
tables (drop_incomplete)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa

from megascope.analyzer.data.edge_partials import numpy_pays, partials_of_files, release_unused
from megascope.analyzer.data.group_instances import MATCHED_GROUPS, is_regular
from megascope.analyzer.data.partials_ahead import PartialsAhead
from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.findings import MIN_LATENESS_S
from megascope.tracer.edge_summary import EDGE_SQL, NO_FIRST_STEP, edge_sql
from megascope.tracer.layout import Layout
from megascope.tracer.schema import WAIT_SUFFIX

BATCH_RANKS = 1024
"""Ranks per batch of the event pass: each batch reads those ranks' events and steps segments once."""
TIMELINE_ALWAYS_RANKS = 2048
"""Runs up to this size always take the timeline pass (its sort is cheap there)."""
SAMPLE_RANKS = 32

SQL_FILES = ("event_pass_flat", "flat_peer_step", "flat_partials", "collectives", "group_size", "complete_instances",
             "arrivals", "incomplete", "rank_step_summary", "edge_rank_step", "edge_collectives")
"""The analyzer's macro library (analyzer/data/sql/), in definition order (a macro may call those before
it), defined after the macros the ranks run on their own events too (tracer/sql/, EDGE_SQL)."""
BATCH_TABLES = ("_batch_rank_step", "_batch_peer_step", "_batch_partials")
EDGE_TASK_TABLES = ("edge_rank_step", "edge_peer_step", "edge_collectives")
"""What scan_edge_batch reads of its batch's rank folders."""
"""What the batch function leaves for the loop (local tables, or the Arrow tables a remote engine returns)."""
PEER_STEP_COLUMNS = ("rank", "step", "peer", "compute_ns", "forward_ns", "backward_ns", "optimizer_ns", "nested_ns",
                     "recv_ns", "collective_ns", "data_wait_ns", "gap_ns", "gap_p2p_ns", "gap_coll_ns", "send_min_ns",
                     "sends", "recv_min_ns", "n_events", "first_start_ns", "last_end_ns")
P2P_STEP_COLUMNS = ("rank", "step", "peer", "sends", "send_min_ns", "recv_min_ns", "gap_p2p_ns")
"""What the p2p analyses (p2p_links.sql, p2p_stalls.sql) read of the per (rank, step, p2p peer) rows: the
run-wide table `_p2p_peer_step` keeps only these columns, and only rows of a p2p peer (at 12,288 ranks x
1,000 steps: 21.5 M rows x 7 columns instead of 33.8 M x 18, which spilled past DuckDB's memory limit)."""
_P2P_SELECT = ", ".join(f'"{c}"' for c in P2P_STEP_COLUMNS)
PARTIAL_COLUMNS = ("group", "instance", "seq", "first_step", "op_name", "n_events", "last_rank", "last_issue_ns",
                   "issue_sum_ms", "last_end_ns")
_TABLES = frozenset({
    "rank_step", "rank_step_incomplete", "_p2p_peer_step", "_collective_partials", "collective_instances",
    "late_arrivals", "_summary_rank_step", "_summary_rank_step_incomplete", "_summary_partials",
    "_summary_collectives", "_summary_late", "_incomplete_ranges", *BATCH_TABLES})
"""Every table the functions here create, append to or delete from: names are checked against it."""

Progress = Callable[[str, int, int], None]


def _table(name: str) -> str:
    """`name` as an identifier, when it is one of the analyzer's derived tables (never free text)."""
    if name not in _TABLES:
        raise ValueError(f"event_pass: '{name}' is not one of the analyzer's derived tables")
    return name


def library_sql() -> list[str]:
    """The text of every macro of the library, in definition order: the edge macros, then the analyzer's."""
    return [edge_sql(name) for name in EDGE_SQL] + [load_sql(name) for name in SQL_FILES]


def define_sql(store: Store) -> None:
    """(Re)define the macro library on the store's connection (TEMP: per connection; idempotent)."""
    for text in library_sql():
        store.con.execute(text)


@dataclass(frozen=True)
class LayoutParams:
    """What group_instance.sql needs of the topology: sizes, and for ranks not numbered in Megatron
    order the Megatron rank of each rank's coordinates (indexed by rank)."""
    dp: int
    tp: int
    cp: int
    renumber: tuple[int, ...] | None = None
    pp: int = 1
    world: int = 0
    """pp and the ranks in the topology: with dp, tp and cp the sizes of the group instances (group_size.sql)."""

    @classmethod
    def of(cls, store: Store) -> LayoutParams:
        topo = store.manifest["topology"]
        dp, tp, cp = int(topo["dp"]), int(topo["tp"]), int(topo.get("cp", 1))  # no cp in run.json: cp = 1
        frame = store.topology
        pp, world = int(topo.get("pp", 1)), len(frame)
        if is_regular(frame, dp, tp, cp):
            return cls(dp, tp, cp, None, pp, world)
        megatron = Layout(dp=dp, tp=tp, pp=1, cp=cp).rank_of(frame.pp, frame.dp, frame.tp, frame["cp"])
        renumber = [-1] * (int(frame["rank"].max()) + 1)
        for rank, m in zip(frame["rank"].astype(int), np.asarray(megatron, dtype=np.int64)):
            renumber[rank] = int(m)
        return cls(dp, tp, cp, tuple(renumber), pp, world)

    def params(self) -> dict[str, Any]:
        """group_instance.sql's layout parameters."""
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp,
                "renumber": None if self.renumber is None else list(self.renumber)}

    def sizes(self) -> dict[str, int]:
        """group_size.sql's parameters."""
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp, "pp": self.pp, "world": self.world}


@dataclass(frozen=True)
class PassPlan:
    """What every batch of one pass shares: small, so a remote engine ships it with each task."""
    base: int
    """Time origin, ns (run_start_ns)."""
    timeline: bool
    """The timeline variant (a window per rank-step) rather than the flat one."""
    async_ops: bool
    """The trace has `<op>.wait` rows (has_wait_spans)."""
    layout: LayoutParams
    first_step: int = NO_FIRST_STEP
    """Only steps from here on (the summary cache's extension of a live run)."""
    edge: bool = False
    """The batches read the ranks' summaries at the edge (scan_edge_batch), not their events."""


@dataclass(frozen=True)
class PassTables:
    """Where a pass's batches accumulate (each a name of `_TABLES`); p2p_step None: not kept."""
    rank_step: str
    p2p_step: str | None
    """The p2p rows of the batches' per (rank, step, peer) rows, P2P_STEP_COLUMNS only."""
    partials: str
    """The partial rows of collective instances that span batches, merged after the last batch."""
    collectives: str
    """The collective instances: those whole in one batch as it comes, then the merged partials."""


EVENT_PASS_TABLES = PassTables("rank_step", "_p2p_peer_step", "_collective_partials", "collective_instances")


def plan_pass(store: Store, timeline: bool | None = None, first_step: int | None = None) -> PassPlan:
    """The plan of a pass over `store`'s run; `timeline` None: decided here (small runs always take
    the timeline; big ones when a sample needs it)."""
    define_sql(store)
    base = run_start_ns(store)
    if timeline is None:
        timeline = len(store.topology) <= TIMELINE_ALWAYS_RANKS or needs_timeline(store, base)
    return PassPlan(base, bool(timeline), has_wait_spans(store), LayoutParams.of(store),
                    NO_FIRST_STEP if first_step is None else int(first_step))


# ---- the batch function: one batch of ranks, its events and steps read once --------------------------

def scan_batch(store: Store, prefixes: list[str] | None, plan: PassPlan) -> None:
    """Create `_batch_rank_step`, `_batch_peer_step` and `_batch_partials` from the events and steps
    segments of one batch (rank-folder patterns, Store.rank_prefix_batches; None: all ranks). Raw
    DuckDB calls, rebuilt as a whole by Store.run_with_retry when a damaged segment is dropped."""
    con = store.con
    store.source_view("_batch_events_src", "events", patterns=prefixes)
    store.source_view("_batch_steps_src", "steps", patterns=prefixes)
    _event_pass(store, "_batch_events_src", plan)
    # every batch holds whole ranks: its rank_step rows need no other batch
    con.execute("CREATE OR REPLACE TEMP TABLE _batch_rank_step AS "
                "FROM rank_step_of('_batch_steps_src', '_batch_peer_step', $first_step, $residual)",
                {"first_step": plan.first_step, "residual": not plan.timeline})
    con.execute("DROP VIEW _batch_events_src")
    con.execute("DROP VIEW _batch_steps_src")


def scan_edge_batch(store: Store, prefixes: list[str] | None, plan: PassPlan) -> None:
    """The batch function on summaries at the edge: `_batch_rank_step` (with its `final` column),
    `_batch_peer_step` (the p2p rows, P2P_STEP_COLUMNS) and `_batch_partials` from one batch's
    edge_rank_step, edge_peer_step and edge_collectives segments. What from_edge_summaries reads in
    this process, in batches a remote engine can run."""
    con = store.con
    store.source_view("_batch_rank_step_src", "edge_rank_step", patterns=prefixes)
    con.execute("CREATE OR REPLACE TEMP TABLE _batch_rank_step AS FROM rank_step_of_edge('_batch_rank_step_src')")
    store.source_view("_batch_peer_step_src", "edge_peer_step", patterns=prefixes)
    con.execute(f"CREATE OR REPLACE TEMP TABLE _batch_peer_step AS SELECT {_P2P_SELECT} FROM _batch_peer_step_src "
                "WHERE peer >= 0")
    con.execute("DROP VIEW _batch_rank_step_src")
    con.execute("DROP VIEW _batch_peer_step_src")
    _edge_partials(store, prefixes, plan)


def _event_pass(store: Store, events: str, plan: PassPlan, partials: bool = True) -> None:
    """_batch_peer_step and _batch_partials from the relation `events` (a source view of scan_batch or
    needs_timeline), with the plan's variant."""
    con = store.con
    layout = plan.layout.params()
    if plan.timeline:
        con.execute("CREATE OR REPLACE TEMP TABLE _batch AS FROM event_pass_timeline($events, $first_step, $base, "
                    "$async_ops, $wait_suffix, $dp, $tp, $cp, $renumber)",
                    {"events": events, "first_step": plan.first_step, "base": plan.base, "async_ops": plan.async_ops,
                     "wait_suffix": WAIT_SUFFIX, **layout})
        # keep only what each grouping needs: the wide rows would fill DuckDB's memory
        con.execute("CREATE OR REPLACE TEMP TABLE _batch_peer_step AS SELECT "
                    + ", ".join(f'"{c}"' for c in PEER_STEP_COLUMNS) + " FROM _batch WHERE gset = 0")
        if partials:
            con.execute("CREATE OR REPLACE TEMP TABLE _batch_partials AS SELECT "
                        + ", ".join(f'"{c}"' for c in PARTIAL_COLUMNS) + " FROM _batch WHERE gset = 1 "
                        "AND instance IS NOT NULL")
        con.execute("DROP TABLE _batch")
        return
    # flat: the batch's events copied once into a narrow table, aggregated twice from memory
    con.execute("CREATE OR REPLACE TEMP TABLE _batch_events AS "
                "FROM event_pass_flat_events($events, $first_step, $async_ops, $wait_suffix)",
                {"events": events, "first_step": plan.first_step, "async_ops": plan.async_ops,
                 "wait_suffix": WAIT_SUFFIX})
    # an op with a `<op>.wait` row (any step: a prefetched gather is waited in the next one) is hidden
    # communication: its wait is the exposed part (a join on the waits only: none on GPU/simulated traces)
    con.execute("""UPDATE _batch_events e SET comm = false
        FROM (SELECT DISTINCT rank, "group", seq, peer, role - 5 AS op_role FROM _batch_events
              WHERE role BETWEEN 11 AND 14) w
        WHERE e.role = w.op_role AND e.rank = w.rank AND e."group" = w."group" AND e.seq = w.seq
              AND e.peer = w.peer""")
    con.execute("CREATE OR REPLACE TEMP TABLE _batch_peer_step AS FROM flat_peer_step('_batch_events')")
    if partials:
        con.execute("CREATE OR REPLACE TEMP TABLE _batch_partials AS "
                    "FROM flat_partials('_batch_events', $base, $dp, $tp, $cp, $renumber)",
                    {"base": plan.base, **layout})
    con.execute("DROP TABLE _batch_events")


# ---- engines: where the batch function runs -------------------------------------------------------

class Engine(Protocol):
    """Runs the batch function over every batch; after each yield, the batch's three tables are
    relations named BATCH_TABLES on `store.con` (the loop appends them, then resumes the engine)."""

    def map_batches(self, store: Store, batches: list[list[str] | None], plan: PassPlan) -> Iterator[int]: ...


class LocalEngine:
    """The embedded default: each batch in this process's DuckDB, one after the other."""

    def map_batches(self, store: Store, batches: list[list[str] | None], plan: PassPlan) -> Iterator[int]:
        scan = scan_edge_batch if plan.edge else scan_batch
        for i, prefixes in enumerate(batches):
            # the reads, rebuilt on retry (a damaged segment dropped from the batch's source)
            store.run_with_retry(lambda: scan(store, prefixes, plan))
            yield i


def run_batches(store: Store, plan: PassPlan, out: PassTables, engine: Engine | None = None,
                progress: Progress | None = None, label: str = "scanning events") -> None:
    """The one batch loop: the batch function over every batch of ranks (by `engine`, local by
    default), each batch's tables appended to `out`'s; then the partials of collective instances that
    spanned batches are merged into `out.collectives` (merge_partials)."""
    prefixes = store.rank_prefix_batches(BATCH_RANKS, *((EDGE_TASK_TABLES,) if plan.edge else ()))
    batches: list[list[str] | None] = [*prefixes] if prefixes else [None]
    if progress is not None:
        progress(label, 0, len(batches))
    for done, _ in enumerate((engine or LocalEngine()).map_batches(store, batches, plan)):
        _append(store, out.rank_step, "SELECT * FROM _batch_rank_step", {}, create=done == 0)
        if out.p2p_step is not None:
            _append(store, out.p2p_step, f"SELECT {_P2P_SELECT} FROM _batch_peer_step WHERE peer >= 0", {},
                    create=done == 0)
        split_partials(store, "_batch_partials", out, plan, create=done == 0)
        if progress is not None:
            progress(label, done + 1, len(batches))
    merge_partials(store, out, plan.base)
    drop_batch_partials(store)
    for table in (*BATCH_TABLES, "_batch", "_batch_events"):
        store.execute(f"DROP TABLE IF EXISTS {table}")


def _append(store: Store, target: str, select: str, params: dict[str, Any], create: bool) -> None:
    """Append the rows of `select` to the table `target` (`create`: the first rows, (re)create it)."""
    verb = "CREATE OR REPLACE TEMP TABLE {} AS " if create else "INSERT INTO {} "
    store.execute(verb.format(_table(target)) + select, params)


def split_partials(store: Store, batch: str, out: PassTables, plan: PassPlan, create: bool) -> None:
    """One batch's partial rows of collective instances (flat_partials.sql's columns): those that hold
    every member of their instance are finished instances (complete_instances.sql), appended to
    `out.collectives` as they come; the others wait in `out.partials` for merge_partials. On the
    12,288-rank x 1,000-step edge run 99.5% of the instances (tensor-parallel groups lie on one host,
    so in one batch) skip the merge: one 24.7M-group aggregation that spilled past DuckDB's memory
    limit became 13 batch-sized ones (35 s -> 24 s)."""
    sizes = plan.layout.sizes()
    _append(store, out.collectives, "FROM complete_collective_instances($batch, $base, $dp, $tp, $cp, $pp, $world)",
            {"batch": _table(batch), "base": plan.base, **sizes}, create)
    _append(store, out.partials, 'SELECT * FROM query_table($batch) '
            'WHERE n_events IS DISTINCT FROM group_size("group", $dp, $tp, $cp, $pp, $world)',
            {"batch": _table(batch), **sizes}, create)


def merge_partials(store: Store, out: PassTables, base: int) -> None:
    """Append to `out.collectives` the instances whose members were spread over batches: `out.partials`
    merged (collectives.sql), then dropped."""
    store.execute(f"INSERT INTO {_table(out.collectives)} FROM collective_instances_of($partials, $base)",
                  {"partials": _table(out.partials), "base": int(base)})
    store.execute(f"DROP TABLE {_table(out.partials)}")


# ---- derived tables, by name -------------------------------------------------------------------------

def build_event_pass(store: Store, progress: Progress | None = None, engine: Engine | None = None) -> bool:
    """Create the temp tables `rank_step`, `_p2p_peer_step` and `collective_instances`: per batch of
    ranks, one read of its events (aggregated per rank-step-peer and per collective) and of its steps
    (joined into the batch's rank_step rows), appended to the run-wide tables. The rank-steps of
    damaged segments go to `rank_step_incomplete` instead (drop_incomplete). A run whose ranks wrote
    summaries at the edge for every rank-step (edge_summaries_cover) is read from those instead.
    Returns whether the rows are the timeline variant's (the edge summaries' are)."""
    timeline, covered = True, False
    if _edge_readable(store):
        if engine is not None:  # its batches of the summaries spread over the engine
            covered = from_edge_summaries_by(store, run_start_ns(store), engine, progress)
        else:
            if progress is not None:
                progress("reading the ranks' summaries", 0, 1)
            covered = from_edge_summaries(store, run_start_ns(store))
            if progress is not None:
                progress("reading the ranks' summaries", 1, 1)
    if not covered:
        plan = plan_pass(store)
        timeline = plan.timeline
        run_batches(store, plan, EVENT_PASS_TABLES, engine, progress)
    drop_incomplete(store, "rank_step", "_p2p_peer_step", "collective_instances")
    return timeline


def _edge_readable(store: Store) -> bool:
    """The run has edge summaries, no segment was found damaged, and no rank restarted (a repeated
    step is summarized by each attempt)."""
    return bool(store.files["edge_rank_step"]) and not store.damaged and not store.attempt_bounds


def _summarized_ranks(store: Store) -> int:
    """Ranks whose summaries must be there: those with a steps segment (its folder; no file is read)."""
    return len({os.path.basename(os.path.dirname(f)) for f in store.files["steps"]})


def edge_summaries_cover(store: Store) -> bool:
    """Whether the ranks' own summaries (tracer/edge_summary.py) can stand for the run's events: every
    rank with a steps segment wrote its last summary (a `final` edge_rank_step row: at close, with every
    steps row it wrote summarized), no segment was found damaged, and no rank restarted. Runs the tracer
    did not write (simulated, imported), a rank killed before close and a rank whose summaries stopped
    have no final row. The steps table itself is not read: on a 12,288-rank run its 37k-86k files took
    10-14 s to join. (build_event_pass makes the same check on the rank_step rows it read, not here:
    a second scan of edge_rank_step's files was 3 s of the 12,288 x 1,000 pass.)"""
    if not _edge_readable(store):
        return False
    done = store.query("SELECT count(DISTINCT rank) AS n FROM edge_rank_step WHERE final").n.iloc[0]
    return int(done) == _summarized_ranks(store) > 0


def from_edge_summaries(store: Store, base: int) -> bool:
    """The event pass's tables from the edge summaries, when they cover the run (edge_summaries_cover,
    checked on the rank_step rows read here: one scan of edge_rank_step): collective_instances from the
    ranks' collective rows, per batch of ranks (edge_collectives.sql: the flat pass's partial rows in one
    aggregation of the batch's members; then split_partials and merge_partials, as the event pass),
    rank_step (joined to the topology), and _p2p_peer_step from the ranks' peer rows (a table: the p2p
    analyses scan it three times; as a view of the 24k files at 12,288 x 1,000 those scans took 50 s
    instead of 26). Returns False, leaving no table, when they do not cover it (or a damaged segment was
    found in them: the raw events are the truth then)."""
    define_sql(store)
    # the collectives first, while DuckDB holds no other table: after rank_step (2.4 GB uncompressed at
    # 12,288 x 1,000, near the 2.5 GB limit) the 13 batches' aggregations took 60-70 CPU s (4 runs),
    # first 52-62 (3 runs); the whole pass 84-98 CPU s, first 81-87 (load 5-12). A run the summaries
    # do not cover (a rank killed before close) loses that work to the raw pass that follows.
    plan = PassPlan(int(base), True, False, LayoutParams.of(store))
    prefixes = store.rank_prefix_batches(BATCH_RANKS, ("edge_collectives",))
    batches: list[list[str] | None] = [*prefixes] if prefixes else [None]
    ahead = _partials_ahead(store, batches, plan)
    try:
        for i, batch in enumerate(batches):
            store.run_with_retry(lambda: _edge_partials(store, batch, plan, ahead))
            split_partials(store, "_batch_partials", EVENT_PASS_TABLES, plan, create=i == 0)
    finally:
        if ahead is not None:
            ahead.close()
    merge_partials(store, EVENT_PASS_TABLES, plan.base)
    drop_batch_partials(store)
    if store.damaged:  # found in edge_collectives: a member's rows are missing
        return _drop_edge_tables(store)
    store.execute("CREATE OR REPLACE TEMP TABLE rank_step AS FROM rank_step_of_edge('edge_rank_step')")
    done = store.query("SELECT count(DISTINCT rank) AS n FROM rank_step WHERE final").n.iloc[0]
    if not (_edge_readable(store) and int(done) == _summarized_ranks(store) > 0):
        return _drop_edge_tables(store)
    store.execute("ALTER TABLE rank_step DROP COLUMN final")  # rank_step.sql's columns (instant)
    store.execute(f"CREATE OR REPLACE TEMP TABLE _p2p_peer_step AS SELECT {_P2P_SELECT} FROM edge_peer_step "
                  "WHERE peer >= 0")
    return not store.damaged or _drop_edge_tables(store)


def _drop_edge_tables(store: Store) -> bool:
    """Drop what from_edge_summaries made so far; False (the summaries do not stand for the run)."""
    for name in ("rank_step", "_p2p_peer_step", "collective_instances"):
        store.execute(f"DROP TABLE IF EXISTS {_table(name)}")
    return False


def from_edge_summaries_by(store: Store, base: int, engine: Engine, progress: Progress | None = None) -> bool:
    """from_edge_summaries with the batches run by `engine` (scan_edge_batch per batch of ranks: a Ray
    task reads its batch's summaries and returns its rows), appended and merged by the one batch loop
    (run_batches). The same tables, the same checks."""
    define_sql(store)
    plan = PassPlan(int(base), True, False, LayoutParams.of(store), edge=True)
    run_batches(store, plan, EVENT_PASS_TABLES, engine, progress, label="reading the ranks' summaries")
    done = store.query("SELECT count(DISTINCT rank) AS n FROM rank_step WHERE final").n.iloc[0]
    if store.damaged or not (_edge_readable(store) and int(done) == _summarized_ranks(store) > 0):
        for name in ("rank_step", "_p2p_peer_step", "collective_instances"):
            store.execute(f"DROP TABLE IF EXISTS {_table(name)}")
        return False
    store.execute("ALTER TABLE rank_step DROP COLUMN final")
    return True


def _partials_ahead(store: Store, batches: list[list[str] | None], plan: PassPlan) -> PartialsAhead | None:
    """Worker processes computing the batches' numpy partials ahead (partials_ahead.py), one per DuckDB
    thread, when at least two batches take the numpy path; None: every batch computed here."""
    if store.attempt_bounds or store.threads < 2:
        return None
    jobs = [files for files in (store.batch_files("edge_collectives", b) for b in batches) if numpy_pays(files)]
    if len(jobs) < 2:
        return None
    layout = plan.layout
    return PartialsAhead(jobs, (plan.base, layout.dp, layout.tp, layout.cp, layout.renumber), store.temp_folder,
                         min(store.threads, len(jobs)))


def _edge_partials(store: Store, prefixes: list[str] | None, plan: PassPlan,
                   ahead: PartialsAhead | None = None) -> None:
    """`_batch_partials` from the edge_collectives rows of one batch of ranks (raw DuckDB calls: the
    action of run_with_retry, rebuilt when a damaged segment is dropped): in numpy (edge_partials.py:
    the same rows as the macro, ~35% less CPU on 1,000-step segments), or by the macro where that does
    not pay (small segments) or apply (a segment pyarrow cannot read: the macro's read finds it damaged
    and the retry drops it). scan_edge_batch's: the numpy path's Arrow table is registered under the
    name, not copied into a table (the copy was 0.6-0.7 CPU s of 4 batches at 3,072 x 1,000, 2.6 of 13
    at 12,288; split_partials' two scans and a Ray task's conversion to Arrow read it as cheaply as a
    table); drop_batch_partials lets it go."""
    drop_batch_partials(store)
    partials = _numpy_partials(store, prefixes, plan, ahead)
    if partials is None:
        _macro_partials(store, prefixes, plan)
        return
    store.con.register("_batch_partials", partials)


def drop_batch_partials(store: Store) -> None:
    """Drop `_batch_partials`, a registered Arrow table (_edge_partials) or a table (unregister leaves a
    table alone; DROP TABLE refuses a registered one), and hand its buffers back (release_unused)."""
    store.con.unregister("_batch_partials")
    store.con.execute("DROP TABLE IF EXISTS _batch_partials")
    release_unused()


def _numpy_partials(store: Store, prefixes: list[str] | None, plan: PassPlan,
                    ahead: PartialsAhead | None = None) -> pa.Table | None:
    """The batch's partial rows by edge_partials.py (a worker's from `ahead`, when it has them); None
    where that does not pay or apply."""
    layout, files = plan.layout, store.batch_files("edge_collectives", prefixes)
    if store.attempt_bounds or not numpy_pays(files):
        return None
    if ahead is not None:
        return ahead.partials(files)
    return partials_of_files(files, plan.base, layout.dp, layout.tp, layout.cp, layout.renumber)


def _macro_partials(store: Store, prefixes: list[str] | None, plan: PassPlan) -> None:
    """`_batch_partials` by the SQL macro (collective_partials_of_members); raw DuckDB calls."""
    store.source_view("_batch_collectives_src", "edge_collectives", patterns=prefixes)
    store.con.execute("CREATE OR REPLACE TEMP TABLE _batch_partials AS FROM collective_partials_of_members("
                      "'_batch_collectives_src', $base, $dp, $tp, $cp, $renumber)",
                      {"base": plan.base, **plan.layout.params()})
    store.con.execute("DROP VIEW _batch_collectives_src")


def late_arrivals(store: Store, collectives: str = "collective_instances", out: str = "late_arrivals") -> None:
    """`out` = per rank and step, the collectives it arrived at last, and how late (arrivals.sql)."""
    define_sql(store)
    store.execute(f"CREATE OR REPLACE TEMP TABLE {_table(out)} AS FROM late_arrivals_of($collectives, $min_s)",
                  {"collectives": _table(collectives), "min_s": MIN_LATENESS_S})


def drop_incomplete(store: Store, rank_step: str, p2p_step: str | None, collectives: str) -> int:
    """Move the rank-steps a damaged events or steps segment may have held (Store.incomplete_ranges)
    out of `rank_step` into `<rank_step>_incomplete`, and delete their p2p rows (`p2p_step`, either
    end) and the collective instances they were members of (incomplete.sql), so no detector judges a
    rank on part of its events. Returns the number of rank-step rows moved."""
    rank_step, collectives = _table(rank_step), _table(collectives)
    moved = _table(f"{rank_step}_incomplete")
    ranges = store.incomplete_ranges()
    if ranges.empty:
        store.execute(f"CREATE OR REPLACE TEMP TABLE {moved} AS SELECT * FROM {rank_step} WHERE false")
        return 0
    define_sql(store)
    store.con.register("_incomplete_ranges_df", ranges[["rank", "first_step", "last_step"]])
    store.execute("CREATE OR REPLACE TEMP TABLE _incomplete_ranges AS SELECT * FROM _incomplete_ranges_df")
    store.con.unregister("_incomplete_ranges_df")
    within = ("EXISTS (SELECT 1 FROM _incomplete_ranges i WHERE i.rank = r.rank "
              "AND r.step BETWEEN i.first_step AND i.last_step)")
    store.execute(f"CREATE OR REPLACE TEMP TABLE {moved} AS SELECT * FROM {rank_step} r WHERE {within}")
    store.execute(f"DELETE FROM {rank_step} r WHERE {within}")
    if p2p_step is not None:  # both ends of a p2p link must be complete
        store.execute(f"""DELETE FROM {_table(p2p_step)} p WHERE EXISTS (SELECT 1 FROM _incomplete_ranges i
            WHERE (i.rank = p.rank OR i.rank = p.peer) AND p.step BETWEEN i.first_step AND i.last_step)""")
    store.execute(f"""DELETE FROM {collectives} c WHERE EXISTS (
        SELECT 1 FROM incomplete_collectives('_incomplete_ranges', $groups, $dp, $tp, $cp, $renumber) k
        WHERE k."group" = c."group" AND k.instance = c.instance AND c.step BETWEEN k.first_step AND k.last_step)""",
                  {"groups": list(MATCHED_GROUPS), **LayoutParams.of(store).params()})
    store.execute("DROP TABLE _incomplete_ranges")
    return int(store.query(f"SELECT count(*) AS n FROM {moved}").n.iloc[0])


# ---- what the plan is decided from ---------------------------------------------------------------

def has_wait_spans(store: Store) -> bool:
    """Whether the trace has `<op>.wait` rows: the CPU tracer's (gloo), whose p2p ops end when the host
    called wait(), not when the bytes arrived. The first rank's events are checked (a few files)."""
    first = store.table_source("events", [int(store.topology["rank"].iloc[0])])
    row = store.query(f"SELECT count(*) AS n FROM (SELECT 1 FROM {first} WHERE kind = 'host' "
                      "AND ends_with(name, $suffix) LIMIT 1)", {"suffix": WAIT_SUFFIX})
    return bool(len(row) and int(row.n.iloc[0]) > 0)


def needs_timeline(store: Store, base: int, tolerance: float = 0.01) -> bool:
    """Does this trace need the timeline (a sort of 10^8 events on big runs)? Run both variants on a
    sample of ranks (every stage, a few replicas): the sort-free one is exact when no span nests in
    compute and the step residual equals the timeline's gaps (no async span hides or fakes host
    time), within `tolerance` of the step on 99% of the sampled rank-steps."""
    topo = store.topology
    picks = topo.groupby("pp")["rank"].apply(lambda r: list(r.iloc[:: max(1, len(r) // 4)][:4]))
    sample = sorted(int(r) for ranks in picks for r in ranks)[:SAMPLE_RANKS]
    define_sql(store)
    async_ops = has_wait_spans(store)
    sums = ("SELECT rank, step, sum(nested_ns) AS nested_ns, sum(gap_ns) AS gap_ns, "
            "sum(compute_ns + recv_ns + collective_ns + data_wait_ns) AS covered_ns FROM _batch_peer_step GROUP BY ALL")

    def sample_sums() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        store.source_view("_sample_events", "events", ranks=sample)
        store.source_view("_sample_steps", "steps", ranks=sample)
        frames = []
        for timeline in (True, False):
            _event_pass(store, "_sample_events", PassPlan(base, timeline, async_ops, LayoutParams.of(store)),
                        partials=False)
            frames.append(store.con.execute(sums).df().set_index(["rank", "step"]).sort_index())
        steps = store.con.execute("SELECT rank, step, end_ns - start_ns AS step_ns FROM _sample_steps").df()
        store.con.execute("DROP TABLE _batch_peer_step")
        store.con.execute("DROP VIEW _sample_events")
        store.con.execute("DROP VIEW _sample_steps")
        return frames[0], frames[1], steps.set_index(["rank", "step"])

    timeline, flat, steps = store.run_with_retry(sample_sums)
    tl = timeline.join(steps, how="inner")
    if tl.empty or (tl.nested_ns > 0).any():
        return True
    residual = (tl.step_ns - flat.covered_ns.reindex(tl.index)).clip(lower=0)
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
