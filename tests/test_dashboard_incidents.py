"""Incidents, recovery times and self-checks in the dashboard (overview panel, topology marks), from a
run directory holding an incident log and a self-check record (the formats trainer/robust/supervisor.py and
trainer/robust/self_check.py write)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megascope.dashboard.app import create_app
from megascope.dashboard.runs import directory_signature
from tests.test_dashboard_callbacks import _text

T0 = 1_700_000_000.0
INCIDENTS = [
    {"time": T0, "kind": "stall", "attempt": 0, "ranks": [5], "hosts": ["node0001"], "step": 6,
     "detail": "rank 5 stalled 30 s in all_reduce", "action": "restart"},
    {"time": T0 + 2, "kind": "restart", "attempt": 1, "detail": "attempt 1 of 2"},
    {"time": T0 + 14.5, "kind": "resumed", "attempt": 1, "step": 6, "detail": "step 6 done"},
]
SELF_CHECK = {"attempt": 1, "hosts": ["node0000"] * 4 + ["node0001"] * 4, "flagged_ranks": [6],
              "flagged_hosts": ["node0001"], "enforced": False,
              "ranks": {str(r): {"gemm_tflops": 20.0 if r == 6 else 100.0, "p2p_in_gbps": 10.0} for r in range(8)},
              "decision": {"action": "continue", "reason": "not enforced: recorded only"}}


@pytest.fixture(scope="module")
def runs(simulated_run) -> tuple[Path, Path]:
    """A run that restarted once (incident log, self-check record) and a clean one."""
    run = simulated_run(dp=2, tp=2, pp=2, steps=8)
    (run / "incidents.jsonl").write_text("\n".join(json.dumps(x) for x in INCIDENTS) + "\n")
    (run / "self_check").mkdir()
    (run / "self_check" / "attempt-01.json").write_text(json.dumps(SELF_CHECK))
    return run, simulated_run(dp=2, tp=1, pp=1, steps=3)


@pytest.fixture(scope="module")
def pages(runs):
    app = create_app(list(runs))
    from megascope.dashboard.pages import overview, topology

    with app.server.test_request_context():
        yield dict(overview=overview, topology=topology)


def test_overview_lists_incidents_recovery_and_self_checks(pages):
    *_, incidents = pages["overview"].refresh(0, 0)
    text = _text(incidents)
    assert "rank 5 stalled 30 s in all_reduce" in text and "2023-11-14 22:13:20 UTC" in text
    assert "restart" in text and "resumed" in text
    assert "recovery(s)" in text and "14.5" in text               # failure to resumed training
    assert "gemm_tflops 20 vs 100" in text and "node0001" in text  # the flagged rank against the median
    assert "continue" in text and "recorded only" in text
    assert "nan" not in text.lower() and "None" not in text  # fields a record lacks are blank


def test_topology_marks_flagged_ranks_and_says_why(pages):
    figure, banner = pages["topology"].update_grid("step_time", None, 0, 0)
    marks = next(t for t in figure.data if t.name == "incident / self-check")
    assert sorted(int(r) for r in marks.customdata) == [5, 6]
    why = dict(zip((int(r) for r in marks.customdata), marks.text))
    assert "stall" in why[5] and "self-check before attempt 1" in why[6]
    assert "[5, 6]" in _text(banner)
    details = _text(pages["topology"].update_details(5, 0, 0))
    assert "stall (attempt 0): rank 5 stalled 30 s in all_reduce" in details


def test_a_clean_run_has_no_marks_and_says_no_incidents(pages):
    assert "No incidents" in _text(pages["overview"].refresh(1, 0)[-1])
    figure, banner = pages["topology"].update_grid("step_time", None, 1, 0)
    assert not [t for t in figure.data if t.name == "incident / self-check"]
    assert "flagged" not in _text(banner)


def test_a_new_incident_line_refreshes_the_pages(tmp_path):
    (tmp_path / "incidents.jsonl").write_text(json.dumps(INCIDENTS[0]) + "\n")
    before = directory_signature(tmp_path)
    time.sleep(0.01)
    with open(tmp_path / "incidents.jsonl", "a") as log:
        log.write(json.dumps({"time": T0 + 30, "kind": "dead_rank", "attempt": 1, "ranks": [2],
                              "detail": "rank 2 died", "action": "restart"}) + "\n")
    assert directory_signature(tmp_path) != before
