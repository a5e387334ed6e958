"""A culprit whose fix saves nothing is a victim: the what-if judges the culprit findings the lost-time
attribution could not (slow from the first analyzed step, so no healthy history to charge them against).

The attribution (detect/lost_time.settle) drops another detector's straggler / late_launch finding when
its rank explains less than `victim_share` of the lost time over its steps; a finding that starts with
the run has no healthy steps to measure that lost time by and was kept as it came. Here each such
finding's what-if (the step replayed with it fixed) stands in for its charge: a finding whose fix saves
nothing goes, and so does one whose fix saves less than `victim_share` of the time it says its rank
loses a step (its `excess_ms`: the time went, but not to the job's step; it was a wait). On the What-if
artifact's AR trace (OSDI'25: one worker slowed on purpose) the slow rank's fix saves 23.3 s of a
46.8 s step; the four ranks named late_launch beside it (in gaps waiting for its replica) 0.11 s of
their 2.0 s and 1.6 s late a step (5.6%, 7.3%), 0 and 0 s; SE's rank 0 late_launch 0 s (the paper: no
worker issue there). A simulated 40 ms late launch every 2nd step saves 26 ms a step of its 40.
Judged against the costliest other culprit's saving instead (less than `victim_share` of it), that
simulated late launch went too, beside a straggler that saved more; judged once that culprit is fixed,
AR's two ranks saved 3% (their gaps, kept as the finding's evidence, then were on the path). A finding
alone in its steps is no one's victim and stays, whatever its fix saves (a simulated 15 ms late launch
every 2nd step, off the critical path: 0.0%; its cost says so).
"""

from __future__ import annotations

from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import CULPRIT_KINDS, Finding
from megascope.analyzer.graph.what_if import what_if

NOTHING_SAVED = 1e-3
"""A what-if saving less than this share of the step saved nothing (the replay's own rounding: 0.0 on
the AR trace's two ranks that only waited)."""


def drop_fixless_culprits(store: Store, findings: list[Finding], victim_share: float) -> list[Finding]:
    """`findings` without the uncharged culprit findings that share their steps with another finding and
    whose fix saves (next to) nothing: less than NOTHING_SAVED of the step, or less than `victim_share`
    of the time a step the finding says its rank loses (`excess_ms`); the others judged keep
    `what_if_saved_s` in their evidence."""
    out = []
    for f in findings:
        others = [g for g in findings if g is not f and g.kind != "hang" and _overlap(f, g)]
        if f.kind not in CULPRIT_KINDS or "cost_s" in f.evidence or not others:
            out.append(f)  # alone, a finding that costs nothing is no one's victim: its cost says it
            continue
        wi = what_if(store, f)
        if not wi.get("applicable"):
            out.append(f)  # no replay to judge by: kept as the detectors found it
            continue
        saved_s = float(wi["saved_per_step_s"])
        claimed_s = float(f.evidence.get("excess_ms") or 0.0) / 1e3
        if float(wi["throughput_lost"]) < NOTHING_SAVED or saved_s < victim_share * claimed_s:
            continue
        f.evidence["what_if_saved_s"] = round(saved_s, 6)
        out.append(f)
    return out


def _overlap(a: Finding, b: Finding) -> bool:
    return a.steps[0] <= b.steps[1] and b.steps[0] <= a.steps[1]
