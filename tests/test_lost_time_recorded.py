"""The lost-time attribution on two real runs it once got wrong, kept as recorded (tests/recorded/, the
tracer's own files, nothing edited): deterministic, so the verdicts are exact, not margins.

- attach-sleep-most-of-run: tests/test_attach_outside_spans.py's job from a CI run of 2026-11-28 (2 gloo
  ranks, attached DDP; rank 1 sleeps 30 ms before each step from step 10 of 60). `analyze` said
  "Findings: none": the stretch search measured rank 1 against its median, which was the sleep's own
  level, took steps 19-58 and got t 5.0 (< 6). Rank 1 must be named for steps 10-59, rank 0 not.
- lab-ddp-sleep-r1: the fault lab's tuned case of 2026-11-28 22:57 (samples/ddp_loop.py under torchrun,
  rank 1 sleeps 30 ms outside hooked spans from step 120 of 300). Its victim, rank 0, was also named
  late_launch for steps 0-118: its own time there was higher than while its peer slept, though the job
  ran faster then. Rank 1 alone must be named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megascope.analyzer import Run
from tests.test_attach_outside_spans import CULPRITS

RECORDED = Path(__file__).parent / "recorded"


def _culprits(name: str, tmp_path: Path) -> list:
    run = tmp_path / name
    shutil.copytree(RECORDED / name, run)  # the analyzer may write caches beside the run
    return [f for f in Run.open(run).findings() if f.kind in CULPRITS]


def test_a_rank_slowed_for_most_of_the_run_is_named_from_its_onset(tmp_path: Path) -> None:
    found = _culprits("attach-sleep-most-of-run", tmp_path)
    assert [(f.kind, f.ranks, f.steps) for f in found] == [("late_launch", [1], (10, 59))]
    ev = found[0].evidence
    assert ev["source"] == "lost_time" and ev["t"] >= 6 and ev["excess_ms"] >= 30, ev


def test_the_victim_is_not_named_for_the_steps_the_job_ran_faster(tmp_path: Path) -> None:
    found = _culprits("lab-ddp-sleep-r1", tmp_path)
    assert [f.ranks for f in found] == [[1]], [(f.kind, f.ranks, f.steps) for f in found]
    assert found[0].steps[0] == 120 and found[0].steps[1] >= 295, found[0].steps
