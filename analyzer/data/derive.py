"""The tables derived from a run's events, built once each, in their one order:

    events, steps -> rank_step + collective_instances (the event pass, event_pass.py)
                  -> late_arrivals (sql/arrivals.sql)
                  -> the persisted rank-step summary (RUN/analysis/rank_step, summary_cache.py)

Asking for one builds what it needs before it; nothing is built twice. Run asks for what each question
needs (rank_step for the MFU timeline, late_arrivals for the findings, the summary for a heatmap); the
summary's builder gets the two tables from here, not from Run.
"""

from __future__ import annotations

from megascope.analyzer.data.event_pass import Engine, Progress, build_event_pass, late_arrivals
from megascope.analyzer.data.store import Store
from megascope.analyzer.data.summary_cache import SummaryState, ensure_summary


class DerivedTables:
    def __init__(self, store: Store, progress: Progress, engine: Engine | None = None) -> None:
        self.store = store
        self.progress = progress
        self.engine = engine  # where the event pass's batches run (None: this process, event_pass.LocalEngine)
        self.timeline: bool | None = None
        """Whether rank_step's rows are the timeline variant's (build_event_pass); None: not built yet."""
        self.arrivals = False
        self.summary: SummaryState | None = None
        """How the persisted rank-step summary was obtained (None: not asked for yet)."""

    def rank_step(self) -> None:
        """rank_step and collective_instances (one event pass builds both)."""
        if self.timeline is None:
            self.timeline = build_event_pass(self.store, self.progress, self.engine)

    def late_arrivals(self) -> None:
        """late_arrivals, from collective_instances."""
        if not self.arrivals:
            self.rank_step()
            late_arrivals(self.store)
            self.arrivals = True

    def rank_step_summary(self) -> SummaryState:
        """The view rank_step_summary over the persisted summary (reused, extended or written anew)."""
        if self.summary is None:
            self.summary = ensure_summary(self.store, self._tables_for_summary, tables_built=self.arrivals,
                                          progress=self.progress)
        return self.summary

    def _tables_for_summary(self) -> bool:
        self.late_arrivals()
        return bool(self.timeline)
