"""Findings that share one cause, reported once: every rank of a tensor/context-parallel group, or of
a host, flagged alike."""

from __future__ import annotations

import pandas as pd

from megascope.analyzer.findings import Finding, rank_list


def merge_tp_groups(findings: list[Finding], scores: pd.DataFrame) -> list[Finding]:
    """When every traced rank of a (stage, replica)'s tensor/context-parallel group is a straggler (or
    every one a late launcher), one finding of that kind on the group: they wait for their slowest member
    inside their tp/cp collectives, and a trace that does not time those collectives (NDTimeline's compute
    ops span them) cannot say which GPU it is."""
    groups = scores.groupby(["pp", "dp"])["rank"].unique()
    single = {f.ranks[0]: f for f in findings if len(f.ranks) == 1}
    used: set[int] = set()
    merged = []
    for (stage, replica), ranks in groups.items():
        ranks = sorted(int(r) for r in ranks)
        if len(ranks) < 2 or not set(ranks) <= single.keys():
            continue
        parts = [single[r] for r in ranks]
        if len({p.kind for p in parts}) != 1:
            continue  # (a late launch merged with stragglers was reported as a straggler of the group)
        worst = max(parts, key=lambda f: f.severity)
        first = min(p.steps[0] for p in parts)
        group = f"The tensor/context-parallel group of ranks {rank_list(ranks)} (stage {stage}, replica {replica})"
        if worst.kind == "late_launch":
            summary = (f"{group} issues its collectives late since step {first} while its compute is normal; its "
                       f"ranks wait for each other inside their tp/cp collectives, which this trace does not time: "
                       f"look for host-side pauses on their hosts (garbage collection, CPU contention).")
        else:
            summary = (f"{group} computes {100 * (worst.severity - 1):.0f}% slower than the other replicas of its "
                       f"stage since step {first}; one of its GPUs is slow and the others wait for it inside their "
                       f"tp/cp collectives, which this trace does not time: check each GPU's clocks, thermals and ECC.")
        merged.append(Finding(
            kind=worst.kind, ranks=ranks, hosts=list(dict.fromkeys(h for p in parts for h in p.hosts)),
            steps=(first, max(p.steps[1] for p in parts)), severity=worst.severity, summary=summary,
            evidence={**worst.evidence, "tp_group": ranks, "per_rank": {str(p.ranks[0]): round(p.severity, 4)
                                                                        for p in parts}}))
        used |= set(ranks)
    return [f for f in findings if not (len(f.ranks) == 1 and f.ranks[0] in used)] + merged


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
