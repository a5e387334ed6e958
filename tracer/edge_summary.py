"""Summaries at the edge: each rank's tracer turns its own events into the rows the analyzer's event
pass derives from them, with the same macros (tracer/sql/), so that the central analysis of a big job
reads O(ranks x steps) rows instead of every event (analyzer/data/event_pass.py reads them when every rank
wrote its last summary, and the raw events otherwise).

Three tables beside the events (tracer/schema.py EDGE, docs/schema.md):
  edge_rank_step    one row per step: rank_step.sql's columns, less the topology's (pp, dp, tp, host)
  edge_peer_step    per step and p2p peer: event_pass.sql's per (rank, step, peer) rows (peer_step_timeline.sql)
  edge_collectives  the rank's collective ops, issue and end: late arrivals' inputs, merged across
                    ranks centrally (analyzer/data/sql/edge_collectives.sql: one aggregation of all members)

A step is summarized once LAG_STEPS later steps have a steps row (GPU-timed events are resolved after
the step, and an async op's `.wait` may come in the next step: it decides whether the op counts), or
when the tracer closes (those last rows are marked `final`: every steps row the rank wrote is then
summarized); its events are held until then (a few steps of one rank), and the summaries until
SEGMENT_STEPS steps of them make one segment per table (or the tracer closes). The rows are the
timeline pass's (the variant every run of up to 2,048 ranks takes), its per (rank, step, peer) grouping
alone (tracer/sql/peer_step_timeline.sql: the collective partials are merged centrally from the member
rows, not here). Nothing here raises into the
flusher: the raw events are written first and stay the truth; a failure is logged and counted, and a
rank whose summaries miss a step only sends the analyzer back to the raw events."""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from megascope.tracer.schema import EDGE, EVENTS, STEPS, WAIT_SUFFIX
from megascope.tracer.sink import ParquetSegmentSink, Sink

log = logging.getLogger("megascope.tracer")

EDGE_SQL = ("event_role", "group_instance", "event_timeline", "event_pass", "peer_step_timeline", "rank_step")
"""The macros a rank runs on its own events (tracer/sql/, in definition order); the analyzer defines
them first too (event_pass.define_sql), so both sides compute the same rows."""
LAG_STEPS = 2
"""A step is summarized when the steps row of the step this many later has been written."""
NO_FIRST_STEP = -(1 << 62)
"""first_step of a whole pass: every step (the macros' `first_step` argument)."""
_HOUR_NS = 3_600_000_000_000
_PEER_COLUMNS = [f.name for f in EDGE["edge_peer_step"]]
_EDGE_COLUMNS = ["first_start_ns", "last_end_ns"]
"""Read by rank_step_of (the step's edges: host time before the first span and after the last), not written."""
_RANK_STEP_COLUMNS = [f.name for f in EDGE["edge_rank_step"] if f.name != "final"]
WRITE_ORDER = ("edge_peer_step", "edge_collectives", "edge_rank_step")
"""edge_rank_step last: its rows say a step's summary is complete, its `final` rows that the rank's are."""
SEGMENT_STEPS = 1000
"""Summaries are written once this many steps are held (and at close): one segment per table per 1,000
steps, not one per flush. The flusher runs every 5 s, so a 1,000-step run of ~1 s steps wrote ~170
segments per rank and table, and the central analysis opens every file (~0.1 ms of CPU each: 6 M files,
~10 min, at 12,288 ranks; the 24,576 files a table of the benchmark's case took 2.5 CPU s just to open).
The analyzer reads the summaries only once every rank has closed (its `final` rows), so holding them
loses nothing: a rank killed before close sends the analysis to the raw events either way. Held:
~2 KB a step (rank_step, peer and collective rows), ~2 MB per rank."""


def edge_sql(name: str) -> str:
    """Text of tracer/sql/<name>.sql."""
    return resources.files("megascope.tracer.sql").joinpath(f"{name}.sql").read_text()


def define_edge_sql(con: Any) -> None:
    """(Re)define the edge macros on a DuckDB connection (TEMP: per connection; idempotent)."""
    for name in EDGE_SQL:
        con.execute(edge_sql(name))


def summarize(con: Any, ranks: list[int], events: pa.Table, steps: pa.Table, through: int,
              async_ops: bool, final: bool) -> dict[str, pa.Table]:
    """The edge tables of some ranks' steps up to `through` (inclusive), from their `events` and `steps`
    rows (tracer/schema.py EVENTS, STEPS; events of later steps may be included: a wait in the next
    step is read). `con`: a DuckDB connection with the edge macros defined. `async_ops`: the trace has
    `<op>.wait` rows (event_pass.sql). `final`: these are the ranks' last summaries, after which every
    steps row they wrote is summarized (edge_rank_step's `final` column)."""
    starts = pc.min(events["start_ns"]).as_py() if events.num_rows else None
    base = (starts if starts is not None else 0) - _HOUR_NS  # any origin: the rows do not depend on it
    con.register("_edge_events", events)
    con.register("_edge_steps_all", steps)
    try:
        con.execute("CREATE OR REPLACE TEMP TABLE _edge_steps AS FROM _edge_steps_all WHERE step <= $through",
                    {"through": through})
        # rank_step_of joins the topology: a stand-in row here, the analyzer joins the real one
        con.execute("CREATE OR REPLACE TEMP TABLE topology AS SELECT unnest($ranks)::INT AS rank, -1 AS pp, "
                    "-1 AS dp, -1 AS tp, ''::VARCHAR AS host", {"ranks": [int(r) for r in ranks]})
        con.execute("CREATE OR REPLACE TEMP TABLE _edge_peer AS SELECT "
                    + ", ".join(f'"{c}"' for c in _PEER_COLUMNS + _EDGE_COLUMNS)
                    + " FROM peer_step_timeline('_edge_events', $first, $base, $async_ops, $wait_suffix) "
                    "WHERE step <= $through",
                    {"first": NO_FIRST_STEP, "base": base, "async_ops": async_ops, "wait_suffix": WAIT_SUFFIX,
                     "through": through})
        out = {
            "edge_peer_step": con.sql("SELECT " + ", ".join(f'"{c}"' for c in _PEER_COLUMNS)
                                      + " FROM _edge_peer ORDER BY rank, step, peer").to_arrow_table(),
            "edge_collectives": con.sql(
                'SELECT rank, step, "group", seq, name AS op_name, start_ns, end_ns FROM _edge_events '
                "WHERE kind = 'collective' AND step <= $through ORDER BY rank, step, start_ns",
                params={"through": through}).to_arrow_table(),
            "edge_rank_step": con.sql(
                "SELECT " + ", ".join(_RANK_STEP_COLUMNS) + ", $final AS final FROM rank_step_of("
                "'_edge_steps', '_edge_peer', $first, false) ORDER BY rank, step",
                params={"first": NO_FIRST_STEP, "final": final}).to_arrow_table(),
        }
    finally:
        con.unregister("_edge_events")
        con.unregister("_edge_steps_all")
    return {name: table.cast(EDGE[name]) for name, table in out.items()}


class EdgeSummarizer:
    """Holds one rank's events and steps rows until their steps are complete, and summarizes them.
    Once an event arrives for a step already summarized (a GPU timing resolved very late), the rank's
    summaries stop: a summary that misses events must not stand for them (the analyzer then reads the
    raw events of the run)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.done_through: int | None = None
        """The last step summarized."""
        self.stopped = False
        self._events: list[pa.Table] = []
        self._steps: list[pa.Table] = []
        self._async_ops = False
        self._con: Any = None

    def add(self, table: str, batch: pa.Table) -> None:
        if self.stopped or batch.num_rows == 0:
            return
        if self.done_through is not None and pc.min(batch["step"]).as_py() <= self.done_through:
            self.stopped = True
            log.warning("tracer: rank %d recorded %s of step %d after its summary was written; edge summaries "
                        "stop for this rank (the analyzer reads its raw events instead)", self.rank, table,
                        pc.min(batch["step"]).as_py())
            self._events, self._steps = [], []
            return
        if table == "events":
            self._events.append(batch)
            if not self._async_ops:
                self._async_ops = bool(pc.any(pc.and_(pc.equal(batch["kind"], "host"),
                                                      pc.ends_with(batch["name"], WAIT_SUFFIX))).as_py())
        elif table == "steps":
            self._steps.append(batch)

    def ready(self, final: bool = False) -> dict[str, pa.Table] | None:
        """The edge tables of the steps complete now (every held step when `final`); None: none yet."""
        if self.stopped or not (self._steps or final and self._events):
            return None
        events = pa.concat_tables(self._events) if self._events else EVENTS.empty_table()
        steps = pa.concat_tables(self._steps) if self._steps else STEPS.empty_table()
        last = [pc.max(t["step"]).as_py() for t in (events, steps) if t.num_rows]
        if not last:  # nothing held (the held lists keep only the steps after the last summarized)
            return None
        if final:
            through = max(last)
        elif steps.num_rows:
            through = pc.max(steps["step"]).as_py() - LAG_STEPS
        else:
            return None
        if self.done_through is not None and through <= self.done_through:
            return None
        out = summarize(self.connect(), [self.rank], events, steps, through, self._async_ops, final)
        self._events = [events.filter(pc.greater(events["step"], through))]
        self._steps = [steps.filter(pc.greater(steps["step"], through))]
        self.done_through = through
        return out

    def connect(self) -> Any:
        """The DuckDB connection the summaries run on (one thread), made on first use."""
        if self._con is None:
            import duckdb

            self._con = duckdb.connect(config={"threads": 1})
            self._con.execute("SET enable_progress_bar=false")  # never a bar on the training job's stdout
            define_edge_sql(self._con)
        return self._con

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None


class SummarizingSink:
    """A sink that passes every batch on, then summarizes the steps each steps batch completed (and the
    rest at close), and writes the summaries once `segment_steps` steps are held, and at close. Summary
    rows that fail to write are kept and tried again at the next write; a failure to summarize is logged
    and counted (`errors`), never raised: the flusher must not take it for a failed write of the raw
    batch and write that twice."""

    def __init__(self, inner: Sink, rank: int, segment_steps: int = SEGMENT_STEPS) -> None:
        self.inner = inner
        self.summarizer = EdgeSummarizer(rank)
        self.segment_steps = max(1, segment_steps)
        self.errors = 0
        self._held: dict[str, list[pa.Table]] = {}
        """Summaries not yet written, per edge table (fewer than segment_steps steps of them)."""
        self._pending: list[tuple[str, pa.Table]] = []
        """Whole segments to write, in WRITE_ORDER; a failed write stays first for the next try."""
        try:
            # importing DuckDB and defining the macros holds the GIL ~0.1-0.3 s: pay it when the tracer
            # starts, not in a flush during training (as the flusher warms pyarrow up)
            self.summarizer.connect()
        except Exception as exc:  # noqa: BLE001 - no summaries, tracing goes on
            self._count(f"edge summaries are off for rank {rank}: {exc!r}")
            self.summarizer.stopped = True

    def write(self, table: str, batch: pa.Table) -> None:
        self.inner.write(table, batch)
        if table in ("events", "steps"):
            self._summarize(table, batch, final=False)

    def _summarize(self, table: str | None, batch: pa.Table | None, final: bool) -> None:
        try:
            if table is not None and batch is not None:
                self.summarizer.add(table, batch)
            tables = self.summarizer.ready(final) if final or table == "steps" else None
        except Exception as exc:  # noqa: BLE001 - monitoring never stops training
            self._count(f"summarizing rank {self.summarizer.rank}'s steps failed: {exc!r}")
            self.summarizer.stopped = True
            tables = None
        if tables:
            for name in WRITE_ORDER:
                if tables[name].num_rows:
                    self._held.setdefault(name, []).append(tables[name])
        held_steps = sum(t.num_rows for t in self._held.get("edge_rank_step", []))  # one row a step
        if self._held and (final or held_steps >= self.segment_steps):
            self._pending += [(name, pa.concat_tables(self._held.pop(name))) for name in WRITE_ORDER
                              if name in self._held]
        while self._pending:
            name, rows = self._pending[0]
            try:
                self.inner.write(name, rows)
            except Exception as exc:  # noqa: BLE001 - kept for the next write
                self._count(f"writing the {name} summary failed: {exc!r}; kept for the next flush")
                return
            self._pending.pop(0)

    def _count(self, message: str) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("tracer: %s (%d edge-summary errors so far; training continues)", message, self.errors)

    def close(self) -> None:
        self._summarize(None, None, final=True)
        self.summarizer.close()
        self.inner.close()


def summarize_run(run_dir: str | Path, batch_ranks: int = 256,
                  progress: Callable[[int, int], None] | None = None) -> int:
    """Write the edge tables of a local run recorded without them (simulated, imported, or traced with
    `edge_summaries` off), as its ranks' tracers would have at close: every step, from the run's events
    and steps segments, `batch_ranks` ranks at a time. Returns the number of ranks summarized.
    Raises FileExistsError when the run has edge tables already (they would be counted twice)."""
    import duckdb

    root = Path(run_dir)
    if any((root / name).exists() for name in EDGE):
        raise FileExistsError(f"{root} already has edge summaries ({', '.join(EDGE)})")
    folders = sorted({p.name for t in ("events", "steps") if (root / t).is_dir() for p in (root / t).glob("rank=*")})
    ranks = [int(f.split("=")[1]) for f in folders]
    con = duckdb.connect()
    define_edge_sql(con)
    for first in range(0, len(ranks), batch_ranks):
        batch = ranks[first:first + batch_ranks]
        events, steps = (_read_ranks(con, root, table, batch) for table in ("events", "steps"))
        async_ops = bool(events.num_rows) and bool(pc.any(pc.and_(pc.equal(events["kind"], "host"), pc.ends_with(
            events["name"], WAIT_SUFFIX))).as_py())
        last = [pc.max(t["step"]).as_py() for t in (events, steps) if t.num_rows]
        if last:
            tables = summarize(con, batch, events, steps, max(last), async_ops, final=True)
            for rank in batch:
                sink = ParquetSegmentSink(root, rank)
                for name in WRITE_ORDER:
                    rows = tables[name].filter(pc.equal(tables[name]["rank"], rank))
                    if rows.num_rows:
                        sink.write(name, rows)
        if progress is not None:
            progress(min(first + batch_ranks, len(ranks)), len(ranks))
    con.close()
    return len(ranks)


def _read_ranks(con: Any, root: Path, table: str, ranks: list[int]) -> pa.Table:
    """The rows of `table` of these ranks (their segments only), in the table's schema."""
    files = [str(f) for r in ranks for f in sorted((root / table / f"rank={r:05d}").glob("seg-*.parquet"))]
    schema = EVENTS if table == "events" else STEPS
    if not files:
        return schema.empty_table()
    columns = ", ".join(f'"{f.name}"' for f in schema)
    return con.sql(f"SELECT {columns} FROM read_parquet($files, hive_partitioning=false)",
                   params={"files": files}).to_arrow_table().cast(schema)
