"""The analyzer's readers of incidents and self-check records."""

from __future__ import annotations

import json

from megascope.analyzer import incidents, self_checks


def test_incidents_and_recovery_time(tmp_path):
    lines = [{"time": 100.0, "kind": "dead_rank", "attempt": 0, "ranks": [1], "detail": "rank 1 died", "action": "restart"},
             {"time": 104.0, "kind": "restart", "attempt": 1, "detail": "attempt 1"},
             {"time": 107.5, "kind": "resumed", "attempt": 1, "step": 4, "detail": "step 4 done"}]
    (tmp_path / "incidents.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{cut")
    warnings: list[str] = []
    df = incidents.read_incidents(tmp_path, warnings)
    assert list(df.kind) == ["dead_rank", "restart", "resumed"] and len(warnings) == 1
    rec = incidents.recovery_times(df)
    assert rec.to_dict("records") == [{"attempt": 1, "failure": "dead_rank", "ranks": [1], "resumed_step": 4,
                                       "recovery_s": 7.5}]
    assert incidents.summarize(tmp_path)[-1] == "attempt 1: training resumed 7.5 s after the dead_rank"
    assert incidents.read_incidents(tmp_path / "none").empty


def test_self_check_records(tmp_path):
    (tmp_path / "self_check").mkdir()
    (tmp_path / "self_check" / "attempt-01.json").write_text(json.dumps({
        "attempt": 1, "hosts": ["a", "b"], "flagged_ranks": [1], "flagged_hosts": ["b"], "enforced": True,
        "ranks": {"0": {"gemm_tflops": 100.0}, "1": {"gemm_tflops": 20.0}},
        "decision": {"action": "stop", "reason": "dp would change"}}))
    records = self_checks.read_self_checks(tmp_path)
    ranks = self_checks.self_check_ranks(records[0])
    assert ranks.flagged.tolist() == [False, True] and ranks.host.tolist() == ["a", "b"]
    assert "ranks [1] (hosts ['b'])" in self_checks.summarize(tmp_path)[0]
