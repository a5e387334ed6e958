"""The watcher's Prometheus metrics (served on its HTTP port, watch/control.py: `megascope watch --metrics-port`).

Cardinality stays bounded at any job size: per-stage aggregates (pp series) and one straggler-score
series per rank that an open finding names, removed when the finding ends; never a series per rank.
Names and what alerts on them: docs/watch.md, samples/prometheus/alerts.yml.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from megascope.analyzer.findings import CULPRIT_KINDS, KINDS, Finding


class WatchMetrics:
    def __init__(self, run_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("megascope_run_info", "The watched run (always 1)", ["run_id"], registry=r).labels(run_id).set(1)
        self.step = Gauge("megascope_completed_step", "Last step every rank completed", registry=r)
        self.step_time = Gauge("megascope_step_time_seconds", "Job step time of the last complete step", registry=r)
        self.tokens = Gauge("megascope_tokens_per_second", "Tokens/s of the last complete step", registry=r)
        self.mfu = Gauge("megascope_mfu", "Model FLOPs utilization of the last complete step (0..1)", registry=r)
        self.stage_p50 = Gauge("megascope_stage_step_time_p50_seconds", "Median rank step time per pipeline stage",
                               ["stage"], registry=r)
        self.stage_max = Gauge("megascope_stage_step_time_max_seconds", "Slowest rank step time per pipeline stage",
                               ["stage"], registry=r)
        self.score = Gauge("megascope_straggler_score", "Slowdown vs peers of a rank an open finding names "
                           "(1.10 = 10% slower)", ["rank", "kind"], registry=r)
        self.open = Gauge("megascope_findings_open", "Open findings by kind", ["kind"], registry=r)
        self.total = Counter("megascope_findings", "Findings announced by kind", ["kind"], registry=r)
        for kind in KINDS:  # every kind present from the start: alerts and rate() see 0, not absence
            self.open.labels(kind).set(0)
            self.total.labels(kind)
        self.since_step = Gauge("megascope_seconds_since_last_step", "Seconds since the watcher saw the "
                                "completed step advance (a hang shows here first)", registry=r)
        self.since_step.set_function(self._since_step)
        self.dropped = Gauge("megascope_tracer_dropped_events", "Events the tracer dropped (full buffers), all ranks",
                             registry=r)
        self.lag = Gauge("megascope_watch_lag_seconds", "From the newest segment landing to its analysis done",
                         registry=r)
        self.errors = Counter("megascope_watch_errors", "Watcher ticks that failed (logged, survived)", registry=r)
        self.ticks = Counter("megascope_watch_ticks", "Windows analyzed", registry=r)
        self.finished = Gauge("megascope_run_finished", "1 once every rank recorded the configured last step",
                              registry=r)
        self._progress_at: float | None = None
        self._scored: set[tuple[str, str]] = set()

    def _since_step(self) -> float:
        return math.nan if self._progress_at is None else time.monotonic() - self._progress_at

    def step_advanced(self, step: int) -> None:
        self.step.set(step)
        self._progress_at = time.monotonic()

    def throughput(self, step_time_s: float, tokens_per_s: float, mfu: float) -> None:
        self.step_time.set(step_time_s)
        self.tokens.set(tokens_per_s)
        self.mfu.set(mfu)

    def stage(self, stage: int, p50_s: float, max_s: float) -> None:
        self.stage_p50.labels(str(stage)).set(p50_s)
        self.stage_max.labels(str(stage)).set(max_s)

    def announced(self, kind: str) -> None:
        self.total.labels(kind).inc()

    def open_findings(self, findings: list[Finding]) -> None:
        """Set the per-kind counts and the flagged ranks' scores to the open findings (others removed)."""
        counts = dict.fromkeys(KINDS, 0)
        scored: dict[tuple[str, str], float] = {}
        for f in findings:
            counts[f.kind] = counts.get(f.kind, 0) + 1
            if f.kind in CULPRIT_KINDS:
                for rank in f.ranks:
                    label: tuple[str, str] = (str(rank), f.kind)
                    scored[label] = max(scored.get(label, 0.0), float(f.severity))
        for kind, n in counts.items():
            self.open.labels(kind).set(n)
        for label in self._scored - set(scored):
            self.score.remove(*label)
        for label, value in scored.items():
            self.score.labels(*label).set(value)
        self._scored = set(scored)
