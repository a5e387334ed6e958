"""The facade notebooks, the CLI and the dashboard use: `Run.open(path)` and one method per question.

Each analysis lives in its own module; detectors are injectable (`Run.open(path, detectors=[...])`,
anything with `detect(ctx: DetectContext) -> list[Finding]`, or the older `detect(store)`), run after
the hang check; the default ones take their thresholds from `settings` (settings.py: `megascope analyze
--set`), and all of them the run's DetectContext (detect/context.py). Derived tables (rank_step, collective_instances,
late_arrivals, the persisted summary) are built once, lazily, in DuckDB, by one step (data/derive.py)
that each question asks for what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from megascope.analyzer.data.derive import DerivedTables
from megascope.analyzer.data.event_pass import Engine
from megascope.analyzer.data.events_window import events_window
from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.data.summary_cache import SummaryState
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.diagnose import Detector, Progress, StoreDetector, diagnose
from megascope.analyzer.detect.flaps import FlapDetector
from megascope.analyzer.detect.hangs import HangDetector, HangReport
from megascope.analyzer.detect.lost_time import LostTimeDetector, attributed_what_if
from megascope.analyzer.detect.stragglers import StragglerDetector
from megascope.analyzer.detect.workload_imbalance import WorkloadImbalanceDetector
from megascope.analyzer.findings import Finding, price_by_what_if, report_order
from megascope.analyzer.graph import critical_path as cp
from megascope.analyzer.graph.step_graph import build_step_graph, dependency_edges
from megascope.analyzer.graph.what_if import what_if
from megascope.analyzer.graph.what_if_victims import drop_fixless_culprits
from megascope.analyzer.settings import AnalyzerSettings, DetectSettings
from megascope.analyzer.views.heatmap import Heatmap, heatmap
from megascope.analyzer.views.incidents import read_incidents, recovery_times
from megascope.analyzer.views.links import LinkMap, link_map
from megascope.analyzer.views.live_findings import LiveFinding, read_live_findings
from megascope.analyzer.views.mfu import MfuTimeline, mfu_timeline
from megascope.analyzer.views.self_check_records import read_self_checks
from megascope.tracer.run_dir import FINDINGS_FILE


def default_detectors(settings: DetectSettings) -> list[Detector]:
    """Stragglers (and late launches, stage imbalance), flaps and slow links, workload imbalance (which
    reads the straggler detector's grid: after it)."""
    return [StragglerDetector(settings.straggler), FlapDetector(settings.flap),
            WorkloadImbalanceDetector(settings.workload_imbalance)]


class Run:
    def __init__(self, store: Store, detectors: Sequence[Detector | StoreDetector] | None = None,
                 progress: Progress | None = None, engine: Engine | None = None,
                 settings: AnalyzerSettings | None = None) -> None:
        self.store = store
        self.settings = settings or AnalyzerSettings()
        self.context = DetectContext(store, self.settings.detect.warmup_factor)
        """What the detectors are given and leave for the later steps (the attribution, the hang)."""
        self.detectors: list[Detector | StoreDetector] = [HangDetector(), *detectors] if detectors is not None else \
            [HangDetector(), *default_detectors(self.settings.detect),  # the attribution last: it settles
             LostTimeDetector(self.settings.detect.lost_time)]
        self.progress = progress or (lambda label, done, total: None)
        self.derived = DerivedTables(store, self.progress, engine)
        """The derived tables, built on demand (engine: where the event pass's batches run)."""
        self._findings: list[Finding] | None = None
        self.victims_by_what_if = True
        """Judge uncharged culprits by their what-if (graph/what_if_victims.py); off for a report without
        what-ifs (`analyze --no-what-if`), which reads no events for it."""

    @classmethod
    def open(cls, path: str | Path, detectors: Sequence[Detector | StoreDetector] | None = None,
             progress: Progress | None = None, threads: int | None = None, engine: Engine | None = None,
             settings: AnalyzerSettings | None = None) -> "Run":
        """Open a run directory: a local path, or a URL of a run on object storage (s3://bucket/prefix),
        read through a local mirror (remote_run.py; of only the ranks this process reads itself when
        the event pass runs as remote tasks). Raises RunOpenError (missing/foreign dir, unreachable
        store, unknown schema version). `engine`: where the event pass's batches of ranks run
        (engine_ray.RayEngine: Ray tasks)."""
        from megascope.tracer.storage import is_url
        if not is_url(path):
            return cls(Store(path, threads=threads), detectors, progress, engine, settings)
        from megascope.analyzer.data.remote_run import PartialMirror, local_run_dir
        store = PartialMirror(str(path), threads=threads) if engine is not None \
            else Store(local_run_dir(path), threads=threads)
        return cls(store, detectors, progress, engine, settings)

    # ---- basic views --------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.store.path

    @property
    def manifest(self) -> dict[str, Any]:
        return self.store.manifest

    @property
    def topology(self) -> pd.DataFrame:
        """rank, pp, dp, tp, host, local_rank"""
        return self.store.topology

    @property
    def warnings(self) -> list[str]:
        return self.store.warnings

    @property
    def summary(self) -> SummaryState | None:
        """How the persisted rank-step summary was obtained (None: not asked for yet)."""
        return self.derived.summary

    def steps(self) -> pd.DataFrame:
        """The steps table (all ranks), ordered by step and rank."""
        return self.store.query("SELECT * FROM steps ORDER BY step, rank")

    def rank_steps(self) -> pd.DataFrame:
        """Per rank and step: where the time went (see tracer/sql/rank_step.sql)."""
        self.derived.rank_step()
        return self.store.query("SELECT * FROM rank_step ORDER BY step, rank")

    def mfu(self) -> MfuTimeline:
        self.derived.rank_step()
        return mfu_timeline(self.store)

    def breakdown(self, steps: tuple[int, int] | None = None) -> pd.DataFrame:
        """step, rank, compute_s, exposed_comm_s, bubble_s, data_wait_s, other_s"""
        self.derived.rank_step()
        first, last = steps if steps is not None else (-(1 << 62), 1 << 62)
        return self.store.query(load_sql("breakdown"), {"first": int(first), "last": int(last)})

    def heatmap(self, metric: str, group_by: str = "rank", max_rows: int = 512, max_cols: int = 500) -> Heatmap:
        self.derived.rank_step_summary()
        return heatmap(self.store, metric, group_by, max_rows, max_cols)

    def links(self, max_rows: int = 256, max_cols: int = 500) -> LinkMap:
        """p2p links (rank pairs, grouped by host pair) x step: the ends' wait, the fastest transfer and its
        rate, with the network findings placed on their links and episodes (views/links.py)."""
        return link_map(self.store, self.findings(), max_rows, max_cols)

    def refresh_summary(self) -> SummaryState:
        """Bring the persisted rank-step summary up to the run's segments (extended from the first new
        step of a live run, summary_cache.py) without drawing a heatmap; `megascope watch` calls it."""
        return self.derived.rank_step_summary()

    def gpu(self) -> pd.DataFrame:
        return self.store.query("SELECT * FROM gpu ORDER BY rank, ts_ns")

    # ---- robust training: what the supervisor saw and the self-checks before restarts -----------
    def incidents(self) -> pd.DataFrame:
        """time, kind (dead_rank, silent_rank, stall, restart, resumed, ...), attempt, ranks, hosts,
        step, detail, action; empty when the run had none. Re-read on each call (live runs append)."""
        found: list[str] = []
        df = read_incidents(self.path, found)
        self._keep_warnings(found)
        return df

    def recovery_times(self) -> pd.DataFrame:
        """Per restart: attempt, failure, ranks, resumed_step, recovery_s (failure to resumed training)."""
        return recovery_times(self.incidents())

    def self_checks(self) -> list[dict[str, Any]]:
        """Each restart's self-check record (per-rank GEMM and link speeds, flagged ranks, decision)."""
        found: list[str] = []
        records = read_self_checks(self.path, found)
        self._keep_warnings(found)
        return records

    def _keep_warnings(self, found: list[str]) -> None:
        # readers run again on every refresh; each warning is reported once
        self.warnings.extend(w for w in found if w not in self.warnings)

    # ---- events and the dependency graph ------------------------------------------------------
    def events(self, steps: tuple[int, int], ranks: list[int] | None = None, limit: int = 200_000) -> pd.DataFrame:
        """Events of steps [first, last] (optionally some ranks) with a stable event_id."""
        return events_window(self.store, steps[0], steps[1], ranks, limit)

    def dependencies(self, step: int, ranks: list[int] | None = None) -> pd.DataFrame:
        """Edges src_event_id -> dst_event_id, kind (program_order | p2p | collective), src_rank,
        dst_rank, wait_s (how long dst waited on src)."""
        return dependency_edges(build_step_graph(self.store, step, ranks))

    def critical_path(self, step: int) -> pd.DataFrame:
        """Ordered events on the cross-rank critical path of the step, with how each led to the next."""
        return cp.critical_path(build_step_graph(self.store, step))

    def propagation(self, step: int) -> pd.DataFrame:
        """Who delayed whom in a step: src_rank, dst_rank, wait_s summed over p2p/collective edges."""
        edges = self.dependencies(step)
        edges = edges[(edges.kind != "program_order") & (edges.wait_s > 0)]
        return (edges.groupby(["src_rank", "dst_rank"]).wait_s.sum().reset_index()
                .sort_values("wait_s", ascending=False, ignore_index=True))

    # ---- diagnoses ----------------------------------------------------------------------------
    def live_findings(self) -> list[LiveFinding]:
        """What `megascope watch` announced for this run so far (RUN/findings.jsonl), one row per
        finding with its onset and state; [] when no watcher ran. Read anew on each call."""
        return read_live_findings(self.store.path / FINDINGS_FILE)

    def findings(self) -> list[Finding]:
        if self._findings is not None:
            return self._findings
        self.derived.late_arrivals()
        found = diagnose(self.context, self.detectors, self.progress)
        self._findings = (drop_fixless_culprits(self.store, found, self.settings.detect.lost_time.victim_share)
                          if self.victims_by_what_if else found)
        return self._findings

    def costed_findings(self, with_what_if: bool = True) -> list[tuple[Finding, dict | None]]:
        """The findings, the costliest first (findings.report_order), each with its what-if: the first
        settings.report.max_what_if of `findings()` but a hang get one (None for the rest, and for all
        without `with_what_if`: then no what-if judges victims either). One the lost-time attribution
        gave no cost is priced by its what-if (findings.price_by_what_if): the one rule the report, the
        dashboard and a notebook read."""
        self.victims_by_what_if = self.victims_by_what_if and with_what_if
        found = self.findings()
        limit = min(len(found), self.settings.report.max_what_if) if with_what_if else 0
        steps = [int(s) for s in self.mfu().per_step.step]
        world = int(self.manifest.get("topology", {}).get("world") or 0)
        out: list[tuple[Finding, dict | None]] = []
        for i, f in enumerate(found):
            wi = None
            if i < limit and f.kind != "hang":
                self.progress("what-if", i + 1, limit)
                # a lost-time finding's cost is counted over all its steps; a replay of 1-3 sampled steps
                # would say 0.0% for an episodic fault whose episodes it missed
                wi = self.what_if(f)
                price_by_what_if(f, wi, steps, world)
            out.append((f, wi))
        return sorted(out, key=lambda pair: report_order(pair[0].kind, pair[0].evidence, pair[0].severity))

    def incomplete_data(self) -> list[dict[str, Any]]:
        """Rank-steps left out of the diagnosis because a damaged segment may have held part of them:
        rank, steps [first, last] (clipped to the run's steps), segment (relative path), reason
        ("damaged", or "contradicts the run": rows of it were left out), one per such segment. Their
        steps rows still count in the MFU timeline."""
        self.derived.rank_step()
        ranges = self.store.incomplete_ranges()
        if ranges.empty:
            return []
        span = self.store.query("SELECT min(step) AS a, max(step) AS b FROM (SELECT step FROM rank_step "
                                "UNION ALL SELECT step FROM rank_step_incomplete)")
        lo = int(span.a.iloc[0]) if span.a.notna().iloc[0] else 0
        hi = int(span.b.iloc[0]) if span.b.notna().iloc[0] else 0
        return [{"rank": int(r.rank), "steps": [max(int(r.first_step), lo), min(int(r.last_step), hi)],
                 "segment": str(r.segment), "reason": str(r.reason)} for r in ranges.itertuples()]

    def hang(self) -> HangReport | None:
        """The hang the in-flight records show (None: none), found once for this and the findings."""
        return self.context.hang()

    def what_if(self, finding: Finding) -> dict:
        """Step time if the culprit behaved like its peers, and the throughput lost to the finding: a
        lost-time finding's from its attribution over every step it covers (a replay of a few sampled
        steps cannot stand for an episodic fault), any other's from the replay (graph/what_if.py)."""
        return attributed_what_if(self.store, finding) or what_if(self.store, finding)
