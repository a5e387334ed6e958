"""Blame follows the lost time, across detectors: the lost-time attribution (lost_time.py) applied to
every detector's straggler / late_launch findings (Run.findings, through diagnose). A finding whose rank
the attribution charges less than `victim_share` of the lost time over its steps is a victim's and goes;
one whose excess over its peers is not persistent and significant against the rank's own history is
noise and goes; a cheap culprit stays with its cost, and one finding per culprit rank stays."""

from __future__ import annotations

import numpy as np

from megascope.analyzer.detect.lost_time import Attribution
from megascope.analyzer.findings import Finding
from megascope.analyzer.settings import LostTimeConfig


def _charge(excess: list[np.ndarray], sel: np.ndarray, lost: np.ndarray) -> float:
    """Seconds of `lost` the ranks' excess explains over the steps `sel`, each rank's against its level
    outside them (its own history; its peers' level when the steps are the whole run), at most a step's
    loss per step: a tp group's ranks that end every op together (pareto_straggler of the independent
    suite: both named) explain the same seconds, not twice them."""
    if not excess:
        return 0.0
    above = []
    for d in excess:
        out = d[~sel & ~np.isnan(d)]
        level = float(np.median(out)) if len(out) >= 20 else 0.0
        above.append(np.clip(np.nan_to_num(d[sel]) - level, 0, None))
    return float(np.minimum(np.max(above, axis=0), lost[sel]).sum())


def settle(findings: list[Finding], att: Attribution | None) -> list[Finding]:
    """Blame follows the lost time, across detectors: the other detectors' straggler / late_launch
    findings get the cost this attribution charges their rank over their steps. Whether one stays is its
    evidence's: a rank charged less than `victim_share` of the lost time there is a victim, and one
    whose excess over its peers is not persistent and significant against its own history there
    (_culprit_evidence) is noise; both go. A cheap culprit stays with its cost: the report ranks by cost.
    A lost-time finding on a rank another detector already named hands its cost to that finding and goes
    (one finding per culprit), unless the two disagree on the cause for that rank alone: then the
    lost-time finding stands, since it says where the rank's time went (a rank 1.4x slower in compute that
    also paused 30 ms a step outside it was named a straggler, and its what-if saved 0.4 ms of the 30:
    test_attach_outside_spans)."""
    if att is None:
        return findings
    cfg = att.cfg
    culprit = ("straggler", "late_launch")
    out: list[Finding] = []
    for f in findings:
        if f.kind not in culprit or f.evidence.get("source") == "lost_time":
            out.append(f)
            continue
        sel = (att.steps >= f.steps[0]) & (att.steps <= f.steps[1])
        if (~sel).sum() < cfg.min_steps:
            out.append(f)  # slow from (nearly) the first step: no healthy history to charge it against
            continue
        # what-if by its own history, as for this detector's own culprits: had the rank kept its level of
        # the other steps, the job would have kept its step time of those. Measured (generated dp32 x tp4
        # x pp4, one GPU 1.1x from step 25 of 50): charged against the run's healthy level, which holds
        # the slow steps, 0.032 s; against the other steps 0.109 s; its fault-free twin says 0.137 s.
        step_s = att.step_s if att.step_s is not None else att.lost + att.baseline_s
        lost_at = np.clip(step_s - float(np.median(step_s[~sel])), 0, None)
        lost = float(lost_at[sel].sum())
        mine = _charge([att.excess[r] for r in f.ranks if r in att.excess], sel, lost_at)
        if sel.any() and lost > 0 and not any(r in att.excess for r in f.ranks):
            out.append(f)  # no stage peers to compare with: nothing to say
            continue
        if sel.any() and mine < cfg.victim_share * lost:
            continue
        if not any(_culprit_evidence(att.excess[r], sel, cfg) for r in f.ranks if r in att.excess):
            continue
        # the run's lost time with this finding's steps counted as its cost is (its share stays <= 1)
        run_lost = float(att.lost[~sel].sum() + np.maximum(att.lost[sel], lost_at[sel]).sum())
        f.evidence.update(att.cost_evidence(mine, run_lost))
        out.append(f)
    return _one_per_culprit(out, att)


def _one_per_culprit(findings: list[Finding], att: Attribution) -> list[Finding]:
    """settle's last part: a lost-time finding on a rank another detector's culprit finding names over
    the same steps hands it its cost and goes; the costs of several (a tp group's ranks, split between
    them by the attribution) add up; when the two name one rank for different causes, the lost-time
    finding stands and the other goes."""
    culprit = ("straggler", "late_launch")
    named = [f for f in findings if f.kind in culprit and f.evidence.get("source") != "lost_time"]
    keep, overruled = [], []
    handed: dict[int, float] = {}
    for f in findings:
        twin = next((g for g in named if f.kind in culprit and f.evidence.get("source") == "lost_time"
                     and set(g.ranks) & set(f.ranks)
                     and g.steps[0] <= f.steps[1] and f.steps[0] <= g.steps[1]), None)
        if twin is None:
            keep.append(f)
        elif twin.kind != f.kind and set(twin.ranks) <= set(f.ranks):  # not a whole host's finding for one rank
            overruled.append(twin)
            keep.append(f)
        else:
            handed[id(twin)] = handed.get(id(twin), 0.0) + float(f.evidence["cost_s"])
            # cost_from: its what-if is the attribution's too (lost_time.attributed_what_if): replayed,
            # gc-r1's handed late launch said the step would take 0.003 s against the clean twin's 0.054
            twin.evidence.update(att.cost_evidence(handed[id(twin)], float(att.lost.sum())), cost_from="lost_time")
    return [f for f in keep if not any(f is g for g in overruled)]


def _culprit_evidence(d: np.ndarray, sel: np.ndarray, cfg: LostTimeConfig) -> bool:
    """Whether a rank's excess over its stage peers `d` names a culprit over the steps `sel`: persistent
    (>= culprit_min_steps of them with a value: a 4-step load spike is a hiccup) and significant against
    the rank's own history (Welch's t of its mean there against the rest of the run >= t_min, as
    _stretch takes it)."""
    ok = ~np.isnan(d)
    inside, rest = d[sel & ok], d[~sel & ok]
    if len(inside) < cfg.culprit_min_steps or len(rest) < 2:
        return False
    se = float(np.sqrt(inside.var(ddof=1) / len(inside) + rest.var(ddof=1) / len(rest)))
    return float(inside.mean() - rest.mean()) >= cfg.t_min * se
