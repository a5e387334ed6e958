"""From the detectors to the run's findings, one way: each detector is given the run's DetectContext
(context.py: the store, its derived tables already built, the settings' warm-up factor, and what one
detector leaves for a later step), the hang check first; the lost-time attribution the context then holds
settles the others' findings (victims and noise go), a rank whose late arrivals were waits on a
pipeline neighbour is traced back to it (trace_back.py), findings another finding explains are dropped,
the culprits get their collective-arrival evidence, and the findings are sorted: a hang leads, then by
cost (findings.report_order). Run.findings calls it; nothing here reaches back into Run."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol

from megascope.analyzer.data.event_pass import Progress
from megascope.analyzer.data.store import DETECT_MEMORY_LIMIT, Store
from megascope.analyzer.detect.cause import explain_causes
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.explain import drop_explained
from megascope.analyzer.detect.settle import settle
from megascope.analyzer.detect.trace_back import trace_back
from megascope.analyzer.findings import CULPRIT_KINDS, Finding, report_order


class Detector(Protocol):
    def detect(self, ctx: DetectContext) -> list[Finding]: ...


class StoreDetector(Protocol):
    """The older form, still taken: `detect(store)` (any detector whose detect does not declare a
    DetectContext parameter is given ctx.store)."""

    def detect(self, store: Store) -> list[Finding]: ...


def diagnose(ctx: DetectContext, detectors: Sequence[Detector | StoreDetector], progress: Progress) -> list[Finding]:
    """The run's findings, most urgent first (findings.report_order: a hang, then by cost, then the rest
    in findings.KINDS order)."""
    out: list[Finding] = []
    total = len(detectors) + 1
    with ctx.store.memory_limited(DETECT_MEMORY_LIMIT):
        for i, det in enumerate(detectors):
            progress("detecting", i + 1, total)
            out += det.detect(ctx) if takes_context(det) else det.detect(ctx.store)  # type: ignore[arg-type]
    out = settle(out, ctx.attribution)  # blame follows the lost time: victims and noise go, culprits get a cost
    out = trace_back(ctx.store, out)  # a rank that waited on a pipeline neighbour's sends is its victim
    out = drop_explained(out, ctx.topology)
    add_arrival_evidence(ctx.store, out)
    explain_causes(ctx.store, out, ctx.warmup_factor)  # what each culprit's time went to (cause.py)
    progress("detecting", total, total)
    return sorted(out, key=lambda f: report_order(f.kind, f.evidence, f.severity))


def takes_context(det: Detector | StoreDetector) -> bool:
    """Whether `det.detect`'s first parameter is declared a DetectContext (by the class or its name, as
    `from __future__ import annotations` leaves it)."""
    params = list(inspect.signature(det.detect).parameters.values())
    return bool(params) and params[0].annotation in (DetectContext, "DetectContext")


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
