"""The analyzer's readers of incidents and self-check records."""

from __future__ import annotations

import json

from megascope.analyzer.views import incidents, self_check_records


def test_incidents_and_recovery_time(tmp_path):
    lines = [{"time": 100.0, "kind": "dead_rank", "attempt": 0, "ranks": [1], "detail": "rank 1 died",
              "action": "restart"},
             {"time": 104.0, "kind": "restart", "attempt": 1, "detail": "attempt 1"},
             {"time": 107.5, "kind": "resumed", "attempt": 1, "step": 4, "detail": "step 4 done"}]
    (tmp_path / "incidents.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{cut")
    warnings: list[str] = []
    df = incidents.read_incidents(tmp_path, warnings)
    assert list(df.kind) == ["dead_rank", "restart", "resumed"] and len(warnings) == 1
    rec = incidents.recovery_times(df)
    assert rec.to_dict("records") == [{"attempt": 1, "failure": "dead_rank", "ranks": [1], "resumed_step": 4,
                                       "recovery_s": 7.5}]
    assert incidents.summarize(df)[-1] == "attempt 1: training resumed 7.5 s after the dead_rank"
    assert incidents.read_incidents(tmp_path / "none").empty


def test_self_check_records(tmp_path):
    (tmp_path / "self_check").mkdir()
    (tmp_path / "self_check" / "attempt-01.json").write_text(json.dumps({
        "attempt": 1, "hosts": ["a", "b"], "flagged_ranks": [1], "flagged_hosts": ["b"], "enforced": True,
        "ranks": {"0": {"gemm_tflops": 100.0}, "1": {"gemm_tflops": 20.0}},
        "decision": {"action": "stop", "reason": "dp would change"}}))
    records = self_check_records.read_self_checks(tmp_path)
    ranks = self_check_records.self_check_ranks(records[0])
    assert ranks.flagged.tolist() == [False, True] and ranks.host.tolist() == ["a", "b"]
    assert "ranks [1] (hosts ['b'])" in self_check_records.summarize(records)[0]


def test_incidents_and_self_checks_reach_the_facade_and_the_report(tmp_path, simulated_run):
    from megascope.analyzer import Run, build_report
    from megascope.analyzer.report.build import render_text
    from megascope.analyzer.report.html import write_html
    from megascope.analyzer.report.plots import plot_data

    run_dir = simulated_run(dp=2, tp=1, pp=1, steps=4)
    lines = [{"time": 10.0, "kind": "stall", "attempt": 0, "ranks": [1], "detail": "rank 1 stalled 5 s in all_reduce",
              "action": "restart"},
             {"time": 22.0, "kind": "resumed", "attempt": 1, "step": 2, "detail": "step 2 done"}]
    (run_dir / "incidents.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    (run_dir / "self_check").mkdir()
    (run_dir / "self_check" / "attempt-01.json").write_text(json.dumps({
        "attempt": 1, "hosts": ["a", "a"], "flagged_ranks": [], "flagged_hosts": [], "enforced": False,
        "ranks": {"0": {"gemm_tflops": 1.0}, "1": {"gemm_tflops": 1.1}},
        "decision": {"action": "continue", "reason": "no rank below its peers"}}))

    run = Run.open(run_dir)
    assert list(run.incidents().kind) == ["stall", "resumed"]
    assert run.recovery_times().recovery_s.tolist() == [12.0]
    assert run.self_checks()[0]["decision"]["action"] == "continue"
    run.incidents()
    assert sum("incidents.jsonl line 3" in w for w in run.warnings) == 1   # once, however often read

    report = build_report(run, with_what_if=False)
    robust = report["robustness"]
    assert [i["kind"] for i in robust["incidents"]] == ["stall", "resumed"]
    assert robust["recovery"][0]["recovery_s"] == 12.0 and robust["self_checks"][0]["attempt"] == 1
    json.dumps(report, allow_nan=False)
    text = render_text(report)
    assert "Incidents, restarts and self-checks:" in text
    assert "attempt 1: training resumed 12.0 s after the stall" in text
    assert "decision continue" in text
    page = write_html(report, plot_data(run), tmp_path / "r.html").read_text()
    assert "Incidents and restarts" in page and "rank 1 stalled 5 s" in page


def test_report_of_a_run_without_incidents_has_empty_robustness(simulated_run):
    from megascope.analyzer import Run, build_report
    from megascope.analyzer.report.build import render_text

    report = build_report(Run.open(simulated_run(dp=2, tp=1, pp=1, steps=3)), with_what_if=False)
    assert report["robustness"] == {"incidents": [], "recovery": [], "self_checks": [], "summary": []}
    assert "Incidents" not in render_text(report)
