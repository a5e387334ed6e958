"""The watcher's incremental view of a live run: each segment is read once, each rank-step summarized once.

A tick hands `LiveRows.add` the segments that landed since the last one (segments are immutable once
renamed into place, tracer/sink.py). Their steps rows say how far each rank got (the complete step:
the last one every rank recorded); their events are held until their step is complete, then
summarized with the edge macros the tracers run on their own events (tracer/edge_summary.summarize:
rank_step's columns, the per-peer rows, the collective member rows) and the raw rows dropped. The
summaries of the last `keep` summarized steps are kept, the collective member rows (~10 a rank-step,
most of the memory: 15 M rows for 12,288 ranks x 128 steps) of the last `keep_collectives`; the
detectors read them (window.py). So a tick
costs what landed since the last one, not the window: the events of a step are aggregated once
instead of once per tick that sees the step in its window.

A step is summarized once every rank has recorded it, or `lag` steps later when the trace has async
ops (`<op>.wait` rows: an op issued in one step may be waited for in the next, edge_summary.LAG_STEPS).
Rows of a rank-step already summarized (a flush that landed very late, a step repeated after a
restart) can no longer count: they are counted (`late_rows`) and said once.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascope.tracer.edge_summary import LAG_STEPS, define_edge_sql, summarize
from megascope.tracer.schema import EDGE, EVENTS, STEPS, WAIT_SUFFIX

log = logging.getLogger("megascope.watch")
_HOUR_NS = 3_600_000_000_000


@dataclass
class Progress:
    """How far the run got, from its steps rows."""
    complete_step: int | None
    """Last step every rank recorded (None: no step complete yet)."""
    ranks_reporting: int
    last_step: int | None
    """The run's configured last step (run.json train.steps - 1), None when unknown (imports)."""
    dropped_events: int
    """Events the tracer dropped so far (its buffers were full), summed over ranks and steps."""
    newest_step: int | None = None
    """The furthest any rank got."""

    @property
    def finished(self) -> bool:
        return self.last_step is not None and self.complete_step is not None and self.complete_step >= self.last_step


class LiveRows:
    def __init__(self, path: Path, manifest: dict, keep: int, keep_collectives: int | None = None) -> None:
        self.path = path
        topology = manifest.get("topology") or {}
        self.world = int(topology.get("world") or len(topology.get("ranks") or []) or 0)
        steps = ((manifest.get("config") or {}).get("train") or {}).get("steps")
        self.last_step = int(steps) - 1 if isinstance(steps, int) and steps > 0 else None
        self.keep = keep
        """Summarized steps kept (the window and the look-back for onsets)."""
        self.keep_collectives = keep if keep_collectives is None else keep_collectives
        """Of those, the steps whose collective member rows are kept."""
        self.last: dict[int, int] = {}
        self.dropped = 0
        self.unreadable: list[str] = []
        """Segments that could not be read (damaged): left out with a warning, as the analysis does."""
        self.async_ops = False
        self.base: int | None = None
        """Time origin of the collective encodings (an hour before the first step seen)."""
        self.done_through: int | None = None
        """The last step summarized."""
        self.late_rows = 0
        self._events: list[pa.Table] = []
        self._steps: list[pa.Table] = []
        self.rows: dict[str, list[pa.Table]] = {name: [] for name in EDGE}
        """Per edge table, the summaries of the kept steps, one table per summarizing tick."""
        self.pins: list[tuple[int, int]] = []
        self.pinned: dict[str, list[pa.Table]] = {name: [] for name in EDGE}
        """Per edge table, the summaries of the pinned steps (`pin`), kept past the pruning."""
        self._con = duckdb.connect(config={"threads": 1})
        self._con.execute("SET enable_progress_bar=false")
        define_edge_sql(self._con)

    # ---- reading what landed -------------------------------------------------------------------
    def add(self, segments: Iterable[str]) -> None:
        """Take in new segments (paths relative to the run; tables other than events and steps ignored)."""
        new = sorted(segments)
        steps = self._read([s for s in new if s.startswith("steps/")], STEPS)
        events = self._read([s for s in new if s.startswith("events/")], EVENTS)
        if steps.num_rows:
            for rank, step in _max_by_rank(steps).items():
                self.last[rank] = max(step, self.last.get(rank, step))
            self.dropped += int(pc.sum(pc.fill_null(steps["dropped_events"], 0)).as_py() or 0)
            if self.base is None:
                self.base = int(pc.min(steps["start_ns"]).as_py()) - _HOUR_NS
            self._steps.append(self._not_late(steps, "steps rows"))
        if events.num_rows:
            events = self._not_late(events, "events")
            self._events.append(events)
            if not self.async_ops:
                self.async_ops = bool(pc.any(pc.and_(pc.equal(events["kind"], "host"),
                                                     pc.ends_with(events["name"], WAIT_SUFFIX))).as_py())

    def _not_late(self, table: pa.Table, what: str) -> pa.Table:
        """`table` less its rows of steps already summarized (counted, said once)."""
        if self.done_through is None:
            return table
        late = pc.less_equal(table["step"], self.done_through)
        count = int(pc.sum(late).as_py() or 0)
        if count:
            if not self.late_rows:
                log.warning("watch: %d %s landed for steps already summarized; they are left out (counted: "
                            "/status late_rows)", count, what)
            self.late_rows += count
        return table.filter(pc.invert(late)) if count else table

    def _read(self, rel: list[str], schema: pa.Schema) -> pa.Table:
        """The rows of these segments in one read; a damaged one is found by reading them one by one."""
        if not rel:
            return schema.empty_table()
        # joined as strings: through pathlib the paths took ~15% of reading (0.036 of ~0.25 ms a segment)
        root = str(self.path)
        files = [os.path.join(root, r) for r in rel]
        columns = ", ".join(f'"{f.name}"' for f in schema)
        try:
            return self._con.sql(f"SELECT {columns} FROM read_parquet($files, hive_partitioning=false)",
                                 params={"files": files}).to_arrow_table().cast(schema)
        except (duckdb.Error, pa.ArrowException):
            pass
        tables = []
        for r, f in zip(rel, files):
            try:
                tables.append(pq.read_table(f, columns=schema.names, partitioning=None).cast(schema))
            except (OSError, ValueError, pa.ArrowException):
                self.unreadable.append(r)
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def progress(self) -> Progress:
        # a rank with no steps at all yet holds every step back: complete means all the layout's ranks
        complete = min(self.last.values()) if self.last and len(self.last) >= self.world else None
        newest = max(self.last.values()) if self.last else None
        return Progress(complete, len(self.last), self.last_step, self.dropped, newest)

    # ---- summarizing complete steps ------------------------------------------------------------
    def summarize(self, final: bool = False) -> int | None:
        """Summarize the held rank-steps that are complete now (every held one when `final`: the run
        is over); returns the last step summarized so far (None: none yet)."""
        complete = self.progress().complete_step
        if complete is None:
            return self.done_through
        through = complete if final or not self.async_ops else complete - LAG_STEPS
        if (self.done_through is not None and through <= self.done_through) or not self._steps:
            return self.done_through
        events = pa.concat_tables(self._events) if self._events else EVENTS.empty_table()
        steps = pa.concat_tables(self._steps)
        ranks = sorted(self.last)
        tables = summarize(self._con, ranks, events, _upto(steps, through), through, self.async_ops, final=True)
        for name, table in tables.items():
            if table.num_rows:
                self.rows[name].append(table)
        self._events = [_after(events, through)]
        self._steps = [_after(steps, through)]
        self.done_through = through
        for name in self.rows:
            self._prune(name, through - (self.keep_collectives if name == "edge_collectives" else self.keep) + 1)
        return through

    def _prune(self, name: str, first: int) -> None:
        tables = self.rows[name]
        if tables:
            kept = [t if pc.min(t["step"]).as_py() >= first else _after(t, first - 1) for t in tables
                    if pc.max(t["step"]).as_py() >= first]
            self.rows[name] = [t for t in kept if t.num_rows]

    def pin(self, ranges: list[tuple[int, int]]) -> None:
        """Hold the summaries of the steps in these [first, last] ranges (those still held) past the
        pruning, and no others: an open finding's steps around its onset. A straggler open for longer
        than `keep` steps is otherwise judged in a window wholly inside it, where the detector holds
        it to its stricter test for a rank slow from the first step (z_start): under load it lost a
        3x straggler that way at step ~185 of 200 (onset 60) and called it ended (1 CI run in ~10)."""
        ranges = sorted(set(ranges))
        if ranges == self.pins:
            return
        for name in EDGE:
            parts = []
            for t in self._held(name) if ranges else []:
                inside = [pc.and_(pc.greater_equal(t["step"], a), pc.less_equal(t["step"], b)) for a, b in ranges]
                part = t.filter(functools.reduce(pc.or_, inside))
                if part.num_rows:
                    parts.append(part)
            self.pinned[name] = parts
        self.pins = ranges

    def _held(self, name: str) -> list[pa.Table]:
        """The pinned summaries of steps before the kept ones, then the kept ones (no step twice)."""
        rows = self.rows[name]
        first = min(pc.min(t["step"]).as_py() for t in rows) if rows else None
        pinned = [t if first is None or pc.max(t["step"]).as_py() < first
                  else t.filter(pc.less(t["step"], first)) for t in self.pinned[name]]
        return [t for t in pinned if t.num_rows] + rows

    def window(self, name: str, first: int, last: int) -> pa.Table:
        """One edge table's rows of steps [first, last] (of the held ones: pinned, kept). Each kept
        table holds the steps of one summarizing tick: only those that straddle a bound are filtered
        (the collective rows of 12,288 ranks x 15 steps, 1.8 M, took 0.5 s to filter whole)."""
        parts = []
        for t in self._held(name):
            lo, hi = pc.min(t["step"]).as_py(), pc.max(t["step"]).as_py()
            if hi < first or lo > last:
                continue
            if lo < first or hi > last:
                t = t.filter(pc.and_(pc.greater_equal(t["step"], first), pc.less_equal(t["step"], last)))
            parts.append(t)
        return pa.concat_tables(parts) if parts else EDGE[name].empty_table()

    def first_kept(self) -> int | None:
        """The first step whose summaries are held (pinned or kept)."""
        tables = self._held("edge_rank_step")
        return min(pc.min(t["step"]).as_py() for t in tables) if tables else None

    def close(self) -> None:
        self._con.close()


def _max_by_rank(steps: pa.Table) -> dict[int, int]:
    grouped = steps.group_by("rank").aggregate([("step", "max")])
    return dict(zip((int(r) for r in grouped["rank"].to_pylist()), (int(s) for s in grouped["step_max"].to_pylist())))


def _after(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pc.greater(table["step"], step))


def _upto(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pc.less_equal(table["step"], step))
