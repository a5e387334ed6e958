"""Hang culprits from the in-flight records (RUN/inflight/rank=NNNNN.json: each rank's watchdog
publishes one in the job's control store when a collective or p2p op stays in flight too long, and
rank 0's watchdog or `megascope train`'s supervisor copies them here; without a store each rank writes
its own file). Offline: only the run directory is read.

Wait-for graph: a waiting rank points at the peers of its stuck op that never arrived there (a peer
stuck in a different op, or one that wrote no record). The suspects are the ranks at the end of those
chains that wrote nothing: everyone is (transitively) waiting on them. Their last recorded events say
where they stopped.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megascope.analyzer.data.store import Store
from megascope.analyzer.findings import Finding, hosts_of, rank_list
from megascope.tracer import run_dir as rd

if TYPE_CHECKING:  # context.py imports this module (find_hang)
    from megascope.analyzer.detect.context import DetectContext


@dataclass
class HangReport:
    suspects: list[int]
    """Ranks everyone waits on: they never arrived and wrote no in-flight record."""
    waiting: list[int]
    """Ranks stuck in a collective/p2p op (they wrote a record)."""
    op: str
    """The op most waiters are stuck in (e.g. 'reduce_scatter (dp)')."""
    step: int
    summary: str
    evidence: dict = field(default_factory=dict)

    def to_finding(self, topology, world: int) -> Finding:
        return Finding("hang", self.suspects, hosts_of(topology, self.suspects), (self.step, self.step),
                       len(self.waiting) / max(1, world), self.summary, self.evidence)


def read_inflight(path: Path, warnings: list[str]) -> dict[int, dict]:
    records: dict[int, dict] = {}
    folder = rd.inflight_dir(path)
    if not folder.is_dir():
        return records
    for f in sorted(folder.glob("rank=*.json")):
        try:
            rec = _flatten(json.loads(f.read_text()))
            if rec.get("state") == "resolved":  # the wait ended: this rank is not stuck
                continue
            records[int(rec["rank"])] = rec
        except (ValueError, KeyError, TypeError) as exc:
            warnings.append(f"skipped unreadable in-flight record {f.name}: {exc}")
    return records


def _flatten(rec: dict) -> dict:
    """The tracer's watchdog nests the stuck op under `waiting_on` (op, group, seq, peers, since_ns,
    step); the simulator writes those fields at the top level. One shape for the rest of the module."""
    waiting = rec.get("waiting_on")
    if isinstance(waiting, dict):
        rec = {**rec, **{k: v for k, v in waiting.items() if k not in ("rank",)}}
    rec.setdefault("op", "?")
    return rec


def _waits_on(rec: dict, records: dict[int, dict]) -> list[int]:
    """Peers of this record's op that did not arrive at the same op."""
    me = int(rec["rank"])
    out = []
    for peer in rec.get("peers", []):
        peer = int(peer)
        if peer == me:
            continue
        other = records.get(peer)
        same_op = other is not None and other.get("group") == rec.get("group") and \
            other.get("seq") == rec.get("seq") and rec.get("group") != "pp"
        if not same_op:
            out.append(peer)
    return out


class HangDetector:
    """The hang as a finding (the context's report, found once): Run puts it first in its detectors,
    default or injected, and the finding leads the run's findings (findings.KINDS order)."""

    def detect(self, ctx: DetectContext) -> list[Finding]:
        hang = ctx.hang()
        return [] if hang is None else [hang.to_finding(ctx.topology, len(ctx.topology))]


def find_hang(store: Store) -> HangReport | None:
    records = read_inflight(store.path, store.warnings)
    if not records:
        return None
    edges = {r: _waits_on(rec, records) for r, rec in records.items()}
    suspects: set[int] = set()
    for start in records:
        seen, frontier = set(), [start]
        while frontier:
            node = frontier.pop()
            if node in seen:
                continue
            seen.add(node)
            if node not in records:
                suspects.add(node)
            else:
                frontier.extend(edges.get(node, []))
    cycle = False
    if not suspects:  # everyone recorded: a wait cycle; blame whoever got stuck first
        cycle = True
        first = min(records.values(), key=lambda r: r.get("since_ns", 0))
        suspects = {int(first["rank"])}
    direct = [records[r] for r, e in edges.items() if set(e) & suspects]
    op_rec = Counter(f"{r['op']} ({r.get('group', '')})" for r in (direct or records.values())).most_common(1)[0][0]
    step = int(min(int(r.get("step", 0)) for r in records.values()))
    last = _last_events(store, sorted(suspects))
    sus = sorted(suspects)
    hosts = [h for h in hosts_of(store.topology, sus) if h != "unknown"]  # imports may not know hosts
    when = f"at step {step}" if step >= 0 else "outside any recorded training step"
    summary = (f"The job hung {when}: {len(records)} ranks wait in {op_rec} and everyone is waiting "
               f"on rank{'s' if len(sus) > 1 else ''} {rank_list(sus)}"
               + (f" ({', '.join(hosts)})" if hosts else "")
               + f", which {'are' if len(sus) > 1 else 'is'} stuck and wrote nothing; dump "
               f"{'their' if len(sus) > 1 else 'its'} stacks (py-spy dump) and check "
               f"{'their GPUs' if len(sus) > 1 else 'its GPU'}, then restart "
               + (f"without host {hosts[0]}." if hosts else "without the suspect's host."))
    if cycle:
        summary = f"The job hung {when} in a wait cycle ({op_rec}); rank {sus[0]} got stuck first."
    waiting = sorted(r for r in records if r not in suspects)  # the suspect may have a record too (stuck earlier)
    return HangReport(sus, waiting, op_rec, step, summary,
                      {"waiting_count": len(records), "direct_waiters": sorted(int(r["rank"]) for r in direct)[:64],
                       "last_events": last, "cycle": cycle})


def _last_events(store: Store, ranks: list[int]) -> dict[str, dict]:
    if not ranks:
        return {}
    ids = ", ".join(str(int(r)) for r in ranks[:256])
    df = store.query(f"""SELECT rank, arg_max(name, end_ns) AS name, arg_max(step, end_ns) AS step,
                                arg_max(microbatch, end_ns) AS microbatch, max(end_ns) AS end_ns
                         FROM events WHERE rank IN ({ids}) GROUP BY rank""")
    return {str(int(r.rank)): {"name": r.name, "step": int(r.step), "microbatch": int(r.microbatch),
                               "end_ns": int(r.end_ns)} for r in df.itertuples()}
