"""From the detectors to the run's findings, one way: each detector reads the store (its derived tables
already built), the lost-time attribution settles the others' findings (victims and trifles go), a rank
whose late arrivals were waits on a pipeline neighbour is traced back to it (trace_back.py), findings
another finding explains are dropped, a hang leads, the culprits get their collective-arrival evidence,
and the findings are sorted by kind, then severity. Run.findings calls it; nothing here reaches back
into Run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from megascope.analyzer.data.event_pass import Progress
from megascope.analyzer.data.store import DETECT_MEMORY_LIMIT, Store
from megascope.analyzer.detect.explain import drop_explained
from megascope.analyzer.detect.hangs import HangReport
from megascope.analyzer.detect.lost_time import LostTimeDetector, settle
from megascope.analyzer.detect.trace_back import trace_back
from megascope.analyzer.findings import CULPRIT_KINDS, SEVERITY_ORDER, Finding


class Detector(Protocol):
    def detect(self, store: Store) -> list[Finding]: ...


def diagnose(store: Store, detectors: Sequence[Detector], hang: HangReport | None,
             progress: Progress) -> list[Finding]:
    """The run's findings, most urgent first (findings.KINDS order, then severity)."""
    out: list[Finding] = []
    total = len(detectors) + 1
    with store.memory_limited(DETECT_MEMORY_LIMIT):
        for i, det in enumerate(detectors):
            progress("detecting", i + 1, total)
            out += det.detect(store)
    for det in detectors:  # blame follows the lost time: victims and trifles go, culprits get a cost
        if isinstance(det, LostTimeDetector):
            out = settle(out, det.attribution, det.cfg)
    out = trace_back(store, out)  # a rank that waited on a pipeline neighbour's sends is its victim
    out = drop_explained(out, store.topology)
    if hang is not None:
        out.insert(0, hang.to_finding(store.topology, len(store.topology)))
    add_arrival_evidence(store, out)
    progress("detecting", total, total)
    return sorted(out, key=lambda f: (SEVERITY_ORDER.get(f.kind, len(SEVERITY_ORDER)), -f.severity))


def add_arrival_evidence(store: Store, findings: list[Finding]) -> None:
    """Each culprit finding's `collectives_arrived_last` and `lateness_ms_per_step` over its steps, from
    the late_arrivals table (the ranks the others waited for at their collectives)."""
    culprits = sorted({r for f in findings if f.kind in CULPRIT_KINDS for r in f.ranks})
    if not culprits:
        return
    ids = ", ".join(map(str, culprits[:4096]))
    late = store.query(f"SELECT * FROM late_arrivals WHERE rank IN ({ids})")
    for f in findings:
        if f.kind not in CULPRIT_KINDS:
            continue
        sel = late[late["rank"].isin(f.ranks) & late.step.between(*f.steps)]
        f.evidence["collectives_arrived_last"] = int(sel.late_count.sum())
        n_steps = max(1, f.steps[1] - f.steps[0] + 1)
        f.evidence["lateness_ms_per_step"] = round(1e3 * float(sel.lateness_s.sum()) / n_steps, 3)
