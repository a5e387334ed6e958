"""The default detectors over a window of a live run's recent complete steps, from the rows the watcher
already summarized (live_rows.LiveRows), not from the events.

The detectors read the derived tables the event pass builds (rank_step, _p2p_peer_step,
collective_instances, late_arrivals). Here they are built from the window's summaries with the same
macros the analyzer uses for a run whose ranks summarized their own events (event_pass.py,
from_edge_summaries: rank_step_of_edge, collective_partials_of_members, split and merged partials), on a
Store that lists no segment: a window costs its summaries (O(ranks x window) rows), whatever the run's
length and however many segments it wrote. The events view is opened only when a hang is judged (the
hang report names the stuck ranks' last events).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from megascope.analyzer.data import event_pass as ep
from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import Finding
from megascope.analyzer.run import Run
from megascope.analyzer.settings import AnalyzerSettings
from megascope.analyzer.views.mfu import mfu_timeline
from megascope.analyzer.watch.live_rows import LiveRows
from megascope.tracer.schema import EDGE

_P2P_SELECT = ", ".join(f'"{c}"' for c in ep.P2P_STEP_COLUMNS)


class LiveStore(Store):
    """A Store over the run's run.json (topology, manifest) whose tables are the window's summaries; it
    lists the events segments only when `events` is set (a hang's report reads them)."""

    def __init__(self, path: str | Path, threads: int | None = None, events: bool = False) -> None:
        self.with_events = events
        super().__init__(path, threads=threads)

    def _list_segments(self, table: str) -> list[str]:
        return super()._list_segments(table) if table == "events" and self.with_events else []


@dataclass
class WindowResult:
    findings: list[Finding]
    per_step: pd.DataFrame
    """The MFU timeline of the window: step, step_time_s, tokens_per_s, mfu."""
    per_stage: pd.DataFrame
    """The window's last step: pp, p50_s, max_s (rank step times per pipeline stage)."""
    warnings: list[str]


def judge_window(store: LiveStore, rows: LiveRows, first: int, last: int,
                 settings: AnalyzerSettings | None = None) -> WindowResult:
    """The default detectors (Run.findings: stragglers, flaps, imbalance, hang) over steps [first, last]
    of the summarized rows, on `store` (reused from one judgement to the next: its tables are
    replaced; opening the run's topology took 0.5 s a judgement at 12,288 ranks)."""
    run = Run(store, settings=settings)
    warned = len(store.warnings)
    derive(store, {name: rows.window(name, first, last) for name in EDGE}, rows.base or 0)
    run.derived.timeline, run.derived.arrivals = True, True  # built here, from the summaries
    findings = run.findings()
    per_step = mfu_timeline(store).per_step
    per_stage = store.query("""SELECT pp, quantile_cont(step_time_s, 0.5) AS p50_s, max(step_time_s) AS max_s
                               FROM rank_step WHERE step = $last AND step_time_s > 0 GROUP BY pp ORDER BY pp""",
                            {"last": int(last)})
    warnings = store.warnings[warned:]
    del store.warnings[warned:]  # the next judgement's are its own
    return WindowResult(findings, per_step, per_stage, warnings)


def derive(store: Store, summaries: dict[str, pa.Table], base: int) -> None:
    """The event pass's tables (rank_step, rank_step_incomplete, _p2p_peer_step, collective_instances,
    late_arrivals) on `store`'s connection from one set of edge summaries (tracer/schema.py EDGE)."""
    ep.define_sql(store)
    for name, table in summaries.items():
        store.con.register(f"_live_{name}", table)
        store.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM _live_{name}")
    store.execute("CREATE OR REPLACE TEMP TABLE rank_step AS FROM rank_step_of_edge('edge_rank_step')")
    store.execute("ALTER TABLE rank_step DROP COLUMN final")
    store.execute("CREATE OR REPLACE TEMP TABLE rank_step_incomplete AS SELECT * FROM rank_step WHERE false")
    store.execute(f"CREATE OR REPLACE TEMP TABLE _p2p_peer_step AS SELECT {_P2P_SELECT} FROM edge_peer_step "
                  "WHERE peer >= 0")
    plan = ep.PassPlan(int(base), True, False, ep.LayoutParams.of(store))
    store.execute("CREATE OR REPLACE TEMP TABLE _batch_partials AS FROM collective_partials_of_members("
                  "'edge_collectives', $base, $dp, $tp, $cp, $renumber)", {"base": plan.base, **plan.layout.params()})
    ep.split_partials(store, "_batch_partials", ep.EVENT_PASS_TABLES, plan, create=True)
    ep.merge_partials(store, ep.EVENT_PASS_TABLES, plan.base)
    store.execute("DROP TABLE _batch_partials")
    ep.late_arrivals(store)


def analyze_full(path: Path, threads: int | None = None, settings: AnalyzerSettings | None = None) -> list[Finding]:
    """What `megascope analyze` finds over the whole run (the watcher's final verdict)."""
    return Run.open(path, threads=threads, settings=settings).findings()
