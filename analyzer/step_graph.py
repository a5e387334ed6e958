"""The 3D dependency graph of one step: program order on each rank, pipeline send->recv edges and
collective membership (every member waits for the last arrival). Shared by dependencies(),
critical_path() and the what-if replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.layout import instance_keys
from megascope.analyzer.store import Store, load_sql
from megascope.tracer.schema import WAIT_SUFFIX

ASYNC_NAMES = ("send_forward", "send_backward")
"""Non-blocking ops: they do not hold up the next op of their rank."""

EVENT_ID_STEP_BIAS = 256
"""event_id holds step + this bias (24 bits), so events before the first step (step -1: init,
importers) get ids that are >= 0, unique and decodable like any other."""
MIN_EVENT_STEP = -EVENT_ID_STEP_BIAS
MAX_EVENT_STEP = (1 << 24) - 1 - EVENT_ID_STEP_BIAS


@dataclass
class StepGraph:
    events: pd.DataFrame
    """The step's events sorted by rank and issue time (positional index 0..n-1)."""
    prev: np.ndarray
    """Program-order predecessor (last blocking event before it on its rank), -1 at the start."""
    send_of: np.ndarray
    """For a recv: position of the matching send, -1."""
    instance: np.ndarray
    """Collective instance number (same for all members of one op), -1."""
    last_arrival: np.ndarray
    """For a collective event: position of its instance's last-arriving member, -1."""
    wait_of: np.ndarray | None = None
    """With `waits` (the replay of CPU traces): for a `<op>.wait` span, the position of its op, -1."""
    blocking: np.ndarray | None = None
    """Whether each event holds up the next one of its rank (what `prev` was built from)."""


def event_id(rank: int, step: int, position: int) -> int:
    """The id events_window gives the `position`-th event (by issue time) of a rank-step."""
    return (int(rank) << 40) | ((int(step) + EVENT_ID_STEP_BIAS) << 16) | int(position)


def event_id_parts(event_id: int) -> tuple[int, int, int]:
    """(rank, step, position) of an event id."""
    event_id = int(event_id)
    return event_id >> 40, ((event_id >> 16) & 0xFFFFFF) - EVENT_ID_STEP_BIAS, event_id & 0xFFFF


def events_window(store: Store, first: int, last: int, ranks: list[int] | None, limit: int) -> pd.DataFrame:
    """Events of steps [first, last] with their event_id; steps outside the ids' range hold no events
    the analyzer can name (a window reaching past it is clipped to it)."""
    first, last = max(int(first), MIN_EVENT_STEP), min(int(last), MAX_EVENT_STEP)
    rank_filter = ""
    if ranks is not None:
        ids = ", ".join(str(int(r)) for r in ranks) or "-1"
        rank_filter = f"AND rank IN ({ids})"
    return store.query(load_sql("events_window").format(source=store.events_source(ranks), rank_filter=rank_filter,
                                                        step_bias=EVENT_ID_STEP_BIAS),
                       {"first": int(first), "last": int(last), "limit": int(limit)})


def build_step_graph(store: Store, step: int, ranks: list[int] | None = None) -> StepGraph:
    topo = store.manifest["topology"]
    return graph_from_events(events_window(store, step, step, ranks, limit=1 << 40), store.topology,
                             int(topo["dp"]), int(topo["tp"]))


def graph_from_events(events: pd.DataFrame, topology: pd.DataFrame, dp: int, tp: int,
                      waits: bool = False) -> StepGraph:
    """The graph of one step's events, given in program order per rank (events_window's order: rank,
    then issue time; split_compute keeps it), with the run's topology and its dp and tp sizes.
    waits=False: `<op>.wait` spans (the host blocked on an async op) repeat the op's own end: the
    graph keeps the op, whose end the program order waits for, and drops the wait so nothing counts
    twice. waits=True (the what-if replay of CPU traces, whose receives are posted ahead and whose
    reductions overlap backward): an async op (its start, the enqueue, after its issue) holds up
    nothing at its issue; its `<op>.wait` span is where the rank waits for it (wait_of); the waits
    of other ops are dropped as above, a wait whose op is not in the frame stays a host span."""
    is_wait = (events.kind == "host") & events.name.str.endswith(WAIT_SUFFIX)
    if waits:  # the waits of sync ops (or of ops that are not async by their times) still repeat them
        ev = events.reset_index(drop=True)
        target = _wait_targets(ev)
        is_async = (ev.kind.isin(["collective", "p2p"]) & (ev.issue_ns < ev.start_ns)).to_numpy()
        ev = ev[~((target >= 0) & ~is_async[np.maximum(target, 0)])].reset_index(drop=True)
    else:
        ev = events[~is_wait].reset_index(drop=True)
    n = len(ev)
    ranks_arr = ev["rank"].to_numpy()
    blocking = ~ev["name"].isin(ASYNC_NAMES).to_numpy()
    wait_of = None
    if waits:
        blocking &= ~(ev.kind.isin(["collective", "p2p"]) & (ev.issue_ns < ev.start_ns)).to_numpy()
        wait_of = _wait_targets(ev)
    prev = np.full(n, -1, dtype=np.int64)
    last_by_rank: dict[int, int] = {}
    for i in range(n):  # note: sorted by rank then issue; one linear pass
        r = int(ranks_arr[i])
        prev[i] = last_by_rank.get(r, -1)
        if blocking[i]:
            last_by_rank[r] = i
    pos = pd.Series(np.arange(n), index=ev.index)
    send_of = np.full(n, -1, dtype=np.int64)
    p2p = ev[ev.kind == "p2p"]
    sends = p2p[p2p.name.str.startswith("send")]
    recvs = p2p[p2p.name.str.startswith("recv")]
    if len(sends) and len(recvs):
        m = recvs.reset_index().merge(
            sends.reset_index()[["index", "rank", "peer", "seq"]],
            left_on=["peer", "rank", "seq"], right_on=["rank", "peer", "seq"], suffixes=("", "_send"))
        send_of[pos[m["index"]].to_numpy()] = pos[m["index_send"]].to_numpy()
    instance = np.full(n, -1, dtype=np.int64)
    last_arrival = np.full(n, -1, dtype=np.int64)
    coll = ev[ev.kind == "collective"]
    if len(coll):
        inst = instance_keys(coll, topology, int(dp), int(tp))
        coll = coll[inst.notna()]  # unknown group names: members cannot be reconstructed, not matched
        key = coll["group"].astype(str) + ":" + inst[inst.notna()].astype(int).astype(str) + ":" + coll.seq.astype(str)
    if len(coll):
        codes, _ = pd.factorize(key)
        instance[coll.index.to_numpy()] = codes
        latest = coll.assign(code=codes).sort_values("issue_ns").groupby("code").tail(1)
        lookup = pd.Series(latest.index.to_numpy(), index=latest.code.to_numpy())
        last_arrival[coll.index.to_numpy()] = lookup.reindex(codes).to_numpy()
    return StepGraph(ev, prev, send_of, instance, last_arrival, wait_of, blocking)


def _wait_targets(ev: pd.DataFrame) -> np.ndarray:
    """For each `<op>.wait` row of a frame (positional index), the position of its op: same rank,
    group, seq, peer and name; -1 elsewhere and where the op is not in the frame (waited a step later)."""
    out = np.full(len(ev), -1, dtype=np.int64)
    waits = ev[(ev.kind == "host") & ev.name.str.endswith(WAIT_SUFFIX)]
    if waits.empty:
        return out
    keys = ["rank", "group", "seq", "peer"]
    left = waits[keys].assign(op=waits.name.str[:-len(WAIT_SUFFIX)], pos=waits.index.to_numpy())
    ops = ev[ev.kind.isin(["collective", "p2p"])]
    right = ops[keys].assign(op=ops.name, op_pos=ops.index.to_numpy())
    m = left.merge(right.drop_duplicates(keys + ["op"]), on=keys + ["op"])
    out[m.pos.to_numpy()] = m.op_pos.to_numpy()
    return out


def split_compute(events: pd.DataFrame, cpu_trace: bool) -> pd.DataFrame:
    """One step's events (events_window's frame) with each compute span that holds communication of
    its own rank (tensor-parallel collectives inside forward/backward: the rank sat in them, waiting
    for its peers) cut into compute pieces around it: piece, op, piece, ..., piece, in program order
    per rank. The pieces then hold only the rank's own work, and the nested ops are synchronization
    points of the replay. Columns added:
        span      event_id of the compute span a compute row belongs to (a piece or a whole span);
                  -1 on other rows (pieces share their span's event_id)
        internal  the ops and pieces after a span's first piece (host gaps there are 0 by construction)
    The cuts: a collective or p2p op, or a `<op>.wait` span, of the rank whose [start, end] lies inside
    a top-level compute span (the host sat in it); an async op issued inside one (send_forward/
    backward; on CPU traces, `cpu_trace`, an op whose start, the enqueue, is after its issue) is cut at
    its issue (it takes no time of the rank's own; graph_from_events(waits=True) lets it hold up
    nothing). Other events that start inside a split span (inner spans) are placed after its last
    piece: where the unsplit span's program order put them. `<op>.wait` rows are kept."""
    ev = events.reset_index(drop=True)
    ev = ev.assign(span=np.where(ev.kind == "compute", ev.event_id, -1).astype(np.int64), internal=False,
                   _ord=ev.issue_ns.astype(np.int64), _sub=0, _tie=np.arange(len(ev)))
    comp = ev[ev.kind == "compute"].sort_values(["rank", "start_ns", "end_ns"], ascending=[True, True, False])
    reach_before = comp.groupby("rank").end_ns.cummax().groupby(comp["rank"]).shift(fill_value=_NS_MIN)
    top = comp[comp.start_ns >= reach_before]  # spans inside an earlier span of the rank are not cut
    comm = ev.kind.isin(["collective", "p2p"])
    is_async = comm & ev.name.isin(ASYNC_NAMES)
    if cpu_trace:
        is_async |= comm & (ev.issue_ns < ev.start_ns)
    cuts = ev[comm | ((ev.kind == "host") & ev.name.str.endswith(WAIT_SUFFIX))]
    asy = is_async[cuts.index].to_numpy()
    # the part of the span each cut takes: a blocking op its span; an async op nothing, at its issue
    lo = np.where(asy, cuts.issue_ns, cuts.start_ns)
    cuts = cuts.assign(cut_lo=lo, cut_hi=np.where(asy, cuts.issue_ns, cuts.end_ns), start_ns=lo)
    ops = _in_span(cuts, top)
    ops = ops[(ops.cut_hi <= ops.span_end) & (ops.issue_ns >= ops.span_issue)]
    if ops.empty:
        return ev.drop(columns=["_ord", "_sub", "_tie"])
    ops = ops.sort_values(["parent", "cut_lo"])
    by_parent = ops.groupby("parent", sort=False)
    reach = by_parent.cut_hi.cummax()  # overlapping ops (GPU streams) leave no negative piece
    prev_reach = reach.groupby(ops.parent).shift(fill_value=_NS_MIN)
    first = prev_reach == _NS_MIN
    begin = pd.Series(np.where(first, ops.span_start, prev_reach), index=ops.index)
    split = ev.loc[ops.parent.unique()]
    # the pieces: one before each op (from the previous op's end, or the span start), one after the
    # last; a piece after op k sorts right after op k; the first keeps the span's issue and order
    before = split.loc[ops.parent].set_index(ops.index)
    before = before.assign(
        start_ns=begin, end_ns=np.maximum(ops.cut_lo, begin), internal=~first,
        issue_ns=np.where(first, before.issue_ns, begin),
        _ord=np.where(first, before._ord, ops._ord.groupby(ops.parent).shift(fill_value=0)),
        _sub=np.where(first, before._sub, 1),
        _tie=np.where(first, before._tie, ops._tie.groupby(ops.parent).shift(fill_value=0)))
    last = by_parent.tail(1).set_index("parent")
    tail_start = reach.groupby(ops.parent).max().reindex(split.index).to_numpy()
    tail = split.assign(issue_ns=tail_start, start_ns=tail_start, end_ns=np.maximum(split.end_ns, tail_start),
                        internal=True, _ord=last._ord.reindex(split.index).to_numpy(), _sub=1,
                        _tie=last._tie.reindex(split.index).to_numpy())
    # other events that start inside a split span (inner compute or host spans): after its last
    # piece, where the unsplit span's program order put them
    rest = ev.drop(index=list(split.index) + list(ops.index))
    moved = _in_span(rest, top.loc[top.index.isin(split.index)])
    moved = moved[(moved.start_ns < moved.span_end) & (moved.issue_ns >= moved.span_issue)]
    rest.loc[moved.index, "_ord"] = last._ord.reindex(moved.parent).to_numpy()
    rest.loc[moved.index, "_sub"] = 2
    nested = ev.loc[ops.index].assign(internal=True)
    out = pd.concat([rest, before[rest.columns], nested, tail[rest.columns]])
    out = out.sort_values(["rank", "_ord", "_sub", "_tie", "start_ns"], kind="stable")
    return out.drop(columns=["_ord", "_sub", "_tie"]).reset_index(drop=True)


_NS_MIN = np.iinfo(np.int64).min


def _in_span(rows: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """`rows` (that match one) with the span of their rank that started last at or before their start:
    parent (its index in the frame), span_issue, span_start, span_end."""
    if rows.empty or spans.empty:
        return rows.iloc[:0].assign(parent=0, span_issue=0, span_start=0, span_end=0)
    left = pd.DataFrame({"rank": rows["rank"].to_numpy(), "start_ns": rows.start_ns.to_numpy(),
                         "row": np.arange(len(rows))}).sort_values("start_ns")
    right = pd.DataFrame({"rank": spans["rank"].to_numpy(), "start_ns": spans.start_ns.to_numpy(),
                          "parent": np.arange(len(spans))}).sort_values("start_ns")
    m = pd.merge_asof(left, right, on="start_ns", by="rank", direction="backward").dropna(subset=["parent"])
    at = m.parent.to_numpy().astype(np.int64)  # positions (small): exact through the float NaN column
    out = rows.iloc[m.row.to_numpy()]
    # ns columns stay int64: looked up by position, never through a NaN-holding merge column
    return out.assign(parent=spans.index.to_numpy()[at], span_issue=spans.issue_ns.to_numpy()[at],
                      span_start=spans.start_ns.to_numpy()[at], span_end=spans.end_ns.to_numpy()[at])


def dependency_edges(g: StepGraph) -> pd.DataFrame:
    """Edges src_event_id -> dst_event_id with kind and how long dst waited on src (wait_s)."""
    ev = g.events
    ids, issue, ranks = ev.event_id.to_numpy(), ev.issue_ns.to_numpy(), ev["rank"].to_numpy()
    parts = []
    has = g.prev >= 0
    parts.append(pd.DataFrame({"src": g.prev[has], "dst": np.flatnonzero(has), "kind": "program_order",
                               "wait_s": 0.0}))
    rv = np.flatnonzero(g.send_of >= 0)
    parts.append(pd.DataFrame({"src": g.send_of[rv], "dst": rv, "kind": "p2p",
                               "wait_s": np.maximum(issue[g.send_of[rv]] - issue[rv], 0) / 1e9}))
    cv = np.flatnonzero((g.last_arrival >= 0) & (g.last_arrival != np.arange(len(ev))))
    parts.append(pd.DataFrame({"src": g.last_arrival[cv], "dst": cv, "kind": "collective",
                               "wait_s": np.maximum(issue[g.last_arrival[cv]] - issue[cv], 0) / 1e9}))
    edges = pd.concat(parts, ignore_index=True)
    src, dst = edges.src.to_numpy(dtype=np.int64), edges.dst.to_numpy(dtype=np.int64)
    return pd.DataFrame({"src_event_id": ids[src], "dst_event_id": ids[dst], "kind": edges.kind,
                         "src_rank": ranks[src], "dst_rank": ranks[dst], "wait_s": edges.wait_s})
