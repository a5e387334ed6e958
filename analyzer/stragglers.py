"""Stragglers, late launches and stage imbalance: each rank judged against the ranks doing the same
work, with robust statistics, persistence over steps and an onset step.

- slow compute: forward+backward time >= `min_ratio` x the stage peers' median and a robust z-score
  (median/MAD) >= `min_z`, for `persist_steps` steps (a one-step spike is noise).
- late launch: compute is normal but the rank's untraced host time (`other_s`: gaps before it issues
  its ops, the MegaScale GC-pause case) exceeds its peers' by >= `min_gap_s`, on >= `late_min_count`
  steps. Arrival skew at collectives confirms: the culprit arrives last, its peers wait (victims).
- stage imbalance: a whole stage's median compute >= `imbalance_ratio` x the other stages' median.
  Judging ranks only against their own stage means an imbalanced stage never blames its ranks.
Waiting time (p2p receives, collectives) is excluded from both measures, so victims are not blamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from megascope.analyzer.episodes import persistent_runs, runs
from megascope.analyzer.findings import Finding, hosts_of, rank_list
from megascope.analyzer.store import Store, load_sql


@dataclass
class StragglerConfig:
    min_ratio: float = 1.03
    min_z: float = 4.0
    persist_steps: int = 3
    min_gap_s: float = 1e-3
    min_gap_z: float = 6.0
    late_min_count: int = 3
    late_max_period: int = 10
    imbalance_ratio: float = 1.05
    min_lateness_s: float = 1e-4


class StragglerDetector:
    """The default detector; Run takes any object with `detect(store) -> list[Finding]`."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.cfg = config or StragglerConfig()

    def detect(self, store: Store) -> list[Finding]:
        cfg = self.cfg
        cand = store.query(load_sql("peer_scores"), {"min_ratio": cfg.min_ratio, "min_gap_s": cfg.min_gap_s})
        findings = self._slow_compute(store, cand) + self._late_launch(store, cand)
        findings = merge_hosts(findings, store.topology)
        return findings + self._imbalance(store)

    def _slow_compute(self, store: Store, cand: pd.DataFrame) -> list[Finding]:
        cfg = self.cfg
        slow = cand[(cand.work_ratio >= cfg.min_ratio) & (cand.work_z >= cfg.min_z)]
        out = []
        for rank, rows in slow.groupby("rank"):
            found = persistent_runs(rows.step, cfg.persist_steps, max_gap=2)
            if not found:
                continue
            first, last = found[0][0], found[-1][1]
            in_run = rows[(rows.step >= first) & (rows.step <= last)]
            ratio = float(in_run.work_ratio.median())
            host = hosts_of(store.topology, [int(rank)])
            out.append(Finding(
                kind="straggler", ranks=[int(rank)], hosts=host, steps=(int(first), int(last)), severity=ratio,
                summary=(f"Rank {rank} on {host[0] if host else '?'} computes {100 * (ratio - 1):.0f}% slower than "
                         f"the ranks of its pipeline stage since step {first}; check that GPU (clocks, "
                         f"thermals, ECC) or drain the host."),
                evidence={"cause": "slow_compute", "stage": int(rows.pp.iloc[0]),
                          "compute_ratio_vs_stage": round(ratio, 4),
                          "compute_ratio_vs_tp_group": round(float(in_run.tp_ratio.median()), 4),
                          "robust_z": round(float(in_run.work_z.median()), 2),
                          "flagged_steps": int(len(in_run)), "episodes": [list(r[:2]) for r in found]}))
        return out

    def _late_launch(self, store: Store, cand: pd.DataFrame) -> list[Finding]:
        cfg = self.cfg
        late = cand[(cand.gap_excess_s >= cfg.min_gap_s) & (cand.gap_z >= cfg.min_gap_z)
                    & (cand.work_ratio < cfg.min_ratio)]
        out = []
        for rank, rows in late.groupby("rank"):
            groups = [r for r in runs(rows.step, max_gap=cfg.late_max_period) if r[2] >= cfg.late_min_count]
            if not groups:
                continue
            first, last = groups[0][0], groups[-1][1]
            sel = rows[(rows.step >= first) & (rows.step <= last)]
            excess_ms = 1e3 * float(sel.gap_excess_s.median())
            host = hosts_of(store.topology, [int(rank)])
            steps = sorted(int(s) for s in sel.step)
            period = int(pd.Series(steps).diff().median()) if len(steps) > 1 else 1
            out.append(Finding(
                kind="late_launch", ranks=[int(rank)], hosts=host, steps=(int(first), int(last)),
                severity=float(1 + (sel.gap_excess_s / sel.work_s).median()),
                summary=(f"Rank {rank} on {host[0] if host else '?'} issues its collectives ~{excess_ms:.1f} ms late "
                         f"{'every step' if period <= 1 else f'every {period} steps'} while its compute is "
                         f"normal; look for host-side pauses there (garbage collection, CPU contention)."),
                evidence={"cause": "late_launch", "stage": int(rows.pp.iloc[0]), "excess_ms": round(excess_ms, 3),
                          "flagged_steps": len(steps), "period_steps": period}))
        return out

    def _imbalance(self, store: Store) -> list[Finding]:
        cfg = self.cfg
        bal = store.query(load_sql("stage_balance"))
        slow = bal[bal.ratio >= cfg.imbalance_ratio]
        out = []
        for stage, rows in slow.groupby("pp"):
            found = persistent_runs(rows.step, cfg.persist_steps, max_gap=2)
            if not found:
                continue
            first, last = found[0][0], found[-1][1]
            ratio = float(rows[(rows.step >= first) & (rows.step <= last)].ratio.median())
            ranks = store.topology.loc[store.topology.pp == stage, "rank"].astype(int).tolist()
            out.append(Finding(
                kind="stage_imbalance", ranks=ranks, hosts=hosts_of(store.topology, ranks),
                steps=(int(first), int(last)), severity=ratio,
                summary=(f"Pipeline stage {stage} takes {100 * (ratio - 1):.0f}% longer than the other stages "
                         f"since step {first} (all its ranks alike: a partition imbalance, not a bad rank); "
                         f"move layers off stage {stage} or rebalance the split."),
                evidence={"cause": "stage_imbalance", "stage": int(stage), "ratio_vs_other_stages": round(ratio, 4),
                          "stage_compute_s": round(float(rows.stage_work_s.median()), 6)}))
        return out


def merge_hosts(findings: list[Finding], topology: pd.DataFrame) -> list[Finding]:
    """When every rank of a host is flagged with the same kind, report the host once."""
    by_host = topology.groupby("host")["rank"].apply(lambda s: set(int(r) for r in s)).to_dict()
    out: list[Finding] = []
    for kind in dict.fromkeys(f.kind for f in findings):
        same = [f for f in findings if f.kind == kind]
        flagged = {f.ranks[0]: f for f in same if len(f.ranks) == 1}
        used: set[int] = set()
        for host, ranks in by_host.items():
            if len(ranks) > 1 and ranks <= flagged.keys():
                parts = [flagged[r] for r in sorted(ranks)]
                first = min(p.steps[0] for p in parts)
                last = max(p.steps[1] for p in parts)
                sev = float(pd.Series([p.severity for p in parts]).median())
                out.append(Finding(
                    kind=kind, ranks=sorted(ranks), hosts=[host], steps=(first, last), severity=sev,
                    summary=(f"All {len(ranks)} ranks of host {host} ({rank_list(sorted(ranks))}) are "
                             f"{100 * (sev - 1):.0f}% slower than their peers since step {first}; "
                             f"drain or inspect host {host} (cooling, power capping, PCIe)."),
                    evidence={"cause": parts[0].evidence.get("cause"), "host_wide": True,
                              "per_rank": {str(p.ranks[0]): round(p.severity, 4) for p in parts}}))
                used |= ranks
        out += [f for f in same if not (len(f.ranks) == 1 and f.ranks[0] in used)]
    return out


def arrival_evidence(store: Store, finding: Finding, min_lateness_s: float) -> dict:
    """How often the finding's ranks arrived last at collectives during its steps (culprit signature)."""
    if not finding.ranks or len(finding.ranks) > 64:
        return {}
    table = store.query(load_sql("arrivals"), {"min_lateness_s": min_lateness_s})
    sel = table[table["rank"].isin(finding.ranks) & table.step.between(*finding.steps)]
    return {"collectives_arrived_last": int(sel.late_count.sum()),
            "lateness_ms_per_step": round(1e3 * float(sel.lateness_s.sum()) / max(1, sel.step.nunique()), 3)}
