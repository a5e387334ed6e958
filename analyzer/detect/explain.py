"""Victims are not culprits: drop findings that another finding already explains.

Everything waits on a culprit: the data-parallel peer of a late launcher waits for its all-gathers
(inside its own forward, where waits cannot always be told from work), the stage of a straggler
looks slow, the collectives of a rank on a flapping link finish late. Each of those would be
reported as its own problem if judged alone. A finding is dropped when its ranks include the rank(s)
of a more specific finding whose steps overlap:
- stage_imbalance explained by a straggler or late launch in that stage;
- a collective group's slow_link / network_flap explained by a straggler, a late launch or a
  flapping p2p link among its members;
- a p2p link's finding explained by a straggler or late launch at one of its ends;
- a weaker straggler in the same pipeline replica (same dp and tp coordinates) whose onset comes
  after the stronger one's: the ranks of one replica work in lockstep, and on shared hosts the
  culprit's neighbours slow down with it.
A host pair's network finding from the lost-time attribution (detect/lost_time.py) is not dropped: it
holds only steps whose loss no rank's excess explains, so a rank at one of its links' ends that another
detector names is judged on the other steps (lost_time.settle), not the network on these.
"""

from __future__ import annotations

from megascope.analyzer.findings import CULPRIT_KINDS, NETWORK_KINDS, Finding


def drop_explained(findings: list[Finding], topology=None) -> list[Finding]:
    if topology is not None:
        findings = _drop_replica_followers(findings, topology)
    culprits = [f for f in findings if f.kind in CULPRIT_KINDS]
    links = [f for f in findings if f.kind in NETWORK_KINDS and _is_p2p(f)]
    out = []
    for f in findings:
        if f.evidence.get("source") == "lost_time":
            explained_by = []  # already attributed step by step
        elif f.kind == "stage_imbalance":
            explained_by = culprits
        elif f.kind in NETWORK_KINDS and not _is_p2p(f):
            explained_by = culprits + links
        elif f.kind in NETWORK_KINDS:
            explained_by = culprits
        else:
            explained_by = []
        cause = next((c for c in explained_by if c is not f and set(c.ranks) & set(f.ranks)
                      and _overlap(c.steps, f.steps)), None)
        if cause is None:
            out.append(f)
    return out


def _is_p2p(f: Finding) -> bool:
    return f.evidence.get("group", "pp") == "pp" and len(f.ranks) == 2


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _drop_replica_followers(findings: list[Finding], topology) -> list[Finding]:
    replica = {int(r.rank): (int(r.dp), int(r.tp)) for r in topology.itertuples()}
    single = [f for f in findings if f.kind == "straggler" and len(f.ranks) == 1]
    out = []
    for f in findings:
        leader = next((g for g in single if g is not f and f in single and g.severity > f.severity
                       and replica.get(g.ranks[0]) == replica.get(f.ranks[0])
                       and g.steps[0] <= f.steps[0] and _overlap(g.steps, f.steps)), None)
        if leader is None:
            out.append(f)
    return out
