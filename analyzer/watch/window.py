"""The watcher's view of a live run: how far it got, and the default detectors over its recent steps.

A step is complete when every rank that has recorded steps has recorded it (the tracer writes each
rank's segments on its own: a step some ranks have not flushed yet would make them look slow). The
detectors run on a Store whose events and steps are cut to a window of complete steps, so a tick
costs the same at step 10 and at step 10,000; everything else (layout, hang records, damaged
segments) is the Store's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import Finding
from megascope.analyzer.run import Run
from megascope.analyzer.settings import AnalyzerSettings
from megascope.analyzer.views.mfu import mfu_timeline


@dataclass
class Progress:
    """How far the run got, from its steps table."""
    complete_step: int | None
    """Last step every rank recorded (None: no step complete yet)."""
    ranks_reporting: int
    last_step: int | None
    """The run's configured last step (run.json train.steps - 1), None when unknown (imports)."""
    dropped_events: int
    """Events the tracer dropped so far (its buffers were full), summed over ranks and steps."""

    @property
    def finished(self) -> bool:
        return self.last_step is not None and self.complete_step is not None and self.complete_step >= self.last_step


class ProgressFollower:
    """Each rank's last recorded step and the dropped-event count, from the steps segments that landed
    since the last look (segments are immutable once renamed into place, tracer/sink.py): a tick reads
    only the new ones, so its cost does not grow with the run's length. After an elastic restart a
    rank's last step stays its highest until the new attempt passes it."""

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path = path
        topology = manifest.get("topology") or {}
        self.world = int(topology.get("world") or len(topology.get("ranks") or []) or 0)
        steps = ((manifest.get("config") or {}).get("train") or {}).get("steps")
        self.last_step = int(steps) - 1 if isinstance(steps, int) and steps > 0 else None
        self.last: dict[int, int] = {}
        self.dropped = 0
        self.seen: set[str] = set()
        self.unreadable: list[str] = []
        """Steps segments that could not be read (damaged): the analysis drops them with a warning."""

    def add(self, segments: Iterable[str]) -> None:
        """Take in new segments (relative paths; events segments and known ones are ignored)."""
        for rel in sorted(s for s in segments if s.startswith("steps/") and s not in self.seen):
            self.seen.add(rel)
            try:
                table = pq.read_table(self.path / rel, columns=["rank", "step", "dropped_events"])
            except (OSError, ValueError, pa.ArrowException):
                self.unreadable.append(rel)
                continue
            if not table.num_rows:
                continue
            frame = table.to_pandas()
            for rank, step in frame.groupby("rank").step.max().items():
                self.last[int(rank)] = max(int(step), self.last.get(int(rank), int(step)))
            self.dropped += int(frame.dropped_events.fillna(0).sum())

    def progress(self) -> Progress:
        # a rank with no steps at all yet holds every step back: complete means all the layout's ranks
        complete = min(self.last.values()) if self.last and len(self.last) >= self.world else None
        return Progress(complete, len(self.last), self.last_step, self.dropped)


class SegmentSteps:
    """The step range of each events and steps segment, read once from its Parquet statistics
    (segments never change once renamed into place), so a window opens only the segments it needs."""

    def __init__(self) -> None:
        self.ranges: dict[str, tuple[int, int] | None] = {}

    def meets(self, path: str, first: int, last: int) -> bool:
        """Whether the segment may hold a step in [first, last] (unknown range: it may)."""
        if path not in self.ranges:
            self.ranges[path] = _step_range(path)
        r = self.ranges[path]
        return r is None or (r[0] <= last and r[1] >= first)


def _step_range(path: str) -> tuple[int, int] | None:
    """(min, max) step of a segment from its row groups' statistics; None when it has none or cannot
    be read (a damaged segment: the Store drops it with a warning)."""
    try:
        meta = pq.read_metadata(path)
        column = meta.schema.to_arrow_schema().get_field_index("step")
        lows, highs = [], []
        for i in range(meta.num_row_groups):
            stats = meta.row_group(i).column(column).statistics
            if stats is None or not stats.has_min_max:
                return None
            lows.append(int(stats.min))
            highs.append(int(stats.max))
    except (OSError, ValueError, pa.ArrowException):
        return None
    return (min(lows), max(highs)) if lows else None


class WindowStore(Store):
    """A Store whose events and steps hold only steps [first, last]: every view and per-rank source
    goes through Store._latest, so the cut applies to the event pass's batches too. With a
    SegmentSteps index it also opens only the segments that meet the window, so a tick late in a long
    run does not read the footers of every segment the run ever wrote."""

    PRUNE_SHARE = 0.5
    """Prune only when it leaves at most this share of the segments: DuckDB binds a glob of all
    segments faster than an explicit list of nearly all of them (store.py: _make_view)."""

    def __init__(self, path: str | Path, first: int, last: int, threads: int | None = None,
                 index: SegmentSteps | None = None) -> None:
        self.window = (int(first), int(last))
        self.index = index
        self.pruned: set[str] = set()
        super().__init__(path, threads=threads)

    def _list_segments(self, table: str) -> list[str]:
        files = super()._list_segments(table)
        if self.index is None or table not in ("events", "steps"):
            return files
        kept = [f for f in files if self.index.meets(f, *self.window)]
        if len(kept) > self.PRUNE_SHARE * len(files):
            return files
        self.pruned.add(table)
        return kept

    def _make_view(self, table: str) -> None:
        if table in self.pruned:  # an explicit list of the window's segments, not a glob of all
            self._excluded.add(table)
        super()._make_view(table)

    def _latest(self, table: str, select: str) -> str:
        inner = super()._latest(table, select)
        if table not in ("events", "steps"):
            return inner
        first, last = self.window
        return f"SELECT * FROM ({inner}) WHERE step BETWEEN {first} AND {last}"


@dataclass
class WindowResult:
    findings: list[Finding]
    per_step: pd.DataFrame
    """The MFU timeline of the window: step, step_time_s, tokens_per_s, mfu."""
    per_stage: pd.DataFrame
    """The window's last step: pp, p50_s, max_s (rank step times per pipeline stage)."""
    warnings: list[str]


def analyze_window(path: Path, first: int, last: int, threads: int | None = None,
                   index: SegmentSteps | None = None, settings: AnalyzerSettings | None = None) -> WindowResult:
    """The default detectors (Run.findings: stragglers, flaps, imbalance, hang) over steps [first, last]."""
    run = Run(WindowStore(path, first, last, threads=threads, index=index), settings=settings)
    findings = run.findings()
    per_step = mfu_timeline(run.store).per_step
    per_stage = run.store.query("""SELECT pp, quantile_cont(step_time_s, 0.5) AS p50_s, max(step_time_s) AS max_s
                                   FROM rank_step WHERE step = $last AND step_time_s > 0 GROUP BY pp ORDER BY pp""",
                                {"last": int(last)})
    return WindowResult(findings, per_step, per_stage, list(run.warnings))


def analyze_full(path: Path, threads: int | None = None, settings: AnalyzerSettings | None = None) -> list[Finding]:
    """What `megascope analyze` finds over the whole run (the watcher's final verdict)."""
    return Run.open(path, threads=threads, settings=settings).findings()
