"""samples/edge_gen.py: a job written straight as summaries at the edge is read from them (no events),
its steps add up, and the analyzer names each planted fault on its rank(s) from its first step, and
nothing else."""

from __future__ import annotations

import pytest

from megascope.analyzer import Run
from megascope.analyzer.data import event_pass as ep
from megascope.samples.edge_gen import EdgeGenConfig, Fault, generate

DP = 4  # x tp 8 x pp 8: 256 ranks, stage s = ranks 32s..32s+31, tp groups of 8


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    cfg = EdgeGenConfig(dp=DP, tp=8, pp=8, steps=200, faults=[
        Fault("straggler", [45], 100, factor=1.3),
        Fault("late_launch", [117], 66, ms=60.0, every=2),
        Fault("flap", [9, 41], 40, ms=10.0, period=10, length=3)])
    return generate(tmp_path_factory.mktemp("edge-gen") / "run", cfg, batch_ranks=64), cfg


def test_read_from_the_summaries_and_steps_add_up(job):
    path, _ = job
    run = Run.open(path)
    assert ep.edge_summaries_cover(run.store) and not run.store.files["events"]
    run.derived.rank_step()
    rs = run.store.query("SELECT count(*) AS n, max(abs(step_time_s - own_s - recv_s - collective_s)) AS err, "
                         "min(collective_s) AS coll, min(recv_s) AS recv FROM rank_step")
    assert int(rs.n.iloc[0]) == 256 * 200
    assert float(rs.err.iloc[0]) < 1e-8  # the model tiles each step exactly (ns rounding aside)
    assert float(rs.coll.iloc[0]) > 0 and float(rs.recv.iloc[0]) > 0


def test_verdict_names_each_fault_from_its_onset(job):
    path, cfg = job
    found = {(f.kind, tuple(f.ranks), f.steps[0]) for f in Run.open(path).findings()}
    assert found == {("straggler", (45,), 100), ("late_launch", (117,), 66), ("network_flap", (9, 41), 40)}


def test_refuses_a_folder_holding_a_run(job):
    path, cfg = job
    with pytest.raises(FileExistsError, match="already holds a run"):
        generate(path, cfg)
