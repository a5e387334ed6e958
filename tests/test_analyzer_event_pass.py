"""The event pass: the sort-free (flat) pass and the timeline pass agree on traces whose spans do not
nest; batches of ranks (each reading its own events and steps) give the same tables as one batch;
a damaged segment found mid-pass is dropped from its batch and the rest analyzed."""

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer.data import event_pass as ep
from megascope.analyzer.data.store import Store

EXACT = ["compute_s", "forward_s", "backward_s", "optimizer_s", "recv_s", "collective_s", "data_wait_s",
         "step_time_s", "tokens", "n_events"]


@pytest.fixture(scope="module")
def run_dir(simulated_run):
    return simulated_run(dp=2, tp=2, pp=4, steps=6, inject=["straggler:rank=9,slowdown=0.5,from=2",
                                                            "late_launch:rank=5,ms=20,every=2,from=1"])


def _tables(run_dir, monkeypatch, timeline: bool, batch_ranks: int = ep.BATCH_RANKS):
    monkeypatch.setattr(ep, "TIMELINE_ALWAYS_RANKS", 1 if not timeline else 10**9)
    monkeypatch.setattr(ep, "needs_timeline", lambda store, base: timeline)
    monkeypatch.setattr(ep, "BATCH_RANKS", batch_ranks)
    store = Store(run_dir)
    ep.build_event_pass(store)
    rs = store.query("SELECT * FROM rank_step ORDER BY rank, step")
    ci = store.query('SELECT * FROM collective_instances ORDER BY "group", instance, seq')
    rps = store.query("SELECT * FROM _p2p_peer_step ORDER BY rank, step, peer")
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
    keep = ["rank", "step", "peer", "send_min_ns", "sends", "recv_min_ns"]  # the p2p rows (their gaps: as gap_s)
    assert len(rps_t) and (rps_t.peer >= 0).all()
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
    store.damaged.clear()
    store._excluded.discard("events")
    store._make_view("events")
    ep.build_event_pass(store)
    assert any("rank=00006" in w for w in store.warnings)
    assert [d for d in store.damaged] == [("events", str(victim))]
    rs = store.query("SELECT rank, count(*) AS n, sum(n_events) AS ev FROM rank_step GROUP BY rank ORDER BY rank")
    assert len(rs) == 15 and (rs.n == 6).all() and 6 not in set(rs["rank"]) and (rs.ev > 0).all()
    # its only events segment is gone: every step of rank 6 is incomplete (its steps rows are kept aside)
    gone = store.query("SELECT rank, step, n_events FROM rank_step_incomplete ORDER BY step")
    assert set(gone["rank"]) == {6} and gone.step.tolist() == list(range(6)) and (gone.n_events == 0).all()


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
    from megascope.analyzer.data.events_window import event_id, event_id_parts
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


# -- `<op>.wait` spans (the CPU tracer's record of the training thread blocked in wait() on an async op)

def _rewrite_events(run_dir, fn):
    """Apply fn(DataFrame) -> DataFrame to every events segment of run_dir, in place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascope.tracer.schema import EVENTS
    schema = pa.schema([EVENTS.field(f.name) for f in EVENTS])
    for seg in sorted((run_dir / "events").glob("rank=*/*.parquet")):
        ev = fn(pq.read_table(seg).to_pandas())
        pq.write_table(pa.Table.from_pandas(ev, schema=schema, preserve_index=False), seg)


def _with_waits(ev):
    """Ops whose second half overlaps no compute span become async and waited (their `.wait` span is
    that second half: not nested); the other ops become sync (issue = start)."""
    from megascope.tracer.schema import WAIT_SUFFIX
    ev = ev.assign(issue_ns=ev.start_ns)
    ops = ev[ev.kind.isin(["p2p", "collective"])].copy()
    mid = ops.end_ns - (ops.end_ns - ops.start_ns) // 2
    comp = ev[ev.kind == "compute"]
    free = [not ((comp["rank"] == r) & (comp.start_ns < e) & (comp.end_ns > m)).any()
            for r, m, e in zip(ops["rank"], mid, ops.end_ns)]
    ops = ops[free]
    ev.loc[ops.index, "issue_ns"] = ops.start_ns - 1000   # async: enqueued after its issue
    ops["name"] = ops["name"] + WAIT_SUFFIX
    ops["kind"], ops["bytes"] = "host", 0
    ops["issue_ns"] = ops["start_ns"] = ops["end_ns"] - (ops["end_ns"] - ops["start_ns"]) // 2
    return pd.concat([ev, ops], ignore_index=True)


def test_waits_are_the_exposed_time_on_both_passes(run_dir, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    _rewrite_events(copy, _with_waits)
    rs_t, ci_t, rps_t = _tables(copy, monkeypatch, timeline=True)
    rs_f, ci_f, rps_f = _tables(copy, monkeypatch, timeline=False)
    pd.testing.assert_frame_equal(rs_t[["rank", "step"] + EXACT], rs_f[["rank", "step"] + EXACT], check_dtype=False)
    pd.testing.assert_frame_equal(ci_t, ci_f, check_dtype=False)
    assert (rs_t.nested_wait_s == 0).all()
    # the waits and the sync ops, not the async ops, are the rank's collective and p2p time (sends
    # waited count as p2p waits; sync sends outside compute do not count: in flight, not waited)
    ev = Store(copy).query("SELECT rank, step, kind, name, peer, end_ns - start_ns AS d, "
                           "issue_ns = start_ns AS sync FROM events")
    waits = ev[ev.name.str.endswith(".wait")]
    sync = ev[ev.sync & (ev.kind == "collective") | ev.sync & ev.name.str.startswith("recv") & (ev.kind == "p2p")]
    coll = pd.concat([waits[waits.peer < 0], sync[sync.kind == "collective"]]).groupby(["rank", "step"]).d.sum() / 1e9
    p2p = pd.concat([waits[waits.peer >= 0], sync[sync.kind == "p2p"]]).groupby(["rank", "step"]).d.sum() / 1e9
    got = rs_t.set_index(["rank", "step"])
    np.testing.assert_allclose(got.collective_s, coll.reindex(got.index, fill_value=0), atol=1e-9)
    np.testing.assert_allclose(got.recv_s, p2p.reindex(got.index, fill_value=0), atol=1e-9)
    ops = ev[ev.kind == "collective"].groupby(["rank", "step"]).d.sum() / 1e9
    assert (got.collective_s < ops.reindex(got.index, fill_value=0) - 1e-6).any()   # not the op spans
    assert len(waits) > 100 and (waits.peer >= 0).any() and (waits.peer < 0).any()


def _prefetch_waited_in_forward(run_dir, rank, step, gather_ns=3_000_000, wait_ns=1_500_000):
    """Events of run_dir made sync (issue = start), plus on `rank` a ZeRO-style async
    `param_all_gather` issued at the end of step - 1 and its `.wait` nested in step's first forward.
    Returns the wait's duration (ns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascope.tracer.schema import EVENTS, WAIT_SUFFIX
    _rewrite_events(run_dir, lambda ev: ev.assign(issue_ns=ev.start_ns))
    ev = pd.concat([pq.read_table(s).to_pandas() for s in (run_dir / "events" / f"rank={rank:05d}").glob("*.parquet")])
    fwd = ev[(ev.step == step) & (ev.name == "forward")].sort_values("start_ns").iloc[0]
    t0 = int(fwd.start_ns) + 100_000
    assert t0 + wait_ns < fwd.end_ns
    base = {"rank": rank, "microbatch": -1, "chunk": -1, "group": "dp", "seq": 10**6, "peer": -1}
    rows = [dict(base, step=step - 1, name="param_all_gather", kind="collective", bytes=1 << 20,
                 issue_ns=t0 + wait_ns - gather_ns - 1000, start_ns=t0 + wait_ns - gather_ns, end_ns=t0 + wait_ns),
            dict(base, step=step, name="param_all_gather" + WAIT_SUFFIX, kind="host", bytes=0,
                 issue_ns=t0, start_ns=t0, end_ns=t0 + wait_ns)]
    table = pa.Table.from_pylist(rows, schema=pa.schema([EVENTS.field(f.name) for f in EVENTS]))
    pq.write_table(table, run_dir / "events" / f"rank={rank:05d}" / "seg-prefetch.parquet")
    return wait_ns


def test_wait_nested_in_forward_is_exposed_communication(run_dir, tmp_path):
    import shutil

    from megascope.analyzer import Run
    base_dir, waits_dir = tmp_path / "base", tmp_path / "waits"
    shutil.copytree(run_dir, base_dir)
    _rewrite_events(base_dir, lambda ev: ev.assign(issue_ns=ev.start_ns))
    shutil.copytree(run_dir, waits_dir)
    wait_s = _prefetch_waited_in_forward(waits_dir, rank=5, step=3) / 1e9
    base, waits = Run.open(base_dir), Run.open(waits_dir)
    b = base.rank_steps().set_index(["rank", "step"])
    w = waits.rank_steps().set_index(["rank", "step"])
    assert w.loc[(5, 3), "forward_s"] == pytest.approx(b.loc[(5, 3), "forward_s"] - wait_s, abs=1e-9)
    assert w.loc[(5, 3), "compute_s"] == pytest.approx(b.loc[(5, 3), "compute_s"] - wait_s, abs=1e-9)
    assert w.loc[(5, 3), "collective_s"] == pytest.approx(b.loc[(5, 3), "collective_s"] + wait_s, abs=1e-9)
    assert w.loc[(5, 3), "nested_wait_s"] == pytest.approx(wait_s, abs=1e-9)
    # the prefetched op (issued in step 2, overlapping its end and step 3's start) is hidden
    assert w.loc[(5, 2), "collective_s"] == pytest.approx(b.loc[(5, 2), "collective_s"], abs=1e-9)
    others = [i for i in w.index if i not in ((5, 3),)]
    same = [c for c in EXACT if c != "n_events"]   # (5, 2) holds one more event: the op
    pd.testing.assert_frame_equal(w.loc[others, same], b.loc[others, same], check_dtype=False)
    bd = waits.breakdown().set_index(["step", "rank"])
    parts = bd[["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]].sum(axis=1)
    st = w.step_time_s.swaplevel().loc[parts.index]
    assert abs(parts - st).max() < 1e-9
    bb = base.breakdown().set_index(["step", "rank"])
    assert bd.loc[(3, 5), "exposed_comm_s"] > bb.loc[(3, 5), "exposed_comm_s"]


@pytest.mark.slow
def test_real_trace_waits(tmp_path):
    """A real traced run (ZeRO, dp=2, gloo): its `.wait` spans are the exposed communication, a wait
    nested in forward (the prefetched param_all_gather, when it had not completed) is taken out of
    forward, and the breakdown sums to the step time."""
    import subprocess
    import sys

    from megascope.analyzer import Run
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "2",
                           "--steps", "6", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Run.open(run_dir)
    ev = run.store.query("SELECT rank, step, kind, name, start_ns, end_ns FROM events")
    waits = ev[(ev.kind == "host") & ev.name.str.endswith(".wait")]
    assert len(waits) and set(waits.name) >= {"grad_reduce_scatter.wait"}
    rs = run.rank_steps().set_index(["rank", "step"])
    bd = run.breakdown().set_index(["rank", "step"])
    parts = bd[["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]].sum(axis=1)
    assert abs(parts - rs.step_time_s.loc[parts.index]).max() < 1e-9
    assert (rs.forward_s >= 0).all() and (rs.backward_s >= 0).all() and (rs.optimizer_s >= 0).all()
    wait_s = waits.assign(d=(waits.end_ns - waits.start_ns) / 1e9).groupby(["rank", "step"]).d.sum()
    assert (rs.collective_s.loc[wait_s.index] >= wait_s - 1e-9).all()   # every wait is collective time
    # waits inside a forward span: out of forward_s (one forward holds at most one wait here)
    fwd = ev[ev.name == "forward"]
    inner = waits.merge(fwd, on=["rank", "step"], suffixes=("", "_f"))
    inner = inner[(inner.start_ns >= inner.start_ns_f) & (inner.end_ns <= inner.end_ns_f)]
    raw = fwd.assign(d=(fwd.end_ns - fwd.start_ns) / 1e9).groupby(["rank", "step"]).d.sum()
    nested = inner.assign(d=(inner.end_ns - inner.start_ns) / 1e9).groupby(["rank", "step"]).d.sum()
    for key, d in nested.items():
        assert rs.forward_s.loc[key] == pytest.approx(raw.loc[key] - d, abs=1e-6)
        assert rs.forward_s.loc[key] < raw.loc[key]
    untouched = raw.index.difference(nested.index)
    np.testing.assert_allclose(rs.forward_s.loc[untouched], raw.loc[untouched], atol=1e-6)
