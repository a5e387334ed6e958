"""The 3D dependency graph of one step: program order on each rank, pipeline send->recv edges and
collective membership (every member waits for the last arrival). Shared by dependencies(),
critical_path() and the what-if replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.data.events_window import events_window
from megascope.analyzer.data.group_instances import instance_keys
from megascope.analyzer.data.store import Store
from megascope.tracer.schema import WAIT_SUFFIX

ASYNC_NAMES = ("send_forward", "send_backward")
"""Non-blocking ops: they do not hold up the next op of their rank."""

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
    dep_of: np.ndarray | None = None
    """In a pipeline trace without p2p events (a job that timed compute and collectives only): for a
    forward / backward compute span, the position of the span it received its input from (the previous
    stage's forward, the next stage's backward of the same micro-batch and chunk in its replica), -1."""


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
    blocking = ~ev["name"].isin(ASYNC_NAMES).to_numpy() | sends_block(ev)
    wait_of = None
    if waits:
        blocking &= ~(ev.kind.isin(["collective", "p2p"]) & (ev.issue_ns < ev.start_ns)).to_numpy()
        wait_of = _wait_targets(ev)
    prev = _program_order(ranks_arr, ev.issue_ns.to_numpy(), ev.end_ns.to_numpy(), blocking)
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
    return StepGraph(ev, prev, send_of, instance, last_arrival, blocking, wait_of, _pipeline_deps(ev, topology))


def _pipeline_deps(ev: pd.DataFrame, topology: pd.DataFrame) -> np.ndarray | None:
    """dep_of (StepGraph) when the step's events span several stages and hold no p2p event, else None:
    without receive spans a stage's wait for its neighbour is a host gap the program order would keep
    as the rank's own (a 2.35x straggler's what-if 7.7% on such a trace, 40% with its p2p rows)."""
    comp = ev[(ev.kind == "compute") & ev.name.isin(["forward", "backward"])]
    if (ev.kind == "p2p").any() or comp.empty:
        return None
    topo = topology.set_index("rank")
    key = [c for c in ("dp", "tp", "cp") if c in topo]
    at = comp.join(topo[["pp", *key]], on="rank")
    if at.pp.nunique() < 2:
        return None
    # each span's input: the same op of the same micro-batch on the stage before (forward) or after
    # (backward); the first piece of a span cut by split_compute (the rank's earliest of that op) waits
    want = at.assign(pp=at.pp + np.where(at.name == "forward", -1, 1), pos=np.arange(len(ev))[comp.index])
    op = ["step", "name", "microbatch", "chunk"]
    have = at.assign(src=np.arange(len(ev))[comp.index]).sort_values("end_ns").drop_duplicates(
        ["pp", *key, *op], keep="last")
    m = want.reset_index(drop=True).merge(have[["pp", *key, *op, "src"]], on=["pp", *key, *op])
    dep = np.full(len(ev), -1, dtype=np.int64)
    first = m.sort_values("start_ns").drop_duplicates(["rank", *op])
    dep[first.pos.to_numpy()] = first.src.to_numpy()
    return dep


SYNC_SENDS_MIN_SHARE = 0.9
"""Sends are synchronous in a trace when at least this share of them is followed by their rank's next
op only after they ended. Measured on step 5: simulator runs (async sends, 1F1B and interleaved, every
fault kind) 0 of 96-576 sends; NDTimeline imports of the independent generator (Megatron's rendezvous
p2p) 192 and 384 of 192 and 384; the rule sits well between."""


def sends_block(ev: pd.DataFrame) -> bool:
    """Whether the trace's sends (send_forward/backward) held up their rank: Megatron's p2p ops
    (NDTimeline traces) wait for the transfer, the project's trainer and simulator post sends and go
    on. Judged by the times: the next op of the rank (after any ops posted at the same instant)
    issued only after the send ended. `ev` sorted by rank, then issue."""
    r, t, e = ev["rank"].to_numpy(), ev.issue_ns.to_numpy(), ev.end_ns.to_numpy()
    if not len(ev):
        return False
    starts = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (t[1:] != t[:-1])])  # batches of equal issue
    nxt = starts[np.minimum(np.searchsorted(starts, np.arange(len(ev)), side="right"), len(starts) - 1)]
    send = ev.name.isin(ASYNC_NAMES).to_numpy() & (nxt > np.arange(len(ev))) & (r[nxt] == r)
    return bool(send.any()) and float((t[nxt][send] >= e[send] - 1000).mean()) >= SYNC_SENDS_MIN_SHARE


def _program_order(ranks: np.ndarray, issue: np.ndarray, end: np.ndarray, blocking: np.ndarray) -> np.ndarray:
    """prev of each event (sorted by rank, then issue): the last blocking event of its rank issued
    before it. Events a rank issued at the same instant (a batched isend/irecv: NDTimeline's
    forward-send-backward-recv becomes a send and a recv with equal times) were posted together and do
    not wait for each other: they share the predecessor of the batch, and what follows the batch
    waits for its blocking member that ended last. Ordered within the batch (by name, say), the recv
    would hold up the send, whose peer's program waits for the send: a cycle in every 1F1B step."""
    n = len(ranks)
    prev = np.full(n, -1, dtype=np.int64)
    last_by_rank: dict[int, int] = {}
    batch_prev, batch_rank, batch_issue = -1, None, None
    for i in range(n):  # one linear pass
        r, t = int(ranks[i]), int(issue[i])
        if r == batch_rank and t == batch_issue:
            prev[i] = batch_prev
        else:
            prev[i] = batch_prev = last_by_rank.get(r, -1)
            batch_rank, batch_issue = r, t
        if blocking[i]:
            cur = last_by_rank.get(r, -1)  # != batch_prev: a blocking member of this batch came first
            if cur == batch_prev or end[i] >= end[cur]:
                last_by_rank[r] = i
    return prev


class GraphCycleError(ValueError):
    """The step graph has a dependency cycle: the trace's events were matched into an impossible
    order (a receive that its own send waits for). A bug to report, not a step to replay."""


def topological_levels(g: StepGraph) -> np.ndarray:
    """Per event, its level in the step graph: 0 for events that wait for nothing, else 1 + the
    highest level of what it waits for (program-order predecessor, `<op>.wait` target; a p2p pair
    or a collective instance shares one level, as its members end together). Evaluating the levels in
    order is one longest-path pass. Raises GraphCycleError when the graph is not a DAG."""
    n = len(g.events)
    unit = np.arange(n, dtype=np.int64)  # events that end together: one node
    recv = np.flatnonzero(g.send_of >= 0)
    unit[g.send_of[recv]] = recv
    coll = np.flatnonzero(g.instance >= 0)
    unit[coll] = n + g.instance[coll]
    unit = pd.factorize(unit)[0].astype(np.int64)
    n_units = int(unit.max()) + 1 if n else 0
    src_parts, dst_parts = [g.prev], [np.arange(n)]
    for extra in (g.wait_of, g.dep_of):
        if extra is not None:
            src_parts.append(extra)
            dst_parts.append(np.arange(n))
    src, dst = np.concatenate(src_parts), np.concatenate(dst_parts)
    keep = src >= 0
    edges = np.unique(np.stack([unit[src[keep]], unit[dst[keep]]], axis=1), axis=0).reshape(-1, 2)
    level = _kahn_levels(n_units, edges[:, 0], edges[:, 1])
    if (level < 0).any():
        raise GraphCycleError(_cycle_text(g, np.flatnonzero(level[unit] < 0)))
    return level[unit]


def _kahn_levels(n_units: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Longest-path depth of each node by Kahn's algorithm, one frontier at a time; -1 on the nodes
    of cycles (and on what waits for them). A self-edge is a cycle."""
    level = np.full(n_units, -1, dtype=np.int64)
    indeg = np.bincount(dst, minlength=n_units)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    starts = np.searchsorted(src, np.arange(n_units + 1))
    frontier, depth = np.flatnonzero(indeg == 0), 0
    while frontier.size:
        level[frontier] = depth
        counts = starts[frontier + 1] - starts[frontier]
        total = int(counts.sum())
        if not total:
            break
        offsets = np.repeat(starts[frontier] - np.cumsum(counts) + counts, counts) + np.arange(total)
        reached = dst[offsets]
        indeg -= np.bincount(reached, minlength=n_units)
        frontier = np.unique(reached[indeg[reached] == 0])
        depth += 1
    return level


def _cycle_text(g: StepGraph, stuck: np.ndarray) -> str:
    ev = g.events.iloc[stuck[:4]]
    where = ", ".join(f"rank {r} {name} seq {seq}" for r, name, seq in zip(ev["rank"], ev.name, ev.seq))
    return (f"dependency cycle in the step graph of step {int(g.events.step.iloc[0])}: {len(stuck)} events "
            f"wait for each other in a loop (e.g. {where}); their sends and receives or collectives were "
            "matched into an impossible order")


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
    if g.dep_of is not None:  # inferred: the input a stage waited for without a receive span
        dv = np.flatnonzero(g.dep_of >= 0)
        end = ev.end_ns.to_numpy()
        free = np.where(g.prev[dv] >= 0, end[np.maximum(g.prev[dv], 0)], issue[dv])  # ready on its own
        waited = np.clip(end[g.dep_of[dv]] - free, 0, np.maximum(issue[dv] - free, 0))
        parts.append(pd.DataFrame({"src": g.dep_of[dv], "dst": dv, "kind": "pipeline", "wait_s": waited / 1e9}))
    edges = pd.concat(parts, ignore_index=True)
    src, dst = edges.src.to_numpy(dtype=np.int64), edges.dst.to_numpy(dtype=np.int64)
    return pd.DataFrame({"src_event_id": ids[src], "dst_event_id": ids[dst], "kind": edges.kind,
                         "src_rank": ranks[src], "dst_rank": ranks[dst], "wait_s": edges.wait_s})
