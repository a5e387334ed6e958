"""Finding: one diagnosis the analyzer reports (the objects of `megascope analyze --json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

Kind = Literal["hang", "straggler", "late_launch", "network_flap", "slow_link", "stage_imbalance",
               "workload_imbalance"]
"""What a finding diagnoses, most urgent first: `Run.findings()` lists findings in this order (then by
severity), so a hang leads and the culprits come before the links and the imbalances they explain."""
KINDS: tuple[Kind, ...] = get_args(Kind)
SEVERITY_ORDER: dict[str, int] = {kind: i for i, kind in enumerate(KINDS)}
"""Kind -> its place in KINDS (the sort key of `Run.findings`)."""
CULPRIT_KINDS: tuple[Kind, ...] = ("straggler", "late_launch")
"""Kinds that name the rank the others waited on: they explain the findings of their victims
(detect/explain.py), carry its collective-arrival evidence (Run.findings) and a per-rank score
series in the watcher's metrics (watch/metrics.py)."""

MIN_LATENESS_S = 1e-4
"""Seconds: the last member of a collective counts as late (sql/arrivals.sql, `min_lateness_s`) when it
arrived more than this after the members' mean arrival; below it is timer resolution and noise."""


@dataclass
class Finding:
    kind: Kind
    """hang | straggler | late_launch | network_flap | slow_link | stage_imbalance | workload_imbalance"""
    ranks: list[int]
    """The culprit rank(s) (for a link: its two ends; for imbalance: the stage's ranks; for
    workload imbalance: every rank of the replicas)."""
    hosts: list[str]
    steps: tuple[int, int]
    """[first, last] affected step; first is the onset."""
    severity: float
    """A ratio: the slowdown against peers (1.10 = 10% slower), or the slow-down of a link."""
    summary: str
    """One sentence a person can act on."""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["steps"] = [int(self.steps[0]), int(self.steps[1])]
        out["ranks"] = [int(r) for r in self.ranks]
        out["severity"] = round(float(self.severity), 4)
        return out


def hosts_of(topology, ranks: list[int]) -> list[str]:
    """Hosts of the given ranks, in first-seen order."""
    lookup = dict(zip(topology["rank"], topology["host"]))
    seen: list[str] = []
    for r in ranks:
        h = lookup.get(r)
        if h is not None and h not in seen:
            seen.append(h)
    return seen


def rank_list(ranks: list[int], limit: int = 8) -> str:
    """'3', '3, 4 and 9', or '3, 4, 9, ... (12 ranks)' for sentences."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return str(ranks[0])
    if len(ranks) <= limit:
        return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return ", ".join(map(str, ranks[:limit])) + f", ... ({len(ranks)} ranks)"
