"""Network flaps and slow links, per p2p link (rank pair) and per collective group instance.

The series judged is the effective transfer time with peer waiting removed (p2p: the per-step floor
of min(send, recv) durations; collectives: end - last arrival), against the links/groups of the same
kind at the same step. A step is degraded when that ratio >= `flag_ratio`. A link degraded on most
steps is steadily slow (`slow_link`); one that collapses and recovers in episodes flaps
(`network_flap`, with the episodes and their count).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from megascope.analyzer.episodes import runs
from megascope.analyzer.findings import Finding, hosts_of, rank_list
from megascope.analyzer.store import Store, load_sql


@dataclass
class FlapConfig:
    flag_ratio: float = 1.3
    min_extra_s: float = 1e-4       # ignore degradations smaller than this (timer resolution, noise)
    steady_fraction: float = 0.8    # degraded on this share of steps: steadily slow, not flapping
    min_episodes: int = 2


class FlapDetector:
    def __init__(self, config: FlapConfig | None = None) -> None:
        self.cfg = config or FlapConfig()

    def detect(self, store: Store) -> list[Finding]:
        n_steps = int(store.query("SELECT count(DISTINCT step) AS n FROM rank_step").n.iloc[0])
        bounds = store.query("SELECT step, min(start_ns) AS start_ns, max(end_ns) AS end_ns FROM rank_step GROUP BY step")
        bounds = bounds.set_index("step")
        return self._p2p(store, n_steps, bounds) + self._collectives(store, n_steps, bounds)

    def _degraded(self, sql: str, value: str, store: Store) -> pd.DataFrame:
        c = self.cfg
        return store.query(f"SELECT * FROM ({sql.rstrip().rstrip(';')}) WHERE ratio >= {c.flag_ratio} "
                           f"AND {value} - baseline_s >= {c.min_extra_s}")

    def _p2p(self, store: Store, n_steps: int, bounds: pd.DataFrame) -> list[Finding]:
        store.execute(load_sql("p2p_links"))
        bad = self._degraded(load_sql("p2p_series"), "floor_s", store)
        if bad.empty:
            return []
        bad["a"] = bad[["src", "dst"]].min(axis=1)
        bad["b"] = bad[["src", "dst"]].max(axis=1)
        out = []
        for (a, b), rows in bad.groupby(["a", "b"]):
            per_step = rows.groupby("step").agg(ratio=("ratio", "max"), value=("floor_s", "max"),
                                                baseline=("baseline_s", "median"))
            f = self._classify([int(a), int(b)], per_step, n_steps, bounds, store, what=f"link {a}<->{b}")
            if f:
                out.append(f)
        return out

    def _collectives(self, store: Store, n_steps: int, bounds: pd.DataFrame) -> list[Finding]:
        bad = self._degraded(load_sql("collective_series"), "effective_s", store)
        if bad.empty:
            return []
        out = []
        for (group, instance), rows in bad.groupby(["group", "instance"]):
            per_step = rows.groupby("step").agg(ratio=("ratio", "max"), value=("effective_s", "max"),
                                                baseline=("baseline_s", "median"))
            members = group_members(store, str(group), int(instance))
            f = self._classify(members, per_step, n_steps, bounds, store,
                               what=f"{group} group of ranks {rank_list(members)}", group=str(group))
            if f:
                out.append(f)
        return out

    def _classify(self, ranks: list[int], per_step: pd.DataFrame, n_steps: int, bounds: pd.DataFrame,
                  store: Store, what: str, group: str = "pp") -> Finding | None:
        c = self.cfg
        episodes = runs(per_step.index, max_gap=1)
        degraded = len(per_step)
        ratio = float(per_step.ratio.median())
        extra_ms = 1e3 * float((per_step.value - per_step.baseline).median())
        hosts = hosts_of(store.topology, ranks)
        where = " and ".join(hosts[:2]) + ("" if len(hosts) <= 2 else f" (+{len(hosts) - 2} hosts)")
        evidence = {"group": group, "degraded_steps": degraded, "steps_observed": n_steps,
                    "ratio_vs_peers": round(ratio, 3), "extra_ms": round(extra_ms, 3)}
        first, last = int(per_step.index.min()), int(per_step.index.max())
        if degraded >= c.steady_fraction * n_steps:
            return Finding("slow_link", ranks, hosts, (first, last), ratio,
                           f"The {what} ({where}) is steadily {ratio:.1f}x slower than its peers on "
                           f"{degraded}/{n_steps} steps; check that link's cabling, NIC and switch port.",
                           evidence | {"cause": "slow_comm"})
        last_step = int(bounds.index.max())
        one_recovered = len(episodes) == 1 and episodes[0][2] >= 2 and episodes[0][1] < last_step
        if len(episodes) < c.min_episodes and not one_recovered:
            return None
        evidence["episodes"] = [
            {"first_step": e[0], "last_step": e[1], "start_ns": int(bounds.start_ns.get(e[0], 0)),
             "end_ns": int(bounds.end_ns.get(e[1], 0)),
             "ratio": round(float(per_step.loc[e[0]:e[1]].ratio.max()), 3)} for e in episodes]
        evidence["episode_count"] = len(episodes)
        evidence["cause"] = "flapping_comm"
        return Finding("network_flap", ranks, hosts, (first, last), ratio,
                       f"The {what} ({where}) flapped {len(episodes)} times between steps {first} and {last} "
                       f"(+{extra_ms:.1f} ms per transfer while down); check that link's NIC, cable "
                       f"and switch port logs for link up/down events.", evidence)


def group_members(store: Store, group: str, instance: int) -> list[int]:
    """Global ranks of one collective group instance (the inverse of collectives.sql's instance key)."""
    topo, man = store.topology, store.manifest["topology"]
    dp, tp = int(man["dp"]), int(man["tp"])
    if group == "dp":
        sel = (topo.pp == instance // tp) & (topo.tp == instance % tp)
    elif group == "tp":
        sel = (topo.pp == instance // dp) & (topo.dp == instance % dp)
    elif group == "pp":
        sel = (topo.dp == instance // tp) & (topo.tp == instance % tp)
    else:
        sel = topo["rank"] >= 0
    return topo.loc[sel, "rank"].astype(int).tolist()
