"""What-if replay on traces whose tensor-parallel collectives run inside the compute spans (the real
trainer's): the tp peer of a slow rank sits in those collectives waiting for it, inside its own
forward/backward; fixing the slow rank must give that wait back. Also the p2p-stall flap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data.events_window import events_window
from megascope.analyzer.findings import Finding
from megascope.analyzer.graph.span_split import split_compute
from megascope.analyzer.graph.step_graph import (
    GraphCycleError,
    graph_from_events,
    topological_levels,
)
from megascope.analyzer.graph.what_if import _inputs, net_compute, replay
from megascope.tracer import run_dir as rd
from megascope.tracer.schema import EVENTS, SCHEMA_VERSION, STEPS

MS = 1_000_000
BASE_NS = 1_764_000_000 * 10**9
"""Times are epoch ns, like the tracer's (float64 holds them only to ~256 ns)."""
XFER_MS = 0.1
PROGRAM = (("forward", "wcwc"), ("backward", "wcw"))
"""Each span: w = a piece of own work, c = a tp all_reduce issued inside the span (sync)."""


def _row(rank, step, name, kind, group, seq, issue, start, end, microbatch=0, peer=-1):
    return {"rank": rank, "step": step, "microbatch": microbatch, "chunk": -1, "name": name, "kind": kind,
            "group": group, "seq": seq, "peer": peer, "bytes": 0 if kind == "compute" else 1024,
            "issue_ns": BASE_NS + round(issue * MS), "start_ns": BASE_NS + round(start * MS),
            "end_ns": BASE_NS + round(end * MS)}


def tp_steps(work: dict[int, list[float]], steps: int) -> tuple[list[dict], list[dict]]:
    """Events and steps rows of a tp=2 job: per step, PROGRAM on both ranks; work[r][step] = ms per
    piece of own work; a collective ends at its last arrival + XFER_MS on both members."""
    events, step_rows = [], []
    t = {r: 0.0 for r in work}
    seq = 0
    for step in range(steps):
        first = dict(t)
        for name, items in PROGRAM:
            begin = dict(t)
            for item in items:
                if item == "w":
                    t = {r: t[r] + work[r][step] for r in t}
                    continue
                done = max(t.values()) + XFER_MS
                events += [_row(r, step, "tp_all_reduce", "collective", "tp", seq, t[r], t[r], done) for r in t]
                t, seq = {r: done for r in t}, seq + 1
            events += [_row(r, step, name, "compute", "", -1, begin[r], begin[r], t[r]) for r in t]
        t = {r: max(t.values()) + 0.05 for r in t}  # the next step starts together
        step_rows += [{"rank": r, "step": step, "start_ns": BASE_NS + round(first[r] * MS),
                       "end_ns": BASE_NS + round(t[r] * MS),
                       "tokens": 128, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "model_flops": 1e9,
                       "dropped_events": 0} for r in t]
    return events, step_rows


def write_run(path: Path, events: list[dict], steps: list[dict], dp: int, tp: int, pp: int) -> Path:
    """A run directory holding these rows (ranks numbered (pp * dp + dp_coord) * tp + tp_coord)."""
    world = dp * tp * pp
    ranks = [{"rank": r, "pp": r // (dp * tp), "dp": (r // tp) % dp, "tp": r % tp, "host": "localhost",
              "local_rank": r} for r in range(world)]
    rd.write_manifest(path, {"schema_version": SCHEMA_VERSION, "run_id": "what-if-test", "source": "test",
                             "topology": {"world": world, "dp": dp, "tp": tp, "pp": pp, "vpp": 1, "ranks": ranks},
                             "micro_batches": 1, "clock_offsets_ns": {str(r): 0 for r in range(world)}})
    for table, rows, schema in (("events", events, EVENTS), ("steps", steps, STEPS)):
        frame = pd.DataFrame(rows)
        for r in range(world):
            mine = frame[frame["rank"] == r]
            folder = rd.table_dir(path, table, r)
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pandas(mine[[f.name for f in schema]], schema=schema, preserve_index=False),
                           folder / "seg-000000.parquet")
    return path


def test_nested_tp_collectives_become_sync_points(tmp_path):
    events, steps = tp_steps({0: [1.0], 1: [2.0]}, steps=1)
    run = Run.open(write_run(tmp_path / "run", events, steps, dp=1, tp=2, pp=1))
    ev = events_window(run.store, 0, 0, None, limit=1000)
    split = split_compute(ev, cpu_trace=False)
    r0 = split[split["rank"] == 0]
    # forward: piece, ar, piece, ar, (empty tail piece); backward: piece, ar, piece
    assert (r0.kind.str[:4] + ":" + r0.name.str[:3]).tolist() == [
        "comp:for", "coll:tp_", "comp:for", "coll:tp_", "comp:for", "comp:bac", "coll:tp_", "comp:bac"]
    assert r0.internal.tolist() == [False, True, True, True, True, False, True, True]
    # net compute: rank 0 waited 1 ms in each of its forward all_reduces; the pieces exclude it
    nets = net_compute(split.assign(pp=0, tp=split["rank"]), (split.end_ns - split.start_ns).to_numpy())
    assert sorted(nets[nets["rank"] == 0].net / MS) == pytest.approx([2.0, 2.0])
    assert sorted(nets[nets["rank"] == 1].net / MS) == pytest.approx([4.0, 4.0])
    # the plain graph (dependencies, critical path) still has one event per span, with its id
    g = graph_from_events(ev, run.store.topology, 1, 2)
    assert len(g.events) == len(ev) and g.events.event_id.is_unique
    assert len(run.dependencies(0)) == len(g.events) - 2 + 3  # program order + one edge per all_reduce


def test_straggler_what_if_credits_the_peer_wait_inside_its_spans(tmp_path):
    # rank 1 (tp peer of rank 0) is twice as slow from step 2; rank 0 waits in its nested all_reduces
    steps = 6
    events, step_rows = tp_steps({0: [1.0] * steps, 1: [1.0, 1.0] + [2.0] * (steps - 2)}, steps)
    run = Run.open(write_run(tmp_path / "run", events, step_rows, dp=1, tp=2, pp=1))
    f = Finding("straggler", [1], ["localhost"], (2, steps - 1), 2.0, "rank 1 is slow")
    wi = run.what_if(f)
    # step: 4 pieces x 2 ms + 3 all_reduces x 0.1 ms = 8.3 ms, + 0.05 ms from the previous step's end
    # (both ranks start together: a barrier); fixed: 4 x 1 + 0.3 + 0.05 = 4.35 ms
    assert wi["step_time_s"] == pytest.approx(8.35e-3, rel=1e-3)
    assert wi["saved_per_step_s"] == pytest.approx(4.0e-3, rel=0.02)
    assert wi["throughput_lost"] == pytest.approx(4.0 / 8.35, abs=0.01)


def test_async_ops_inside_a_span_are_cut_at_their_issue_and_block_at_their_wait(tmp_path):
    # CPU trace: an async op (its start, the enqueue, after its issue) issued inside backward takes
    # none of the rank's time there and holds up nothing; its `.wait` span is where the rank waits
    events, steps = tp_steps({0: [1.0], 1: [1.0]}, steps=1)
    bwd = next(e for e in events if e["rank"] == 0 and e["name"] == "backward")
    begin, end = ((bwd[c] - BASE_NS) / MS for c in ("issue_ns", "end_ns"))
    events.append(_row(0, 0, "grad_all_reduce", "collective", "dp", 0, begin + 0.2, begin + 0.25, end + 5))
    events.append(_row(0, 0, "grad_all_reduce.wait", "host", "dp", 0, end + 1, end + 1, end + 5))
    run = Run.open(write_run(tmp_path / "run", events, steps, dp=1, tp=2, pp=1))
    split = split_compute(events_window(run.store, 0, 0, None, limit=1000), cpu_trace=True)
    mine = split[split["rank"] == 0]
    assert mine.name.tolist()[-6:] == ["backward", "grad_all_reduce", "backward", "tp_all_reduce", "backward",
                                       "grad_all_reduce.wait"]
    pieces = mine[mine.name == "backward"]
    assert ((pieces.end_ns - pieces.start_ns).sum() / MS) == pytest.approx(2.0)  # the tp wait is out
    g = graph_from_events(split, run.store.topology, 1, 2, waits=True)
    ev = g.events
    op = int(np.flatnonzero(ev.name == "grad_all_reduce")[0])
    wait = int(np.flatnonzero(ev.name == "grad_all_reduce.wait")[0])
    assert not g.blocking[op] and g.wait_of[wait] == op and g.prev[op + 1] == op - 1
    d, gap, x = _inputs(g)
    ends = replay(g, d, gap, x)
    assert ends.max() == pytest.approx(ev.end_ns.max(), abs=1e3)  # as recorded
    # without waits (dependencies, critical path) the wait row is dropped and the op blocks
    plain = graph_from_events(events_window(run.store, 0, 0, None, limit=1000), run.store.topology, 1, 2)
    assert not plain.events.name.str.endswith(".wait").any() and plain.wait_of is None


def test_receives_posted_ahead_do_not_deadlock_the_replay(tmp_path):
    # 1F1B on CPU: each stage posts its next receive before computing (async, waited later). Blocking
    # at the post, stage 0's F1 would wait for B0's gradient while stage 1's B0 waited for F1: a cycle
    # whose replay never converges (a real run replayed 30x its step); waits make it as recorded
    events = []

    def op(rank, name, kind, issue, start, end, peer=-1, seq=0, mb=0):
        events.append(_row(rank, 0, name, kind, "pp" if kind != "compute" else "", seq, issue, start, end, mb, peer))

    # stage 0 (rank 0): F0 send0 post-recvB0 F1 send1 wait-recvB0 B0 post-recvB1 wait-recvB1 B1
    # stage 1 (rank 1): post-recvF0 wait F0 post-recvF1 B0 sendB0 wait-recvF1 F1 B1 sendB1
    op(0, "forward", "compute", 0, 0, 2, mb=0)
    op(0, "send_forward", "p2p", 2, 2.01, 9, peer=1, seq=0)
    op(0, "recv_backward", "p2p", 2.05, 2.06, 7.1, peer=1, seq=0)
    op(0, "forward", "compute", 2.1, 2.1, 4.1, mb=1)
    op(0, "send_forward", "p2p", 4.1, 4.11, 9, peer=1, seq=1, mb=1)
    op(0, "recv_backward.wait", "host", 4.2, 4.2, 7.1, peer=1, seq=0)
    op(0, "backward", "compute", 7.1, 7.1, 11.1, mb=0)
    op(0, "recv_backward", "p2p", 11.1, 11.11, 15.2, peer=1, seq=1, mb=1)
    op(0, "recv_backward.wait", "host", 11.2, 11.2, 15.2, peer=1, seq=1, mb=1)
    op(0, "backward", "compute", 15.2, 15.2, 19.2, mb=1)
    op(1, "recv_forward", "p2p", 0, 0.01, 2.1, peer=0, seq=0)
    op(1, "recv_forward.wait", "host", 0.1, 0.1, 2.1, peer=0, seq=0)
    op(1, "forward", "compute", 2.1, 2.1, 4.1, mb=0)
    op(1, "recv_forward", "p2p", 4.1, 4.11, 6.95, peer=0, seq=1, mb=1)
    op(1, "backward", "compute", 4.2, 4.2, 7.0, mb=0)
    op(1, "send_backward", "p2p", 7.0, 7.01, 7.1, peer=0, seq=0)
    op(1, "recv_forward.wait", "host", 7.05, 7.05, 7.06, peer=0, seq=1, mb=1)
    op(1, "forward", "compute", 7.06, 7.06, 9.06, mb=1)
    op(1, "backward", "compute", 9.06, 9.06, 11.06, mb=1)
    op(1, "send_backward", "p2p", 11.06, 11.07, 15.2, peer=0, seq=1, mb=1)
    rows = [{"rank": r, "step": 0, "start_ns": BASE_NS, "end_ns": BASE_NS + round(19.2 * MS), "tokens": 128,
             "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "model_flops": 1e9, "dropped_events": 0} for r in (0, 1)]
    run = Run.open(write_run(tmp_path / "run", events, rows, dp=1, tp=1, pp=2))
    ev = events_window(run.store, 0, 0, None, limit=1000)
    g = graph_from_events(split_compute(ev, cpu_trace=True), run.store.topology, 1, 1, waits=True)
    d, gap, x = _inputs(g)
    assert (replay(g, d, gap, x).max() - BASE_NS) / MS == pytest.approx(19.2, abs=0.01)


def test_stall_flap_what_if_credits_the_gap_before_the_link_ops(tmp_path):
    # pp=2, dp=2: links 0<->2 and 1<->3; from step 2 both ends of 1<->3 stall 5 ms before issuing their
    # transfers (the trainer's injected flap), the transfers themselves look normal
    events, step_rows = [], []
    t0 = 0.0
    for step in range(6):
        stall = 5.0 if step >= 2 else 0.0
        end = 0.0
        for a, b in ((0, 2), (1, 3)):
            s = stall if a == 1 else 0.0
            fwd_end = t0 + 2.0
            issue = fwd_end + 0.1 + s
            done = issue + 0.2
            events += [_row(a, step, "forward", "compute", "", -1, t0, t0, fwd_end),
                       _row(b, step, "data_wait", "host", "", -1, t0, t0, t0 + 0.05),
                       _row(a, step, "send_forward", "p2p", "pp", step, issue, issue, done, peer=b),
                       _row(b, step, "recv_forward", "p2p", "pp", step, t0 + 0.1 + s, t0 + 0.1 + s, done, peer=a),
                       _row(b, step, "forward", "compute", "", -1, done, done, done + 2.0)]
            end = max(end, done + 2.0)
        step_rows += [{"rank": r, "step": step, "start_ns": BASE_NS + round(t0 * MS),
                       "end_ns": BASE_NS + round(end * MS), "tokens": 128,
                       "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "model_flops": 1e9, "dropped_events": 0}
                      for r in range(4)]
        t0 = end + 0.05
    run = Run.open(write_run(tmp_path / "run", events, step_rows, dp=2, tp=1, pp=2))
    f = Finding("network_flap", [1, 3], ["localhost"], (2, 5), 2.0, "link 1<->3 flapped",
                {"group": "pp", "signal": "stall"})
    wi = run.what_if(f)
    # step: 2 + 0.1 + 5 + 0.2 + 2 = 9.3 ms on the stalled replica; fixed: bound by the healthy one, 4.3 ms
    assert wi["saved_per_step_s"] == pytest.approx(5.0e-3, rel=0.02), wi
    transfer = run.what_if(Finding("network_flap", [1, 3], ["localhost"], (2, 5), 2.0, "x", {"group": "pp"}))
    assert transfer["saved_per_step_s"] == pytest.approx(0.0, abs=1e-5)  # the transfers were normal
    assert np.isfinite(wi["throughput_lost"])


def _fixed_point_replay(g, duration, gap, xfer):
    """The replay as it was before the one-pass version (Jacobi iteration to a fixed point): the
    reference the longest-path pass must reproduce on acyclic graphs."""
    ev, n = g.events, len(g.events)
    kind = ev.kind.to_numpy()
    is_comp, is_coll, is_recv = (kind == "compute") | (kind == "host"), g.instance >= 0, g.send_of >= 0
    is_send = np.zeros(n, dtype=bool)
    is_send[g.send_of[is_recv]] = True
    is_wait = g.wait_of >= 0 if g.wait_of is not None else np.zeros(n, dtype=bool)
    issue0, end = ev.issue_ns.to_numpy().astype(float), ev.end_ns.to_numpy().astype(float)
    n_inst = int(g.instance.max()) + 1 if is_coll.any() else 0
    for _ in range(4 * n + 10):
        issue = np.where(g.prev >= 0, end[np.maximum(g.prev, 0)] + gap, issue0)
        new = end.copy()
        new[is_comp] = issue[is_comp] + duration[is_comp]
        r, s = np.flatnonzero(is_recv), g.send_of[is_recv]
        new[r] = new[s] = np.maximum(issue[r], issue[s]) + xfer[r]
        if n_inst:
            last = np.full(n_inst, -np.inf)
            np.maximum.at(last, g.instance[is_coll], issue[is_coll])
            new[is_coll] = last[g.instance[is_coll]] + xfer[is_coll]
        other = ~(is_comp | is_recv | is_send | is_coll)
        new[other] = issue[other] + duration[other]
        new[is_wait] = np.maximum(issue[is_wait], new[g.wait_of[is_wait]]) if is_wait.any() else new[is_wait]
        if np.allclose(new, end, rtol=0, atol=1.0):
            return new
        end = new
    raise AssertionError("the reference did not converge")


@pytest.mark.parametrize("vpp", [1, 2])
def test_one_pass_replay_equals_the_fixed_point_iteration(simulated_run, vpp):
    run = Run.open(simulated_run(dp=2, tp=2, pp=2, vpp=vpp, steps=3, micro_batches=4, seed=5,
                                 inject=["straggler:rank=5,slowdown=1.4",
                                         "flap:ranks=1-5,down_ms=3,period_steps=2,len=1,from=1"]))
    rng = np.random.default_rng(0)
    for step in range(3):
        g = graph_from_events(split_compute(events_window(run.store, step, step, None, 1 << 30), False),
                              run.store.topology, 2, 2)
        d, gap, x = _inputs(g)
        levels = topological_levels(g)
        assert levels.max() > 20  # a deep graph: the pass must order it, not just read it back
        for scale in (np.ones(len(d)), rng.uniform(0.3, 2.0, len(d))):  # as recorded; durations changed
            got = replay(g, d * scale, gap * scale, x * scale, levels)
            want = _fixed_point_replay(g, d * scale, gap * scale, x * scale)
            assert np.abs(got - want).max() <= 1.0  # ns, the reference's own tolerance


def _collective_rows(order: dict[int, list[int]]) -> list[dict]:
    """tp all_reduces on ranks 0 and 1, each rank issuing its seqs in the given order, 1 ms apart."""
    rows = []
    for r, seqs in order.items():
        for k, seq in enumerate(seqs):
            rows.append(_row(r, 0, "all_reduce", "collective", "tp", seq, k, k, k + 0.5))
    return rows


def test_a_cycle_is_reported_and_the_what_if_skipped(tmp_path):
    # rank 0 runs all_reduce seq 0 then 1, rank 1 seq 1 then 0: each instance waits for the other
    events = _collective_rows({0: [0, 1], 1: [1, 0]})
    steps = [{"rank": r, "step": 0, "start_ns": BASE_NS, "end_ns": BASE_NS + 2 * MS, "tokens": 1, "loss": 1.0,
              "lr": 1e-3, "grad_norm": 1.0, "model_flops": 1e9, "dropped_events": 0} for r in (0, 1)]
    run = Run.open(write_run(tmp_path / "run", events, steps, dp=1, tp=2, pp=1))
    g = graph_from_events(events_window(run.store, 0, 0, None, 100), run.store.topology, 1, 2)
    with pytest.raises(GraphCycleError, match="cycle.*rank"):
        topological_levels(g)
    wi = run.what_if(Finding("straggler", [1], ["localhost"], (0, 0), 2.0, "x"))
    assert not wi["applicable"] and "cycle" in wi["reason"]
    # the same ops in a consistent order replay as recorded
    ok = Run.open(write_run(tmp_path / "ok", _collective_rows({0: [0, 1], 1: [0, 1]}), steps, dp=1, tp=2, pp=1))
    g = graph_from_events(events_window(ok.store, 0, 0, None, 100), ok.store.topology, 1, 2)
    d, gap, x = _inputs(g)
    assert replay(g, d, gap, x).max() == pytest.approx(g.events.end_ns.max(), abs=1e3)


def test_batched_send_and_recv_posted_together_do_not_wait_for_each_other(tmp_path):
    # NDTimeline's send_forward_recv_backward becomes a send and a recv with equal times (issue =
    # start). Ordered by name the recv came first and held up the send, whose peer waits for it:
    # a cycle on every 1F1B step. Stage 0 / stage 1, two micro-batches, 1 ms compute, 0.1 ms transfers
    events = []

    def op(rank, name, kind, t0, t1, peer=-1, seq=-1, mb=0):
        events.append(_row(rank, 0, name, kind, "pp" if kind == "p2p" else "", seq, t0, t0, t1, mb, peer))

    op(0, "forward", "compute", 0, 1, mb=0)
    op(0, "send_forward", "p2p", 1, 1.1, peer=1, seq=0)
    op(0, "forward", "compute", 1.1, 2.1, mb=1)
    op(0, "send_forward", "p2p", 2.1, 3.3, peer=1, seq=1, mb=1)      # batched with the recv below
    op(0, "recv_backward", "p2p", 2.1, 3.3, peer=1, seq=0)
    op(0, "backward", "compute", 3.3, 5.3, mb=0)
    op(0, "recv_backward", "p2p", 5.3, 5.5, peer=1, seq=1, mb=1)
    op(0, "backward", "compute", 5.5, 7.5, mb=1)
    op(1, "recv_forward", "p2p", 0, 1.1, peer=0, seq=0)
    op(1, "forward", "compute", 1.1, 2.1, mb=0)
    op(1, "backward", "compute", 2.1, 3.2, mb=0)
    op(1, "send_backward", "p2p", 3.2, 3.3, peer=0, seq=0)          # batched with the recv below
    op(1, "recv_forward", "p2p", 3.2, 3.3, peer=0, seq=1, mb=1)
    op(1, "forward", "compute", 3.3, 4.3, mb=1)
    op(1, "backward", "compute", 4.3, 5.4, mb=1)
    op(1, "send_backward", "p2p", 5.4, 5.5, peer=0, seq=1, mb=1)
    steps = [{"rank": r, "step": 0, "start_ns": BASE_NS, "end_ns": BASE_NS + round(7.5 * MS), "tokens": 1,
              "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "model_flops": 1e9, "dropped_events": 0} for r in (0, 1)]
    run = Run.open(write_run(tmp_path / "run", events, steps, dp=1, tp=1, pp=2))
    g = graph_from_events(events_window(run.store, 0, 0, None, 100), run.store.topology, 1, 1)
    ev = g.events
    send = int(np.flatnonzero((ev["rank"] == 0) & (ev.name == "send_forward") & (ev.seq == 1))[0])
    recv = int(np.flatnonzero((ev["rank"] == 0) & (ev.name == "recv_backward") & (ev.seq == 0))[0])
    assert g.prev[send] == g.prev[recv] and ev.name.iat[g.prev[send]] == "forward"
    d, gap, x = _inputs(g)
    assert (replay(g, d, gap, x).max() - BASE_NS) / MS == pytest.approx(7.5, abs=1e-3)


def _step_times(run: Run) -> pd.Series:
    """Per step: last end - the previous step's last end (the what-if's step time); the first step:
    its last end - its first start."""
    steps = run.steps().groupby("step").agg(start=("start_ns", "min"), end=("end_ns", "max")).sort_index()
    return steps.end.diff().fillna(steps.end - steps.start) / 1e9


def _what_if_error(faulty: Run, twin: Run, f: Finding) -> float:
    """The what-if's fault-free step time against the twin's measured one on the sampled steps."""
    wi = faulty.what_if(f)
    true = float(_step_times(twin)[wi["steps_sampled"]].mean())
    return wi["what_if_step_time_s"] / true - 1


def test_what_if_matches_the_fault_free_twin_of_a_simulated_run(simulated_run):
    # same seed with and without the fault: the simulator's draws do not depend on the faults, so
    # the twin is the run without it. Measured error on this pair: -0.10% (benchmarks/
    # what_if_accuracy.py: simulator cases 0.00-0.05%); tolerance 1%, half the 2% goal. A pipeline
    # straggler from step 0 was 12.5% off before the step time ran from the previous step's end
    cfg = {"dp": 2, "tp": 1, "pp": 4, "steps": 8, "micro_batches": 4, "seed": 4}
    faulty = Run.open(simulated_run(inject=["straggler:rank=0,slowdown=2"], **cfg))
    twin = Run.open(simulated_run(**cfg))
    f = next(f for f in faulty.findings() if f.kind == "straggler" and 0 in f.ranks)
    assert abs(_what_if_error(faulty, twin, f)) < 0.01


def test_what_if_matches_the_twin_of_an_independent_trace(tmp_path):
    # the independent generator (samples/independent_gen.py) through the NDTimeline importer: tp groups
    # that wait for their slowest inside each op (the peer's span ends with the straggler's),
    # rendezvous sends, a job-wide sync between steps. Measured errors: -0.34% and -0.08% here;
    # tolerance 1%. Without fixing the tp peer's spans along with the slow GPU's the first is +17.7%
    # (the issue's case 6 was credited 0.0%); with the sends taken as async the second is +11.7%
    from megascope.samples.independent_gen import GenSpec, SlowRank, import_run
    specs = [GenSpec(dp=2, tp=2, pp=1, steps=12, micro=4, seed=2,
                     faults=[SlowRank(dp=1, stage=0, tp=1, fwd=1.2, bwd=1.2, first=4)]),
             GenSpec(dp=2, tp=2, pp=4, steps=12, micro=4, seed=3, traced="tp0",
                     faults=[SlowRank(dp=0, stage=0, fwd=2.5, bwd=2.3)])]
    for i, spec in enumerate(specs):
        faulty = Run.open(import_run(spec, tmp_path / f"faulty{i}"))
        twin = Run.open(import_run(spec.fault_free(), tmp_path / f"twin{i}"))
        slow = spec.faults[0]
        # the slow GPU alone (whatever the detector names): its tp peer's wait must go with it
        f = Finding("straggler", [spec.rank(slow.dp, slow.stage, slow.tp)], ["localhost"],
                    (slow.first, spec.steps - 1), 1.2, "slow GPU")
        assert abs(_what_if_error(faulty, twin, f)) < 0.01, i
