"""The event pass: the sort-free (flat) pass and the timeline pass agree on traces whose spans do not
nest; batches of ranks (each reading its own events and steps) give the same tables as one batch;
a damaged segment found mid-pass is dropped from its batch and the rest analyzed."""

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer import event_pass as ep
from megascope.analyzer.store import Store
from megascope.samples.simulator import SimConfig, simulate

EXACT = ["compute_s", "forward_s", "backward_s", "optimizer_s", "recv_s", "collective_s", "data_wait_s",
         "step_time_s", "tokens", "n_events"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return simulate(tmp_path_factory.mktemp("event_pass") / "run",
                    SimConfig(dp=2, tp=2, pp=4, steps=6, inject=["straggler:rank=9,slowdown=0.5,from=2",
                                                                "late_launch:rank=5,ms=20,every=2,from=1"]))


def _tables(run_dir, monkeypatch, timeline: bool, batch_ranks: int = ep.BATCH_RANKS):
    monkeypatch.setattr(ep, "TIMELINE_ALWAYS_RANKS", 1 if not timeline else 10**9)
    monkeypatch.setattr(ep, "needs_timeline", lambda store, base: timeline)
    monkeypatch.setattr(ep, "BATCH_RANKS", batch_ranks)
    store = Store(run_dir)
    ep.build_event_pass(store)
    rs = store.query("SELECT * FROM rank_step ORDER BY rank, step")
    ci = store.query('SELECT * FROM collective_instances ORDER BY "group", instance, seq')
    rps = store.query("SELECT * FROM _rank_peer_step ORDER BY rank, step, peer")
    leftovers = store.query("SELECT table_name FROM duckdb_tables() WHERE table_name LIKE '\\_batch%' ESCAPE '\\'")
    assert leftovers.empty
    return rs, ci, rps


def test_flat_pass_matches_timeline_pass(run_dir, monkeypatch):
    rs_t, ci_t, rps_t = _tables(run_dir, monkeypatch, timeline=True)
    rs_f, ci_f, rps_f = _tables(run_dir, monkeypatch, timeline=False)
    assert len(rs_t) == len(rs_f) == 16 * 6
    pd.testing.assert_frame_equal(rs_t[["rank", "step"] + EXACT], rs_f[["rank", "step"] + EXACT], check_dtype=False)
    assert (rs_t.nested_wait_s == 0).all()  # the simulator's spans do not nest: the flat pass applies
    # gaps: the timeline's host gaps vs the step residual, equal within the check's 1% of the step
    np.testing.assert_allclose(rs_f.gap_s, rs_t.gap_s, atol=0.01 * rs_t.step_time_s.max())
    pd.testing.assert_frame_equal(ci_t, ci_f, check_dtype=False)
    keep = ["rank", "step", "peer", "compute_ns", "recv_ns", "collective_ns", "send_min_ns", "sends", "recv_min_ns"]
    pd.testing.assert_frame_equal(rps_t[keep], rps_f[keep], check_dtype=False)
    assert ci_f.members.max() == 2 and (ci_f.last_rank >= 0).all()


@pytest.mark.parametrize("timeline", [True, False])
def test_batches_match_one_batch(run_dir, monkeypatch, timeline):
    one = _tables(run_dir, monkeypatch, timeline=timeline)
    store = Store(run_dir)
    batches = store.rank_prefix_batches(3)
    assert batches is not None and len(batches) == 6 and sum(len(b) for b in batches) == 16
    many = _tables(run_dir, monkeypatch, timeline=timeline, batch_ranks=3)
    for a, b in zip(one, many):
        pd.testing.assert_frame_equal(a, b, check_dtype=False)


def test_batch_sources_cover_each_rank_once(run_dir):
    store = Store(run_dir)
    assert store.rank_prefix_batches(1024) is None  # small run: one batch, the views
    seen = []
    for batch in store.rank_prefix_batches(4):
        for table in ("events", "steps"):
            ranks = store.query(f"SELECT DISTINCT rank FROM {store.batch_source(table, batch)}")["rank"].tolist()
            if table == "events":
                seen += ranks
            else:
                assert sorted(ranks) == sorted(seen[-len(ranks):])
    assert sorted(seen) == list(range(16))


def test_damaged_segment_mid_pass_is_dropped(run_dir, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    victim = sorted((copy / "events" / "rank=00006").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: 100])  # truncated
    monkeypatch.setattr(ep, "BATCH_RANKS", 3)
    monkeypatch.setattr(ep, "TIMELINE_ALWAYS_RANKS", 1)
    monkeypatch.setattr(ep, "needs_timeline", lambda store, base: False)
    store = Store(copy)
    store.files["events"].append(str(victim))  # as if listed before the open-time check caught it
    store.warnings.clear()
    store._excluded.discard("events")
    store._make_view("events")
    ep.build_event_pass(store)
    assert any("rank=00006" in w for w in store.warnings)
    rs = store.query("SELECT rank, count(*) AS n, sum(n_events) AS ev FROM rank_step GROUP BY rank ORDER BY rank")
    assert len(rs) == 16 and (rs.n == 6).all()  # its steps are still read
    assert (rs.ev[rs["rank"] != 6] > 0).all() and (rs.ev[rs["rank"] == 6] == 0).all()


def _add_init_events(run_dir, ranks, step=-1):
    """Events before the first step (init, importers): a segment per rank at a negative step."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megascope.tracer.schema import EVENTS
    first = pq.read_table(sorted((run_dir / "steps" / "rank=00000").glob("*.parquet"))[0]).column("start_ns")[0].as_py()
    for r in ranks:
        rows = [{"rank": r, "step": step, "microbatch": -1, "chunk": -1, "name": name, "kind": "host",
                 "group": "", "seq": -1, "peer": -1, "bytes": 0, "issue_ns": first - 10_000_000 + 1000 * i,
                 "start_ns": first - 10_000_000 + 1000 * i, "end_ns": first - 10_000_000 + 1000 * i + 500}
                for i, name in enumerate(["init_process_group", "build_model", "load_checkpoint"])]
        table = pa.Table.from_pylist(rows, schema=pa.schema([EVENTS.field(f.name) for f in EVENTS]))
        pq.write_table(table, run_dir / "events" / f"rank={r:05d}" / "seg-init.parquet")


def test_event_ids_before_the_first_step(run_dir, tmp_path):
    import shutil
    from megascope.analyzer import Run
    from megascope.analyzer.step_graph import event_id, event_id_parts
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    _add_init_events(copy, [0, 1, 15])
    run = Run.open(copy)
    ev = run.events((-1, 1))
    assert ev.event_id.is_unique and (ev.event_id >= 0).all()
    init = ev[ev.step == -1]
    assert len(init) == 9 and set(init["rank"]) == {0, 1, 15}
    for r in ev.itertuples():
        rank, step, pos = event_id_parts(r.event_id)
        assert (rank, step) == (r.rank, r.step) and event_id(rank, step, pos) == r.event_id
    # the same ids whatever window or rank filter is asked for
    again = run.events((-1, -1), ranks=[15]).set_index("event_id")
    assert list(again.name) == ["init_process_group", "build_model", "load_checkpoint"]
    assert set(again.index) <= set(init.event_id)
    # ids of the first step do not collide with those of step -1, on rank 0 or its neighbours
    assert not set(init.event_id) & set(ev[ev.step >= 0].event_id)
    assert event_id_parts(event_id(0, -256, 0)) == (0, -256, 0) and event_id(0, -256, 0) >= 0
    # the analysis still runs: init events sit outside every step's rank_step row
    assert len(run.rank_steps()) == 16 * 6 and run.dependencies(0).src_event_id.isin(ev.event_id).all()
