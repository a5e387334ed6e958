"""settle(): one finding per culprit rank across detectors, and when the straggler detector and the
lost-time attribution name the same rank for different causes, the attribution's cause stands (it says
where the rank's time went). The case is test_attach_outside_spans's in a clean-clone CI run: rank 1,
1.39x slower in compute from step 2 on the one CPU it shares, also slept 30 ms a step outside any span
from step 10; the straggler detector's finding won and its what-if saved 0.4 ms of the 30."""

from __future__ import annotations

import numpy as np

from megascope.analyzer.detect.lost_time import Attribution
from megascope.analyzer.detect.settle import settle
from megascope.analyzer.findings import Finding
from megascope.analyzer.settings import LostTimeConfig

STEPS, ONSET, SLEEP_S = 60, 10, 0.030


def _attribution() -> Attribution:
    steps = np.arange(STEPS)
    paused = np.where(steps >= ONSET, SLEEP_S, 0.0)
    return Attribution(steps=steps, lost=paused, run_s=STEPS * 0.02, charged={1: paused},
                       excess={0: np.zeros(STEPS), 1: paused}, baseline_s=0.011, cfg=LostTimeConfig())


def _detector_finding(kind: str, ranks: list[int] | None = None) -> Finding:
    return Finding(kind, ranks or [1], ["vm"], (2, 58), 1.39, "rank 1 computes 39% slower", {"cause": "slow_compute"})


def _lost_time_finding(kind: str) -> Finding:
    cost = SLEEP_S * (STEPS - ONSET)
    return Finding(kind, [1], ["vm"], (ONSET, STEPS - 1), 3.7, "rank 1 spends 30 ms more per step",
                   {"source": "lost_time", "cost_s": cost, "lost_share": 1.0, "excess_ms": 30.0})


def test_the_lost_time_cause_stands_when_the_detectors_disagree() -> None:
    kept = settle([_detector_finding("straggler"), _lost_time_finding("late_launch")], _attribution())
    assert [(f.kind, f.ranks, f.steps, f.evidence.get("source")) for f in kept] == [
        ("late_launch", [1], (ONSET, STEPS - 1), "lost_time")]


def test_the_other_detectors_finding_keeps_the_rank_when_they_agree() -> None:
    kept = settle([_detector_finding("straggler"), _lost_time_finding("straggler")], _attribution())
    assert [(f.kind, f.steps, f.evidence.get("cause")) for f in kept] == [("straggler", (2, 58), "slow_compute")]
    assert kept[0].evidence["cost_s"] == SLEEP_S * (STEPS - ONSET)  # the attribution's cost handed over


def test_a_finding_on_more_ranks_is_not_overruled_by_one_of_them() -> None:
    # a host's ranks named together by the straggler detector keep their finding; the rank's lost-time
    # finding hands it its cost, as when the two agree
    kept = settle([_detector_finding("straggler", [0, 1]), _lost_time_finding("late_launch")], _attribution())
    assert [(f.kind, f.ranks, f.evidence.get("cause")) for f in kept] == [("straggler", [0, 1], "slow_compute")]
