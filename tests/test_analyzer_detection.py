"""Each fault kind is found with the right kind, rank and onset; clean runs and victims are not blamed."""

import pytest

from megascope.analyzer import Run

LAYOUT = dict(dp=4, tp=2, pp=4, steps=30)


def analyze(simulated_run, *inject, seed=0, **layout):
    return Run.open(simulated_run(**{**LAYOUT, **layout}, seed=seed, inject=list(inject)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_run_has_no_findings(simulated_run, seed):
    run = analyze(simulated_run, seed=seed)
    assert [f.summary for f in run.findings()] == []
    assert run.hang() is None


def test_straggler_found_at_onset_and_victims_not_blamed(simulated_run):
    run = analyze(simulated_run, "straggler:rank=13,slowdown=0.05,from=10")
    found = run.findings()
    assert [(f.kind, f.ranks) for f in found] == [("straggler", [13])]
    f = found[0]
    assert abs(f.steps[0] - 10) <= 3 and f.steps[1] == 29
    assert 1.03 < f.severity < 1.08
    assert f.evidence["cause"] == "slow_compute"
    assert f.evidence["collectives_arrived_last"] > 0   # its tp peer waited on it: the arrival skew
    # its tp peer (12) and pipeline neighbours wait longer but are not blamed
    bd = run.breakdown((15, 29)).groupby("rank").exposed_comm_s.mean()
    assert bd[12] > bd[13]


def test_straggler_that_recovers(simulated_run):
    run = analyze(simulated_run, "straggler:rank=2,slowdown=0.2,from=5,to=14")
    (f,) = run.findings()
    assert f.kind == "straggler" and f.ranks == [2] and abs(f.steps[0] - 5) <= 1 and abs(f.steps[1] - 14) <= 1


def test_late_launch_is_not_slow_compute(simulated_run):
    run = analyze(simulated_run, "late_launch:rank=21,ms=15,every=2,from=6")
    (f,) = run.findings()
    assert f.kind == "late_launch" and f.ranks == [21] and abs(f.steps[0] - 6) <= 3
    assert f.evidence["period_steps"] == 2 and 10 < f.evidence["excess_ms"] < 20


def test_stage_imbalance_reported_as_stage(simulated_run):
    run = analyze(simulated_run, "imbalance:stage=1,slowdown=0.1")
    (f,) = run.findings()
    assert f.kind == "stage_imbalance" and f.evidence["stage"] == 1 and len(f.ranks) == 8


def test_host_aggregation(simulated_run):
    # 32 ranks per stage, 8 per host: node0001 (ranks 8-15) is a quarter of stage 0
    run = analyze(simulated_run, "straggler:ranks=8-15,slowdown=0.1,from=3", dp=16, tp=2, pp=2, steps=20)
    (f,) = run.findings()
    assert f.kind == "straggler" and f.hosts == ["node0001"] and f.ranks == list(range(8, 16))


def test_flap_vs_steadily_slow_link(simulated_run):
    flap = analyze(simulated_run, "flap:ranks=3-11,down_ms=20,period_steps=6,len=2")
    (f,) = flap.findings()
    assert f.kind == "network_flap" and f.ranks == [3, 11]
    assert f.evidence["episode_count"] >= 3 and f.evidence["episodes"][0]["first_step"] == 6
    slow = analyze(simulated_run, "slow_link:ranks=3-11,factor=3")
    (g,) = slow.findings()
    assert g.kind == "slow_link" and g.ranks == [3, 11] and 2.5 < g.severity < 3.5


def test_flapping_collective_group(simulated_run):
    run = analyze(simulated_run, "flap:ranks=0-2,down_ms=200,period_steps=8")  # dp group of pp0/tp0
    (f,) = run.findings()
    assert f.kind == "network_flap" and f.evidence["group"] == "dp" and {0, 2} <= set(f.ranks)


def test_hang_suspects(simulated_run):
    run = analyze(simulated_run, "hang:rank=19,at=12")
    hang = run.hang()
    assert hang is not None and hang.suspects == [19] and 19 not in hang.waiting and hang.step == 12
    assert run.findings()[0].kind == "hang"


def test_injected_detectors_either_form_after_the_hang_check(simulated_run):
    """Run.open(path, detectors=[...]) takes detect(ctx: DetectContext) and the older detect(store); the
    hang check runs first either way, and its report is the one Run.hang() gives."""
    from megascope.analyzer.data.store import Store
    from megascope.analyzer.detect.context import DetectContext
    from megascope.analyzer.detect.stragglers import StragglerDetector
    from megascope.analyzer.findings import Finding

    seen: list[object] = []

    class OldForm:
        def detect(self, store):  # unannotated: the store, as before DetectContext
            seen.append(store)
            return [Finding("straggler", [3], [], (5, 6), 1.5, "rank 3 is slow", {})]

    class NewForm:
        def detect(self, ctx: DetectContext) -> list[Finding]:
            seen.append(ctx)
            return []

    path = simulated_run(**LAYOUT, seed=0, inject=["hang:rank=19,at=12"])
    run = Run.open(path, detectors=[OldForm(), NewForm()])
    found = run.findings()
    assert isinstance(seen[0], Store) and seen[1] is run.context
    assert [(f.kind, f.ranks) for f in found] == [("hang", [19]), ("straggler", [3])]
    assert run.hang() is run.context.hang() and run.hang().suspects == [19]
    # the straggler detector's grid is left in the context for the workload imbalance detector
    run = Run.open(path, detectors=[StragglerDetector()])
    run.findings()
    assert run.context.peer_grid is not None and set(run.context.peer_grid.values) == {"step_time_s", "work_s"}


def test_what_if_recovers_lost_time(simulated_run):
    run = analyze(simulated_run, "straggler:rank=5,slowdown=0.3,from=5")
    (f,) = run.findings()
    wi = run.what_if(f)
    assert wi["applicable"] and wi["saved_per_step_s"] > 0 and 0 < wi["throughput_lost"] < 0.3


def test_interleaved_layout(simulated_run):
    run = analyze(simulated_run, "straggler:rank=6,slowdown=0.08,from=4", dp=2, tp=2, pp=2, vpp=2, steps=16)
    assert [(f.kind, f.ranks) for f in run.findings()] == [("straggler", [6])]
