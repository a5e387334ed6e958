"""The Run facade: MFU, breakdown, heatmap, events, dependency graph, critical path; bad input."""

import json

import numpy as np
import pytest

from megascope.analyzer import Run, RunOpenError, build_report


@pytest.fixture(scope="module")
def run_dir(simulated_run):
    return simulated_run(dp=2, tp=2, pp=4, steps=8, inject=["straggler:rank=9,slowdown=0.5,from=2"])


@pytest.fixture(scope="module")
def run(run_dir):
    return Run.open(run_dir)


def test_topology_and_steps(run):
    assert list(run.topology.columns) == ["rank", "pp", "dp", "tp", "host", "local_rank", "cp"]
    assert len(run.topology) == 16 and run.warnings == []
    steps = run.steps()
    assert len(steps) == 16 * 8 and steps.loss[steps["rank"] < 12].isna().all()


def test_mfu(run):
    mfu = run.mfu()
    assert list(mfu.per_step.step) == list(range(8))
    assert 0.05 < mfu.mean < 0.6 and (mfu.per_step.tokens_per_s > 0).all()
    assert set(mfu.per_rank.columns) >= {"rank", "step", "step_time_s", "mfu"} and len(mfu.per_rank) == 128


def test_breakdown_sums_to_step_time(run):
    bd = run.breakdown((2, 5))
    assert set(bd.step) == {2, 3, 4, 5}
    parts = bd[["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]].sum(axis=1).to_numpy()
    st = run.rank_steps().set_index(["step", "rank"]).step_time_s.loc[list(zip(bd.step, bd["rank"]))].to_numpy()
    np.testing.assert_allclose(parts, st, rtol=1e-6)


def test_heatmap_downsamples_and_groups(run):
    hm = run.heatmap("compute", max_rows=4, max_cols=3)
    assert hm.values.shape == (4, 3) and hm.rows[0] == "0..3" and hm.cols == [0, 3, 6]
    by_stage = run.heatmap("compute", group_by="pp")
    assert by_stage.rows == ["0", "1", "2", "3"]
    assert np.nanargmax(by_stage.values[:, -1]) == 2   # stage 2 holds the straggler (rank 9)
    for metric in ("forward", "backward", "exposed_comm", "lateness", "step_time", "mfu"):
        assert run.heatmap(metric, group_by="host").values.size
    with pytest.raises(ValueError):
        run.heatmap("nonsense")


def test_events_ids_are_stable(run):
    a = run.events((3, 3))
    b = run.events((2, 4), ranks=[5])
    assert a.event_id.is_unique
    merged = b[b.step == 3].merge(a, on="event_id", suffixes=("", "_a"))
    assert len(merged) == len(b[b.step == 3]) and (merged.name == merged.name_a).all()


def test_dependencies_and_critical_path(run):
    edges = run.dependencies(4)
    assert set(edges.kind) == {"program_order", "p2p", "collective"}
    ev = run.events((4, 4)).set_index("event_id")
    assert edges.src_event_id.isin(ev.index).all() and edges.dst_event_id.isin(ev.index).all()
    p2p = edges[edges.kind == "p2p"]
    assert (ev.loc[p2p.src_event_id].name.str.startswith("send").to_numpy()).all()
    path = run.critical_path(4)
    assert path.end_ns.is_monotonic_increasing and path.end_ns.iloc[-1] == ev.end_ns.max()
    assert 9 in set(path["rank"])            # the straggler bounds the step
    assert (path.duration_s >= 0).all()
    prop = run.propagation(4)
    assert {"src_rank", "dst_rank", "wait_s"} <= set(prop.columns)


def test_report_is_json(run):
    rep = build_report(run)
    json.dumps(rep, allow_nan=False, default=str)
    assert rep["findings"][0]["kind"] == "straggler" and rep["findings"][0]["ranks"] == [9]
    assert rep["findings"][0]["what_if"]["applicable"]
    assert run.gpu().empty  # no NVML samples in a simulated run


def test_bad_directories(tmp_path):
    with pytest.raises(RunOpenError, match="does not exist"):
        Run.open(tmp_path / "nope")
    with pytest.raises(RunOpenError, match="not a megascope run directory"):
        Run.open(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"schema_version": 99, "topology": {}}))
    with pytest.raises(RunOpenError, match="schema v99"):
        Run.open(tmp_path)


def test_corrupt_and_truncated_segments_are_skipped(simulated_run):
    out = simulated_run(dp=2, tp=1, pp=2, steps=4)
    seg = out / "events" / "rank=00001" / "seg-000000.parquet"
    seg.write_bytes(seg.read_bytes()[: len(seg.read_bytes()) // 2])        # truncated
    (out / "events" / "rank=00002" / "seg-000001.parquet").write_bytes(b"PAR1garbage")  # foreign
    run = Run.open(out)
    assert len(run.warnings) == 2 and all("skipped damaged segment" in w for w in run.warnings)
    assert set(run.events((0, 3))["rank"]) == {0, 2, 3}
    assert run.mfu().per_step.step.tolist() == [0, 1, 2, 3]
    run.findings()


def test_memory_limited_yields_duckdb_memory_and_takes_it_back_for_a_query_that_needs_it(run):
    """Store.memory_limited (the detectors' phase): DuckDB's limit is lowered inside and restored after;
    a query that runs out of memory under the lower limit (a list aggregate of 2M integers: 16 MB,
    which cannot spill, at 4 MB) runs again with the full limit instead of failing the analysis."""
    store = run.store
    limit = "SELECT current_setting('memory_limit') AS v"
    full = store.query(limit).v.iloc[0]
    with store.memory_limited("4MB"):
        assert store.query(limit).v.iloc[0] != full
        rows = store.query("SELECT list(i) AS l FROM range(2000000) t(i)")
        assert len(rows.l.iloc[0]) == 2_000_000
        assert store.query(limit).v.iloc[0] == full  # taken back for the rest of the phase
    assert store.query(limit).v.iloc[0] == full
    with store.memory_limited("4MB"):
        pass
    assert store.query(limit).v.iloc[0] == full
