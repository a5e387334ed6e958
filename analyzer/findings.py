"""Finding: one diagnosis the analyzer reports (the objects of `megascope analyze --json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

Kind = Literal["hang", "straggler", "late_launch", "network_flap", "slow_link", "stage_imbalance",
               "workload_imbalance"]
"""What a finding diagnoses, most urgent first: a hang leads `Run.findings()`, the findings with a cost
follow, costliest first, and those without one come last in this order (report_order)."""
KINDS: tuple[Kind, ...] = get_args(Kind)
SEVERITY_ORDER: dict[str, int] = {kind: i for i, kind in enumerate(KINDS)}
"""Kind -> its place in KINDS (report_order's order of the findings without a cost)."""
CULPRIT_KINDS: tuple[Kind, ...] = ("straggler", "late_launch")
"""Kinds that name the rank the others waited on: they explain the findings of their victims
(detect/explain.py), carry its collective-arrival evidence (Run.findings) and a per-rank score
series in the watcher's metrics (watch/metrics.py)."""
NETWORK_KINDS: tuple[Kind, ...] = ("network_flap", "slow_link")
"""The kinds that blame the network between two ranks, not a rank: one live finding (watch/tracker.py),
one link in the link view, explained by their link."""

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
    """A ratio of the kind's own: a rank's slowdown against its peers (1.10 = 10% slower), a link's
    episode step time over the healthy one, a hang's share of ranks waiting. It does not compare across
    kinds, so the report orders by cost (report_order) and its text leaves severity out."""
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


def report_order(kind: str, evidence: dict[str, Any], severity: float) -> tuple[int, float, int, float]:
    """Sort key of the report's findings: a hang first (the job is stopped: nothing else can be acted
    on); then every finding with a cost (`cost_s`), the costliest first, whatever its kind; then the rest
    in KINDS order, by severity within a kind (where it means one thing)."""
    place = SEVERITY_ORDER.get(kind, len(SEVERITY_ORDER))
    if kind == "hang":
        return (0, 0.0, place, -severity)
    cost = evidence.get("cost_s")
    if cost is not None:
        return (1, -float(cost), place, -severity)
    return (2, 0.0, place, -severity)


def gpu_hours(cost_s: float, world: int) -> float:
    """GPU-hours a culprit cost: its seconds x the job's ranks / 3600. In a synchronous step every rank
    waits for the slowest, so all of them lost those seconds (6 decimals: a 30-step demo's 16 ms on 8
    ranks is 3.6e-5)."""
    return round(cost_s * world / 3600, 6)


def price_by_what_if(f: Finding, what_if: dict[str, Any], steps: list[int], world: int) -> None:
    """Give a finding the lost-time attribution left without a cost (runs of fewer than 30 analyzed
    steps have no attribution: the demo's 30) its what-if's: the seconds it saves a step times the run's
    steps it covers, x the job's ranks for GPU-hours, marked `cost_from: "what_if"`. Without it the demo
    listed a straggler whose what-if said 2.3% of the throughput above a flapping link's 30.1%."""
    if f.evidence.get("cost_s") is None and what_if.get("applicable") and what_if.get("saved_per_step_s") is not None:
        cost = float(what_if["saved_per_step_s"]) * sum(f.steps[0] <= s <= f.steps[1] for s in steps)
        f.evidence.update(cost_s=round(cost, 3), gpu_hours=gpu_hours(cost, world), cost_from="what_if")


def cost_text(evidence: dict[str, Any]) -> str:
    """A finding's cost for sentences: '0.047 s (16% of the run's lost time; 0.16 GPU-hours)', from
    its `cost_s`, `lost_share` and `gpu_hours` (the last two when it has them), '... by its what-if'
    when price_by_what_if gave it."""
    parts = [f"{100 * evidence['lost_share']:.0f}% of the run's lost time"] if "lost_share" in evidence else []
    if "gpu_hours" in evidence:
        parts.append(f"{_amount(evidence['gpu_hours'])} GPU-hours")
    how = " by its what-if" if evidence.get("cost_from") == "what_if" else ""  # price_by_what_if's
    return f"{_amount(evidence['cost_s'])} s" + (f" ({'; '.join(parts)})" if parts else "") + how


def _amount(x: float) -> str:
    """A few significant digits without an exponent: 1234, 12.3, 0.047, <0.001."""
    if 0 < abs(x) < 5e-4:
        return "<0.001"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.3f}"


def rank_list(ranks: list[int], limit: int = 8) -> str:
    """'3', '3, 4 and 9', or '3, 4, 9, ... (12 ranks)' for sentences."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return str(ranks[0])
    if len(ranks) <= limit:
        return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return ", ".join(map(str, ranks[:limit])) + f", ... ({len(ranks)} ranks)"
