"""The watcher's view of a live run: how far it got, and the default detectors over its recent steps.

A step is complete when every rank that has recorded steps has recorded it (the tracer writes each
rank's segments on its own: a step some ranks have not flushed yet would make them look slow). The
detectors run on a Store whose events and steps are cut to a window of complete steps, so a tick
costs the same at step 10 and at step 10,000; everything else (layout, hang records, damaged
segments) is the Store's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

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


def progress_of(store: Store) -> Progress:
    rows = store.query("""SELECT rank, max(step) AS last, sum(dropped_events) AS dropped
                          FROM steps GROUP BY rank""")
    steps = ((store.manifest.get("config") or {}).get("train") or {}).get("steps")
    last_step = int(steps) - 1 if isinstance(steps, int) and steps > 0 else None
    if rows.empty:
        return Progress(None, 0, last_step, 0)
    world = len(store.topology)
    # a rank with no steps at all yet holds every step back: complete means all the layout's ranks
    complete = int(rows["last"].min()) if len(rows) >= world else None
    return Progress(complete, len(rows), last_step, int(rows.dropped.fillna(0).sum()))


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
