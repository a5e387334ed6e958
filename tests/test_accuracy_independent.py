"""The independent trace generator (samples/independent_gen.py) through the real importer, and the
analyzer's verdicts on its traces (the cases of issue 13; the full held-out suite is
benchmarks/accuracy_independent.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from megascope.analyzer import Run
from megascope.samples.independent_gen import GenSpec, Noise, SlowRank, import_run, trace_frame, true_step_times


def _verdicts(spec: GenSpec, tmp: Path) -> list[tuple[str, list[int]]]:
    return [(f.kind, sorted(f.ranks)) for f in Run.open(import_run(spec, tmp)).findings()]


def test_round_trip_through_the_importer(tmp_path: Path):
    spec = GenSpec(dp=2, tp=2, pp=3, steps=6, micro=4, traced="tp0", missing=[(1, 2)],
                   noise=Noise(kind="student_t", sigma=0.05, gc_prob=0.2, gc_s=0.003, seq_sigma=0.1))
    frame = trace_frame(spec)
    run = Run.open(import_run(spec, tmp_path))
    # tp rank 0 of each (dp, stage), less the missing worker
    expected = sorted(spec.rank(d, s) for d in range(2) for s in range(3) if (d, s) != (1, 2))
    assert sorted(run.topology["rank"]) == expected
    assert sorted(frame["rank"].unique()) == expected
    ev = run.events(steps=(0, spec.steps - 1))
    # every NDTimeline row is an event (the combined p2p ops are two)
    combined = frame.optype.isin(["forward-send-backward-recv", "backward-send-forward-recv"]).sum()
    assert len(ev) == len(frame) + combined
    # 1F1B: each stage computes every micro-batch forward and backward once per step
    per = ev[ev.kind == "compute"].groupby(["rank", "step", "name"]).size()
    assert set(per.loc[(slice(None), slice(None), ["forward", "backward"])]) == {spec.micro}
    # p2p: every send on a traced link has its receive (the k-th send A->B is the k-th recv on B)
    sends = ev[ev.name == "send_forward"].set_index(["rank", "peer", "seq"]).index
    recvs = ev[ev.name == "recv_forward"].set_index(["peer", "rank", "seq"]).index
    linked = {k for k in sends if k[1] in expected}
    assert linked and linked == {k for k in recvs if k[0] in expected}
    # the imported steps span the generated step times (less the gap between steps)
    steps = run.steps().groupby("step").agg(start=("start_ns", "min"), end=("end_ns", "max"))
    true = true_step_times(spec)
    # (within the untraced ranks' optimizer jitter)
    assert np.allclose((steps.end - steps.start).to_numpy() / 1e9, true - spec.step_gap_s, atol=1e-4)


def test_fault_free_twin_draws_the_same_noise():
    slow = SlowRank(dp=1, stage=0, fwd=1.7, bwd=1.4, first=3)
    spec = GenSpec(dp=2, pp=2, steps=8, noise=Noise(kind="pareto", sigma=0.1, step_sigma=0.1), faults=[slow])
    a, b = trace_frame(spec), trace_frame(spec.fault_free())
    key = ["rank", "step", "optype", "mb_id"]
    fwd = [x[x.optype == "forward-compute"].set_index(key).duration for x in (a, b)]
    ratio = (fwd[0] / fwd[1]).unstack("step")
    slow_rank = spec.rank(1, 0)
    assert np.allclose(ratio.loc[slow_rank].loc[:, 3:], 1.7)           # the fault, exactly
    assert np.allclose(ratio.loc[slow_rank].loc[:, :2], 1.0)           # before its onset: the same draws
    assert np.allclose(ratio.drop(index=slow_rank, level="rank"), 1.0)  # the other ranks: the same draws
    assert (true_step_times(spec)[3:] > true_step_times(spec.fault_free())[3:]).all()


def test_waits_are_rendezvous_and_groups_wait_for_their_slowest():
    # a slow tp member: its tp peer's spans end with it (tp collectives), the next stage waits for the data
    spec = GenSpec(dp=1, tp=2, pp=2, steps=2, micro=2, noise=Noise(sigma=0.0),
                   faults=[SlowRank(dp=0, stage=0, tp=1, fwd=2.0, bwd=1.0)])
    f = trace_frame(spec)
    fwd = f[(f.optype == "forward-compute") & (f.stage == 0)].pivot_table(
        index=["step", "mb_id"], columns="rank", values="duration")
    assert np.allclose(fwd[0], fwd[1]) and np.allclose(fwd[0], 2 * spec.fwd_s)
    recv = f[(f.optype == "forward-recv") & (f.stage == 1) & (f.mb_id == 0)]
    assert (recv.duration >= 2 * spec.fwd_s).all()  # stage 1 waited for stage 0's slow first forward
    assert isinstance(f, pd.DataFrame)


def test_straggler_from_the_first_step_in_a_partial_trace(tmp_path: Path):
    # issue 13 case 1: tp rank 0 of each tp group traced, stage 0 / replica 0 slow from step 0; its
    # pipeline neighbours wait in blocking sends (not host gaps: no late launch on them)
    spec = GenSpec(dp=4, tp=4, pp=4, steps=44, micro=8, traced="tp0", seed=5,
                   noise=Noise(sigma=0.03, gc_prob=0.05, gc_s=0.004, p2p_sigma=0.2),
                   faults=[SlowRank(dp=0, stage=0, fwd=2.5, bwd=2.3)])
    findings = Run.open(import_run(spec, tmp_path)).findings()
    assert [(f.kind, f.ranks) for f in findings] == [("straggler", [0])]
    assert 2.2 <= findings[0].severity <= 2.6 and findings[0].steps == (0, 43)


def test_sustained_slowdown_under_heavy_noise_and_its_clean_twin(tmp_path: Path):
    # issue 13 case 2 (shorter): 1.6x from 45% of the run, per-step sigma ~0.27 of the log ratio
    spec = GenSpec(dp=2, pp=2, steps=600, micro=4, seed=7, noise=Noise(sigma=0.02, step_sigma=0.19),
                   faults=[SlowRank(dp=1, stage=0, fwd=1.6, bwd=1.6, first=270)])
    findings = Run.open(import_run(spec, tmp_path / "slow")).findings()
    assert [(f.kind, f.ranks) for f in findings] == [("straggler", [1])]
    assert abs(findings[0].steps[0] - 270) <= 12
    assert _verdicts(spec.fault_free(), tmp_path / "clean") == []


def test_workload_imbalance_blames_no_rank(tmp_path: Path):
    # issue 13 case 3 (smaller): sequence imbalance that persists over a few steps, and one replica
    # whose data turns long for the rest of the run: its ranks on both stages are slow together
    spec = GenSpec(dp=16, pp=2, cp=2, steps=40, micro=4, seed=3,
                   noise=Noise(sigma=0.02, seq_sigma=0.25, seq_rho=0.8),
                   faults=[SlowRank(dp=5, stage=s, cp=c, fwd=1.4, bwd=1.4, first=20) for s in (0, 1) for c in (0, 1)])
    assert [kind for kind, _ in _verdicts(spec, tmp_path)] == ["workload_imbalance"]


def test_a_tp_group_that_waits_for_one_slow_gpu_is_one_finding(tmp_path: Path):
    spec = GenSpec(dp=4, tp=2, pp=2, steps=40, micro=4, seed=2, noise=Noise(sigma=0.03),
                   faults=[SlowRank(dp=1, stage=1, tp=1, fwd=1.3, bwd=1.3, first=10)])
    (finding,) = Run.open(import_run(spec, tmp_path)).findings()
    assert finding.kind == "straggler" and finding.ranks == [spec.rank(1, 1, 0), spec.rank(1, 1, 1)]
    assert "context-parallel group" in finding.summary and finding.steps[0] == 10
