"""Finding: one diagnosis the analyzer reports (the objects of `megascope analyze --json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("straggler", "late_launch", "stage_imbalance", "network_flap", "slow_link", "hang", "workload_imbalance")


@dataclass
class Finding:
    kind: str
    """straggler | late_launch | stage_imbalance | network_flap | slow_link | hang | workload_imbalance"""
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
