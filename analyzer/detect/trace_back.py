"""Late arrivals traced back along the pipeline's dependencies (issue 31): a rank that sat idle before a
forward until its previous stage's forward of the same micro-batch had ended (or before a backward until
the next stage's backward had), was waiting for that rank's send, not pausing. In a trace that records
the receives, that wait is a receive span and never looks like the rank's own time; in one that does not
(an NDTimeline job timing compute and data-parallel communication only), it is a host gap before the
compute, and the rank, reaching its data-parallel collectives late, looked like a late launcher.

For a culprit finding, on up to `max_steps` of its steps, the events of its pipeline replica are read
and each of the rank's gaps before a forward / backward is split at the end of the op it depends on:
the part before that end was a wait on the neighbour (it could not have started), the part after is
its own. The waits are followed upstream (a stage that waited on a stage that waited ...) to the rank
whose gaps are not waits: the source. A finding whose excess is mostly such waits, traced to a rank
another culprit finding names, is that rank's victim's: it goes, and the source's finding lists it.
Only traces that time no receive need it (elsewhere the waits are receive spans, never own time), and
at most MAX_FINDINGS findings a run are traced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.data.events_window import events_window
from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import CULPRIT_KINDS, Finding

VICTIM_SHARE = 0.25
"""A finding is a victim's when its excess waits on pipeline neighbours are >= this share of its excess
per step (and lead to a rank another finding names). Measured on NDTimeline traces from the
independent generator without p2p rows (tests/test_trace_back.py): the downstream victims of a 2.35x
straggler 91-111% of their excess, those of an untraced 20 ms host pause 51-105% (51%: a pause before
the culprit's first span is outside its step, its victim's wait on it is partly unmatched); the
pausing rank itself 0.0-0.02%."""


def replica_waits(ev: pd.DataFrame, stage: dict[int, int]) -> dict[int, tuple[float, float, float]]:
    """Per rank of `ev` (one step of one pipeline replica, one rank per stage): (seconds of host gaps
    spent waiting on the previous stage, on the next stage, all host gaps). A compute op's gap (from the
    end of the rank's previous op) counts as waiting up to the end of the op it depends on: forward, the
    previous stage's forward of the same micro-batch and chunk; backward, the next stage's backward."""
    ev = ev.sort_values(["rank", "start_ns"], kind="stable")
    comp = ev[ev.kind == "compute"].groupby(["rank", "name", "microbatch", "chunk"])
    done, began = comp.end_ns.max(), comp.start_ns.min()
    by_stage = {stage[int(r)]: int(r) for r in ev["rank"].unique()}
    out = {}
    for rank, mine in ev.groupby("rank"):
        rank = int(rank)
        prior = np.maximum.accumulate(mine.end_ns.to_numpy())
        gap_start = np.concatenate(([mine.start_ns.iat[0]], prior[:-1])).astype(float)
        gap = np.clip(mine.start_ns.to_numpy() - gap_start, 0, None)
        waits = [0.0, 0.0]
        last = None
        for i, e in enumerate(mine.itertuples()):
            if gap[i] > 0 and e.kind == "compute" and e.name in ("forward", "backward"):
                side = 0 if e.name == "forward" else 1
                # what it received: the previous stage's forward / the next stage's backward had to end
                deps = [(side, done, (e.name, e.microbatch, e.chunk))]
                if last is not None:
                    # what it sent just before: a send that meets its receiver (rendezvous; NCCL for large
                    # messages) holds the rank until the receiving stage took it (began that op)
                    deps.append((int(last.name == "forward"), began, (last.name, last.microbatch, last.chunk)))
                best, best_side = 0.0, side
                for sd, table, key in deps:
                    nb = by_stage.get(stage[rank] + (-1 if sd == 0 else 1))
                    dep = table.get((nb, *key)) if nb is not None else None
                    if dep is not None and dep - gap_start[i] > best:
                        best, best_side = float(min(dep - gap_start[i], gap[i])), sd
                waits[best_side] += best / 1e9
            if e.kind == "compute" and e.name in ("forward", "backward"):
                last = e
        out[rank] = (waits[0], waits[1], float(gap.sum()) / 1e9)
    return out


@dataclass
class Excess:
    """Per rank, seconds per step above its stage peers' median: waits on the previous and the next
    stage, and its own host gaps (gaps that were not waits)."""
    prev: dict[int, float]
    next: dict[int, float]
    own: dict[int, float]


def excess_waits(store: Store, rank: int, steps: list[int], max_replicas: int = 8) -> Excess | None:
    """Excess of the ranks of `rank`'s pipeline replica, from its events and those of up to
    `max_replicas` - 1 other replicas (its stage peers' level) on `steps`."""
    topo = store.topology
    key = ["dp", "tp"] + (["cp"] if "cp" in topo else [])
    me = topo[topo["rank"] == rank].iloc[0]
    replicas = [tuple(k) for k in topo[key].drop_duplicates().itertuples(index=False)]
    mine = tuple(me[k] for k in key)
    others = [r for r in replicas if r != mine and r[1:] == mine[1:]][:max_replicas - 1]
    chosen = [mine] + others
    if not others:
        return None
    members = topo[topo[key].apply(tuple, axis=1).isin(chosen)]
    stage = dict(zip(members["rank"].astype(int), members.pp.astype(int)))
    rows = []
    for step in steps:
        ev = events_window(store, step, step, sorted(stage), limit=1 << 40)
        for _, rep in members.groupby(key):
            part = ev[ev["rank"].isin(rep["rank"])]
            if not part.empty:
                rows += [(r, *w) for r, w in replica_waits(part, stage).items()]
    if not rows:
        return None
    df = pd.DataFrame(rows, columns=["rank", "prev", "next", "gaps"]).groupby("rank").mean()
    df["own"] = df.gaps - df.prev - df.next
    df["pp"] = df.index.map(stage)
    ref = df.groupby("pp")[["prev", "next", "own"]].transform("median")
    ex = df[["prev", "next", "own"]] - ref
    ours = [int(r) for r in topo.loc[topo[key].apply(tuple, axis=1) == mine, "rank"]]
    ex = ex[ex.index.isin(ours)]
    return Excess(ex.prev.to_dict(), ex.next.to_dict(), ex.own.to_dict())


def source_of(ex: Excess, stage: dict[int, int], rank: int) -> int:
    """The rank `rank`'s excess waits lead to: upstream or downstream along the pipeline, following the
    larger excess wait while a rank's excess is mostly waits (VICTIM_SHARE), to a rank whose is not."""
    by_stage = {s: r for r, s in stage.items() if r in ex.own}
    at, seen = rank, {rank}
    while True:
        prev, nxt, own = ex.prev.get(at, 0.0), ex.next.get(at, 0.0), ex.own.get(at, 0.0)
        waited = max(prev, nxt)
        if waited <= 0 or waited < VICTIM_SHARE * (max(prev, 0) + max(nxt, 0) + max(own, 0)):
            return at
        nb = by_stage.get(stage[at] + (-1 if prev >= nxt else 1))
        if nb is None or nb in seen:
            return at
        seen.add(nb)
        at = nb


def _sample(store: Store, f: Finding, max_steps: int) -> list[int]:
    ids = store.query("SELECT DISTINCT step FROM rank_step WHERE rank = $rank AND step BETWEEN $a AND $b "
                      "ORDER BY step", {"rank": int(f.ranks[0]), "a": int(f.steps[0]), "b": int(f.steps[1])})
    steps = ids.step.astype(int).tolist()
    if not steps:
        return []
    return sorted({steps[i] for i in np.linspace(0, len(steps) - 1, min(max_steps, len(steps))).round().astype(int)})


MAX_FINDINGS = 16
"""Findings traced back per run, the most severe first: each reads its replica's and up to 7 others'
events on 8 steps (2.8 s for one finding of a 1,024-rank simulated run at load ~15)."""


def _receives_timed(store: Store) -> bool:
    """Whether the trace times its pipeline receives: then a rank waiting on its neighbour sits in a
    receive span (recv_s), never in a host gap, and there is nothing to trace back."""
    row = store.query("SELECT count(*) FILTER (WHERE recv_s > 0) AS timed, count(*) AS n FROM rank_step")
    return int(row.timed.iat[0]) > 0


def trace_back(store: Store, findings: list[Finding], max_steps: int = 8) -> list[Finding]:
    """Culprit findings whose excess was mostly waiting on pipeline neighbours go, when the waits lead
    to a rank another culprit finding names; that finding lists them (evidence `victims`)."""
    topo = store.topology
    if topo.pp.nunique() < 2 or not any(_excess_s(f) for f in findings) or _receives_timed(store):
        return findings
    stage = dict(zip(topo["rank"].astype(int), topo.pp.astype(int)))
    named = {r: f for f in findings if f.kind in CULPRIT_KINDS for r in f.ranks}
    gone: set[int] = set()
    traced = sorted((f for f in findings if f.kind in CULPRIT_KINDS and len(f.ranks) == 1 and (_excess_s(f) or 0) > 0),
                    key=lambda f: -f.severity)[:MAX_FINDINGS]
    for f in traced:
        excess = _excess_s(f) or 0.0
        rank = int(f.ranks[0])
        ex = excess_waits(store, rank, _sample(store, f, max_steps))
        if ex is None or rank not in ex.own:
            continue
        waited = max(ex.prev[rank], 0.0) + max(ex.next[rank], 0.0)
        src = source_of(ex, stage, rank)
        f.evidence["pipeline_wait_ms"] = round(1e3 * waited, 3)
        f.evidence["waits_traced_to"] = src
        culprit = named.get(src)
        if src != rank and waited >= VICTIM_SHARE * excess and culprit is not None and culprit is not f:
            gone.add(id(f))
            culprit.evidence.setdefault("victims", []).append(rank)
            if "cost_s" in f.evidence and "cost_s" in culprit.evidence:  # the victim's charge is the source's
                culprit.evidence["cost_s"] = round(culprit.evidence["cost_s"] + f.evidence["cost_s"], 3)
                culprit.evidence["lost_share"] = round(culprit.evidence.get("lost_share", 0.0)
                                                       + f.evidence.get("lost_share", 0.0), 3)
    for f in findings:
        if f.evidence.get("victims") and id(f) not in gone:
            f.evidence["victims"] = sorted(f.evidence["victims"])
            f.summary += (f" Rank(s) {', '.join(map(str, f.evidence['victims']))} of its pipeline waited on it and "
                          "reached their collectives late: its victims, not culprits.")
    return [f for f in findings if id(f) not in gone]


def _excess_s(f: Finding) -> float | None:
    """The finding's excess per step (seconds) over its stage peers, as its detector stated it."""
    ev = f.evidence
    if "excess_ms" in ev:
        return float(ev["excess_ms"]) / 1e3
    return None
