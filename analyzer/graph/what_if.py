"""What-if: the step time if a finding's culprit had behaved like its peers.

Replays the step graph (program order with the recorded host gaps, a rank's first one from its
step's start, p2p transfers starting when both sides posted, collectives completing at the last
arrival; one longest-path pass in topological order,
a dependency cycle is reported as a bug and the what-if skipped) twice: as recorded, and with the
culprit fixed: a straggler's net compute divided by its slowdown against its stage peers (its tp
peers' spans that waited for it inside them fixed along), a stage's net compute set to the other
stages' median, the link's transfer time or its stalled host gaps to its peers', for workload
imbalance every data-parallel replica's compute to the replicas' mean (the same work, balanced).
The difference is the time the finding cost per step; over the step time (from the previous step's
end to this one's: the replay covers both steps, or this one alone after a barrier), the
throughput lost. Checked against fault-free twins: benchmarks/what_if_accuracy.py.
Compute spans that hold synchronous communication of their own rank (tensor-parallel collectives
inside forward/backward on real traces) are first cut into pieces around it (span_split.
split_compute): a tp peer of a slow rank sat in those collectives waiting for it, and kept as one
fixed duration that wait would survive the fix. Net compute = a span's pieces, the wait excluded.
Big jobs: only the culprit's pipeline replica and its data-parallel groups are replayed; everyone
else keeps its recorded times.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.data.event_pass import has_wait_spans
from megascope.analyzer.data.events_window import events_window
from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.findings import Finding
from megascope.analyzer.graph.span_split import split_compute
from megascope.analyzer.graph.step_graph import (
    GraphCycleError,
    StepGraph,
    graph_from_events,
    topological_levels,
)

FULL_REPLAY_MAX_RANKS = 2048
"""Runs with at most this many ranks (in the topology: a trace of one worker per tensor-parallel group
lists those) are replayed whole; bigger ones replay the culprit's pipeline replica and data-parallel
groups. Measured on a generated dp192 x tp8 x pp8 trace of its 1,536 tp-rank-0 workers (one GPU 10%
slow, the fault-free twin 0.07% faster): the 199-rank replay said 2.3% (the noisy replicas that set the
step outside it kept their times, the culprit's replica sped past them), the whole one 0.0%, in 3.5
against 0.7 CPU s for 3 steps. 512 before."""


def replay(g: StepGraph, duration: np.ndarray, gap: np.ndarray, xfer: np.ndarray,
           levels: np.ndarray | None = None) -> np.ndarray:
    """New end times of every event (ns, float) given own durations, host gaps and transfer times:
    one longest-path pass over the step graph in topological order (`levels`, from
    topological_levels(g), which raises GraphCycleError on a cycle; pass it to replay one graph
    several times). Per level, every event's issue = its predecessor's end + its gap (or its
    recorded issue), then its end: compute and other spans issue + duration; a p2p pair max of both
    issues + transfer; a collective its instance's last issue + transfer; a wait max(issue, its op's end)."""
    n = len(g.events)
    if levels is None:
        levels = topological_levels(g)
    is_recv = g.send_of >= 0
    is_send = np.zeros(n, dtype=bool)
    is_send[g.send_of[is_recv]] = True
    is_coll = g.instance >= 0
    is_wait = g.wait_of >= 0 if g.wait_of is not None else np.zeros(n, dtype=bool)
    # each level's events sorted by role: plain (compute, host, unmatched ops: issue + duration),
    # recv, send (ends with its recv), collective, wait; one slice per role and level, no masks
    role = np.select([is_wait, is_recv, is_send, is_coll], [4, 1, 2, 3], 0)
    key = levels * 5 + role
    order = np.argsort(key, kind="stable")
    b = np.searchsorted(key[order], np.arange(5 * (int(levels.max()) + 1 if n else 0) + 1))
    anchor = _anchors(g)
    issue, end = anchor.copy(), np.zeros(n)
    last = np.full(int(g.instance.max()) + 1 if is_coll.any() else 0, -np.inf)
    for lo in range(0, len(b) - 1, 5):
        i = order[b[lo]:b[lo + 5]]
        p = g.prev[i]
        issue[i] = np.where(p >= 0, end[np.maximum(p, 0)], anchor[i]) + gap[i]
        if g.dep_of is not None:  # an inferred input (no p2p rows): ready when both it and the rank are
            d = g.dep_of[i]
            has = d >= 0
            ready = np.maximum(np.where(p >= 0, end[np.maximum(p, 0)], -np.inf), end[np.maximum(d, 0)])
            issue[i] = np.where(has, ready + gap[i], issue[i])
        k, r, c, w = (order[b[lo + j]:b[lo + j + 1]] for j in (0, 1, 3, 4))
        end[k] = issue[k] + duration[k]
        if r.size:
            s = g.send_of[r]
            end[r] = end[s] = np.maximum(issue[r], issue[s]) + xfer[r]
        if c.size:  # an instance's members share a level: their last issue is complete here
            np.maximum.at(last, g.instance[c], issue[c])
            end[c] = last[g.instance[c]] + xfer[c]
        if w.size:  # a wait ends when its op does (an earlier level), or at once if the op already had
            assert g.wait_of is not None  # waits are found only where wait_of is
            end[w] = np.maximum(issue[w], end[g.wait_of[w]])
    return end


def _anchors(g: StepGraph) -> np.ndarray:
    """Where each rank's first event of the replay hangs from: the start of its step when the events
    carry it (`step_start_ns`, _with_step_starts) and it is not after the event's issue, else the issue
    itself. The host time from a step's start to its first span is a gap like any other, so a late
    launch there (an attached job's code outside hooked spans: a rank sleeping 30 ms before its
    forward) is cut by the fix; anchored at the issue it was fixed in place, and a step replayed alone
    after a barrier kept the whole of it (what-if 0.7% where the sleep was ~60% of the step)."""
    issue = g.events.issue_ns.to_numpy().astype(float)
    if "step_start_ns" not in g.events:
        return issue
    start = g.events.step_start_ns.to_numpy().astype(float)
    return np.where(np.isfinite(start) & (start <= issue), start, issue)


def _with_step_starts(store: Store, ev: pd.DataFrame, first: int, last: int,
                      ranks: list[int] | None = None) -> pd.DataFrame:
    """The events with their rank-step's start (steps.start_ns; NaN where the steps table has no row).
    Only the segments of `ranks` (None: all) are read, and none without events (a run summarized at the
    edge has none): every rank's steps segments read for each sampled step took 5.8 of the what-if's
    5.9 s at 3,072 ranks x 1,000 steps."""
    if ev.empty:
        return ev.assign(step_start_ns=pd.Series(dtype="float64"))
    starts = store.query(f"SELECT rank, step, min(start_ns) AS step_start_ns FROM {store.table_source('steps', ranks)} "
                         "WHERE step BETWEEN $first AND $last GROUP BY rank, step",
                         {"first": int(first), "last": int(last)})
    return ev.merge(starts, on=["rank", "step"], how="left")


def _inputs(g: StepGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ev = g.events
    issue, start, end = (ev[c].to_numpy().astype(float) for c in ("issue_ns", "start_ns", "end_ns"))
    duration = end - start
    gap = np.where(g.prev >= 0, np.maximum(issue - end[np.maximum(g.prev, 0)], 0), issue - _anchors(g))
    if g.dep_of is not None:  # the gap after both the rank and its input were ready: the rest was a wait
        d = np.maximum(g.dep_of, 0)
        ready = np.maximum(np.where(g.prev >= 0, end[np.maximum(g.prev, 0)], -np.inf), end[d])
        gap = np.where(g.dep_of >= 0, np.maximum(issue - ready, 0), gap)
    xfer = duration.copy()
    r = np.flatnonzero(g.send_of >= 0)
    xfer[r] = end[r] - np.maximum(issue[r], issue[g.send_of[r]])
    if (g.instance >= 0).any():
        coll = np.flatnonzero(g.instance >= 0)
        last = issue[g.last_arrival[coll]]
        xfer[coll] = np.maximum(end[coll] - last, 0)
    return duration, gap, xfer


def _apply_fix(f: Finding, g: StepGraph, topo: pd.DataFrame, duration, gap, xfer,
               known: dict[str, float] | None = None) -> None:
    ev = g.events.join(topo.set_index("rank")[["pp", "dp", "tp"]], on="rank")
    culprit = ev["rank"].isin(f.ranks).to_numpy()
    outer = ~ev.internal.to_numpy(dtype=bool)  # gaps inside split spans are 0 by construction: not typical ones
    if f.kind == "straggler":
        spans = net_compute(ev, duration)
        mine = spans["rank"].isin(f.ranks).to_numpy()
        mine = mine | _gated(spans, mine)
        peers, stage, names = ~mine, spans.pp.to_numpy(), spans.name.to_numpy()
        med = spans.net[peers].groupby([stage[peers], names[peers]]).median()
        ref = med.reindex(pd.MultiIndex.from_arrays([stage, names])).to_numpy()
        _set_net(duration, ev, spans, _unslowed(spans, mine, ref, f.steps, known or {}))
    elif f.kind == "stage_imbalance":  # the stage's ops at the job's mean per op: its share of a balanced split
        spans = net_compute(ev, duration)
        mine = (spans.pp == f.evidence.get("stage")).to_numpy()
        mean = spans.groupby("name").net.transform("mean").to_numpy()
        _set_net(duration, ev, spans, np.where(mine, mean, spans.net.to_numpy()))
    elif f.kind == "workload_imbalance":  # balanced batches: every dp replica does the mean work
        spans = net_compute(ev, duration)
        keys = [spans[c].to_numpy() for c in ("pp", "tp", "chunk", "microbatch", "name")]
        _set_net(duration, ev, spans, spans.net.groupby(keys, dropna=False).transform("mean").to_numpy())
    elif f.kind == "late_launch":
        typical = np.median(gap[~culprit & outer]) if (~culprit & outer).any() else 0.0
        gap[culprit & outer] = np.minimum(gap[culprit & outer], typical)
    elif f.kind in ("network_flap", "slow_link"):
        p2p = (ev.kind == "p2p").to_numpy()
        on_link = p2p & culprit & ev.peer.isin(f.ranks).to_numpy()
        coll = (g.instance >= 0) & (ev.kind == "collective").to_numpy()
        if f.evidence.get("signal") == "stall":
            # both ends stalled before issuing their transfers to each other (the transfers looked
            # normal): the time sits in the host gaps before those ops -> the other p2p ops' typical gap
            others = p2p & ~on_link & outer
            if on_link.any() and others.any():
                _cut_gaps(g, gap, np.flatnonzero(on_link), float(np.median(gap[others])))
        elif on_link.any() and (p2p & ~on_link).any():
            xfer[on_link] = np.minimum(xfer[on_link], np.median(xfer[p2p & ~on_link]))
        else:  # a collective group: its members' transfers become those of the other groups
            grp = f.evidence.get("group")
            same = coll & (ev["group"] == grp).to_numpy()
            mine = same & culprit
            if (same & ~mine).any():
                xfer[mine] = np.minimum(xfer[mine], np.median(xfer[same & ~mine]))


def _cut_gaps(g: StepGraph, gap: np.ndarray, ops: np.ndarray, typical: float) -> None:
    """Host gaps before `ops` -> at most `typical`. A gap is measured from the end of the last blocking
    event, so the time cut before an async op (a send) is also in the gaps of the events after it up
    to the next blocking one: cut there too."""
    ranks = g.events["rank"].to_numpy()
    blocking = g.blocking
    n = len(gap)
    for i in ops:  # in program order: a later op's gap is cut of what earlier ones removed first
        cut = gap[i] - min(gap[i], typical)
        gap[i] -= cut
        j = i + 1
        while cut > 0 and not blocking[i] and j < n and ranks[j] == ranks[i] and g.prev[j] == g.prev[i]:
            gap[j] = max(gap[j] - cut, 0.0)
            j += 1


def slowdown(store: Store, f: Finding) -> dict[str, float]:
    """The straggler's slowdown per op name ("forward", "backward") over the finding's steps, from
    rank_step (what_if_slowdown.sql); empty where rank_step is not built or the stage has no peers
    in other replicas."""
    built = store.query("SELECT count(*) AS n FROM information_schema.tables WHERE table_name = 'rank_step'")
    if not int(built.n.iat[0]):
        return {}
    row = store.query(load_sql("what_if_slowdown"), {"ranks": [int(r) for r in f.ranks],
                                                     "first": int(f.steps[0]), "last": int(f.steps[1])})
    return {k: float(row[k].iat[0]) for k in ("forward", "backward") if len(row) and row[k].iat[0] == row[k].iat[0]}


def _unslowed(spans: pd.DataFrame, mine: np.ndarray, ref: np.ndarray, steps: tuple[int, int],
              known: dict[str, float]) -> np.ndarray:
    """Net compute of every span with the straggler's spans divided by its slowdown (at least 1):
    `known` per op name (the whole finding, slowdown()), else the median over its spans in the
    replayed steps of net / the stage peers' median (`ref`). Each span keeps its own work: setting
    each to the peers' median gave the culprit the typical work of a step whose replica drew long
    sequences (-2.3% against the twin with 10% sequence-length noise per micro-batch); a slowdown
    judged on two steps only carries that step's draws (-2.1%: 1.6x for 1.4x)."""
    net = spans.net.to_numpy()
    ratio = pd.Series(net / ref, index=spans.index)
    during = spans.step.between(*steps).to_numpy()
    use = mine & during & np.isfinite(ratio.to_numpy())
    factor = ratio[use].groupby(spans.name[use]).median()
    factor = pd.Series({**factor.to_dict(), **known}, dtype=float).clip(lower=1.0)
    slow = spans.name.map(factor).fillna(1.0).to_numpy()
    return np.where(mine, net / slow, net)


def net_compute(ev: pd.DataFrame, duration: np.ndarray) -> pd.DataFrame:
    """One row per compute span of a split frame (split_compute, with topology pp/tp, and dp where
    joined): span, rank, step, pp, tp, (dp,) chunk, microbatch, name; net, its pieces' durations summed: the
    span's own work without the time it sat in nested synchronous communication; pieces; end (ns)."""
    comp = (ev.kind == "compute").to_numpy()
    cols = ["span", "rank", "step", "pp", "tp"] + (["dp"] if "dp" in ev else []) + ["chunk", "microbatch", "name"]
    rows = ev.loc[comp, cols].assign(net=duration[comp], end=ev.end_ns.to_numpy()[comp])
    first = rows.drop_duplicates("span").drop(columns=["net", "end"]).set_index("span")
    agg = rows.groupby("span").agg(net=("net", "sum"), pieces=("net", "size"), end=("end", "max"))
    return first.join(agg).reset_index()


GATED_END_TOLERANCE = 0.005
"""A tp peer's span ends "together" with the straggler's within this share of the straggler's span
(+ 10 us). Traces whose tp collectives are inside the kernels' timing (NDTimeline: one span per op,
from its own start to the group's end) end exactly together (0-1 ns in the independent generator's);
spans the simulator ends apart (tp all-reduce after the span) differ by ~2% (1.5% noise per op each)."""


def _gated(spans: pd.DataFrame, mine: np.ndarray) -> np.ndarray:
    """The spans of the culprit's tp peers (same stage and replica, same op) that end together with
    the culprit's span and hold no visible communication (one piece): the peers waited for the culprit
    inside them, a wait that leaves with the fix. Kept as recorded they would keep the step as slow
    (a 10% straggler on a tp=2 trace was credited 0.0%)."""
    if "dp" not in spans or not mine.any():
        return np.zeros(len(spans), dtype=bool)
    key = ["pp", "dp", "chunk", "microbatch", "name"]
    ref = spans.loc[mine, key + ["net", "end"]].drop_duplicates(key)
    m = spans[key + ["pieces", "end"]].reset_index().merge(ref, on=key, suffixes=("", "_c"))
    tol = GATED_END_TOLERANCE * m.net + 10_000
    hit = m["index"][(m.pieces == 1) & ((m.end - m.end_c).abs() <= tol)].to_numpy()
    out = np.zeros(len(spans), dtype=bool)
    out[hit] = True
    return out & ~mine


def _set_net(duration: np.ndarray, ev: pd.DataFrame, spans: pd.DataFrame, target: np.ndarray) -> None:
    """Scale each span's pieces alike so that its net compute becomes `target` (work done at a
    different speed stretches every piece of it); a span cut in pieces with no net compute keeps it."""
    comp = (ev.kind == "compute").to_numpy()
    at = pd.Index(spans.span.to_numpy()).get_indexer(ev.span.to_numpy()[comp])
    net, want, mine = spans.net.to_numpy()[at], np.asarray(target, dtype=float)[at], duration[comp]
    scaled = np.where(net > 0, mine * want / np.where(net > 0, net, 1.0), mine)
    duration[comp] = np.where(mine == net, want, scaled)  # a whole span: exactly the target


def replay_ranks(store: Store, f: Finding) -> list[int] | None:
    """None = all ranks; else the culprit's pipeline replicas plus its data-parallel groups."""
    topo = store.topology
    if len(topo) <= FULL_REPLAY_MAX_RANKS:
        return None
    c = topo[topo["rank"].isin(f.ranks)]
    sel = topo.dp.isin(c.dp) | (topo.pp.isin(c.pp) & topo.tp.isin(c.tp))
    return topo.loc[sel, "rank"].astype(int).tolist()


def _replay_step(store: Store, f: Finding, step: int, ranks: list[int] | None, cpu_trace: bool, dp: int,
                 tp: int, known: dict[str, float] | None = None) -> tuple[int, float, float, float] | str | None:
    """(step, observed, replayed, what-if) step times in seconds, a reason the what-if cannot be
    run (a cycle), or None without events. The step time is the time from the end of the step
    before (its last rank's) to the end of this one, what throughput sees. Without a barrier
    between the steps the replay covers both, so each rank starts this step when its own previous
    step ends in the replay: replaying this step alone, each rank starting at its recorded time,
    kept the stagger a slow pipeline leaves between the stages' starts (stage 3 started 3.3 s before
    stage 0 behind a 2.4x slow stage-0 rank, 1.4 s in the fault-free twin; what-if 12.5% above the
    twin). With a barrier (every rank started this step only after every rank ended the previous
    one: a job-wide sync the trace does not show) the ranks' waits for it are not their own time:
    this step is replayed alone from its recorded start, plus the recorded time from the previous
    step's end to that start (the two-step replay kept those waits and was 7.6% above the twin)."""
    ev = _with_step_starts(store, events_window(store, step - 1, step, ranks, limit=1 << 40), step - 1, step,
                           ranks)
    now_ev = ev.step == step
    if not now_ev.any():
        return None
    overhead = _barrier(ev, now_ev)
    if overhead is not None:
        ev = ev[now_ev]
    g = graph_from_events(split_compute(ev, cpu_trace), store.topology, dp, tp, waits=cpu_trace)
    try:
        levels = topological_levels(g)
    except GraphCycleError as exc:
        return f"{exc}: a bug, please report it; what-if skipped"
    on = g.events.step.to_numpy()
    now = on == step
    duration, gap, xfer = _inputs(g)
    before = (duration.copy(), gap.copy(), xfer.copy())
    _apply_fix(f, g, store.topology, duration, gap, xfer, known)
    outside = (on < f.steps[0]) | (on > f.steps[1])  # the step before may precede the fault
    for fixed, kept in zip((duration, gap, xfer), before):
        fixed[outside] = kept[outside]
    if launch_delays_only(g.events):
        about = gap != before[1]  # the gaps the fix cuts are the finding's own evidence: they stay
        before[1][~about] = gap[~about] = 0.0
    base = replay(g, *before, levels)
    fixed = replay(g, duration, gap, xfer, levels)

    def step_time(end: np.ndarray) -> float:
        if overhead is not None:
            return float(end[now].max() - g.events.issue_ns.to_numpy()[now].min() + overhead) / 1e9
        start = end[~now].max() if (~now).any() else g.events.issue_ns.to_numpy()[now].min()
        return float(end[now].max() - start) / 1e9

    return step, step_time(g.events.end_ns.to_numpy()), step_time(base), step_time(fixed)


def launch_delays_only(ev: pd.DataFrame) -> bool:
    """Whether the events' host gaps are launch delays rather than host time: a trace timed on the GPU's
    streams alone (NDTimeline: every op's issue is its start) cannot tell a host that was busy from one
    that waited for something it does not record (a rank of the What-if artifact's AR trace sits 22 s
    before a layernorm all-reduce until the slow replica catches up). The What-if paper (OSDI'25)
    replays such traces without them (its t_ori is that replay): kept, that wait survived the fix of
    the slow rank, and the what-if said 0.1% where the paper's says the step halves."""
    return bool(len(ev)) and not bool((ev.issue_ns != ev.start_ns).any())


def _barrier(ev: pd.DataFrame, now: pd.Series) -> float | None:
    """The recorded ns from the previous step's last end to this step's first issue when every rank
    started this step only after every rank had ended the previous one (a barrier); else None. A
    previous step that ended longer before this one began than this step lasts is not the step
    before: the steps between were not traced (a sampled trace renumbered 0, 1, 2, ... keeps one
    step in N; counted, 27 untraced steps in each step's time made a 2.35x straggler's what-if 2.1%
    where the fault-free twin runs 1.66x faster): this step alone, without that time (0)."""
    if now.all():
        return None
    prev_end, start = ev.end_ns[~now].max(), ev.issue_ns[now].min()
    if start < ev.end_ns[~now].min():  # before anything of the step before ended: each step on a clock of
        return 0.0  # its own (the What-if artifact's traces start every sampled step at 0)
    if start - prev_end > ev.end_ns[now].max() - start:
        return 0.0
    return float(start - prev_end) if start >= prev_end else None


def _sample_steps(store: Store, f: Finding, max_steps: int) -> list[int]:
    """Up to `max_steps` steps of the finding spread evenly over the steps that exist (a sampled trace's
    ids are N apart: evenly spaced ids between its first and last would name steps it never recorded)."""
    first, last = f.steps
    built = store.query("SELECT count(*) AS n FROM information_schema.tables WHERE table_name = 'rank_step'")
    ids = [int(r.step) for r in store.query(
        "SELECT DISTINCT step FROM rank_step WHERE step BETWEEN $first AND $last AND rank = $rank ORDER BY step",
        {"first": int(first), "last": int(last), "rank": int(f.ranks[0])}).itertuples()
    ] if f.ranks and int(built.n.iat[0]) else []
    if not ids:
        return sorted(set(np.linspace(first, last, num=min(max_steps, last - first + 1)).round().astype(int)))
    at = np.linspace(0, len(ids) - 1, num=min(max_steps, len(ids))).round().astype(int)
    return sorted({ids[i] for i in at})


def what_if(store: Store, f: Finding, max_steps: int | None = None) -> dict:
    if max_steps is None:  # each sampled step reads that step from every replayed rank's segments
        max_steps = 3 if len(store.topology) <= 4096 else 1
    if f.kind == "hang":
        return {"applicable": False, "reason": "a hung job makes no progress; fix the suspects"}
    sample = _sample_steps(store, f, max_steps)
    ranks = replay_ranks(store, f)
    cpu_trace = has_wait_spans(store)
    dp, tp = (int(store.manifest["topology"][k]) for k in ("dp", "tp"))
    known = slowdown(store, f) if f.kind == "straggler" else {}
    rows = []
    for step in sample:
        row = _replay_step(store, f, int(step), ranks, cpu_trace, dp, tp, known)
        if isinstance(row, str):
            return {"applicable": False, "reason": row}
        if row is not None:
            rows.append(row)
    if not rows:
        return {"applicable": False, "reason": "no events in the finding's steps"}
    df = pd.DataFrame(rows, columns=["step", "observed_s", "replayed_s", "what_if_s"])
    # the fraction saved in the replay, applied to the observed step time: where the replay model
    # misses overlap the trace does not show (real traces: async ops, receives posted ahead), its
    # absolute times drift from the observed ones, but the share the culprit costs stays meaningful
    frac = ((df.replayed_s - df.what_if_s).clip(lower=0) / df.replayed_s.where(df.replayed_s > 0)).fillna(0)
    step_time = float(df.observed_s.mean())
    saved = float((frac * df.observed_s).mean())
    return {"applicable": True, "steps_sampled": df.step.tolist(), "step_time_s": round(step_time, 6),
            "what_if_step_time_s": round(step_time - saved, 6), "saved_per_step_s": round(saved, 6),
            "throughput_lost": round(saved / step_time, 4) if step_time > 0 else 0.0,
            "replayed_ranks": "all" if ranks is None else len(ranks)}
