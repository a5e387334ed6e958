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
    blocking: np.ndarray
    """Whether each event holds up the next one of its rank (what `prev` was built from)."""
    wait_of: np.ndarray | None = None
    """With `waits` (the replay of CPU traces): for a `<op>.wait` span, the position of its op, -1."""


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
    return StepGraph(ev, prev, send_of, instance, last_arrival, blocking, wait_of)


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
