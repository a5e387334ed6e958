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

from megascope.analyzer.findings import Finding
from megascope.analyzer.mfu import mfu_timeline
from megascope.analyzer.run import Run
from megascope.analyzer.store import Store


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


class WindowStore(Store):
    """A Store whose events and steps hold only steps [first, last]: every view and per-rank source
    goes through Store._latest, so the cut applies to the event pass's batches too."""

    def __init__(self, path: str | Path, first: int, last: int, threads: int | None = None) -> None:
        self.window = (int(first), int(last))
        super().__init__(path, threads=threads)

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


def analyze_window(path: Path, first: int, last: int, threads: int | None = None) -> WindowResult:
    """The default detectors (Run.findings: stragglers, flaps, imbalance, hang) over steps [first, last]."""
    run = Run(WindowStore(path, first, last, threads=threads))
    findings = run.findings()
    per_step = mfu_timeline(run.store).per_step
    per_stage = run.store.query("""SELECT pp, quantile_cont(step_time_s, 0.5) AS p50_s, max(step_time_s) AS max_s
                                   FROM rank_step WHERE step = $last AND step_time_s > 0 GROUP BY pp ORDER BY pp""",
                                {"last": int(last)})
    return WindowResult(findings, per_step, per_stage, list(run.warnings))


def analyze_full(path: Path, threads: int | None = None) -> list[Finding]:
    """What `megascope analyze` finds over the whole run (the watcher's final verdict)."""
    return Run.open(path, threads=threads).findings()
