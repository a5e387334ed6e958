"""A culprit whose fix saves nothing is a victim: the what-if judges the culprit findings the lost-time
attribution could not (slow from the first analyzed step, so no healthy history to charge them against).

The attribution (detect/lost_time.settle) drops another detector's straggler / late_launch finding when
its rank explains less than `victim_share` of the lost time over its steps; a finding that starts with
the run has no healthy steps to measure that lost time by and was kept as it came. Here each such
finding's what-if (the step replayed with it fixed) stands in for its charge: a finding saving nothing,
or less than `victim_share` of what the run's best-saving culprit at overlapping steps saves, goes. On
the What-if artifact's AR trace (OSDI'25: one worker slowed on purpose) the slow rank's fix saves 23.3 s
of a 46.8 s step; the four ranks named late_launch beside it (they sat in gaps waiting for its replica)
0.11, 0.11, 0 and 0 s; SE's rank 0 late_launch 0 s (the paper: no worker issue there).
"""

from __future__ import annotations

from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import CULPRIT_KINDS, Finding
from megascope.analyzer.graph.what_if import what_if

NOTHING_SAVED = 1e-3
"""A what-if saving less than this share of the step saved nothing (the replay's own rounding: 0.0 on
the AR trace's two ranks that only waited)."""


def drop_fixless_culprits(store: Store, findings: list[Finding], victim_share: float) -> list[Finding]:
    """`findings` without the uncharged culprit findings whose fix saves (next to) nothing; the others
    judged keep `what_if_saved_s` in their evidence (the saving per step the decision used)."""
    judged = [f for f in findings if f.kind in CULPRIT_KINDS and "cost_s" not in f.evidence]
    if not judged:
        return findings
    saved: dict[int, float] = {}
    for f in judged:
        wi = what_if(store, f)
        if wi.get("applicable"):
            saved[id(f)] = float(wi["saved_per_step_s"])
            f.evidence["what_if_saved_s"] = round(saved[id(f)], 6)
            f.evidence["what_if_share"] = float(wi["throughput_lost"])

    def victim(f: Finding) -> bool:
        if id(f) not in saved:
            return False  # no replay to judge by: kept as the detectors found it
        if f.evidence["what_if_share"] < NOTHING_SAVED:
            return True
        best = max((saved[id(g)] for g in judged if id(g) in saved and _overlap(f, g)), default=0.0)
        return saved[id(f)] < victim_share * best

    return [f for f in findings if not (id(f) in saved and victim(f))]


def _overlap(a: Finding, b: Finding) -> bool:
    return a.steps[0] <= b.steps[1] and b.steps[0] <= a.steps[1]
