"""Network flaps and slow links, per p2p link (rank pair) and per collective group instance.

Three series, each against the links/groups of the same kind at the same step:
- p2p transfer time with peer waiting removed (the per-step floor of min(send, recv) durations), on
  traces whose p2p spans end when the transfer does (GPU, simulated, imported); on CPU (gloo) traces
  a p2p span ends at its host's wait(), so this series is skipped there;
- collective transfer time (end - last arrival), also skipped on CPU (gloo) traces, where an async
  collective's end is when the tracer observed its completion;
- p2p stalls: host time both ends of a link lost right before issuing their transfers to each other
  (a NIC or driver that blocks the issue: the transfer itself then looks normal, but both ends stall
  in the same steps; one end alone stalling is that rank's late launch, not the link).
A step is degraded when the ratio >= `flag_ratio` and beyond the run's noise (`z_flag` x the
step-to-step noise of the log ratio, median over links), and the extra time is real (`min_extra_s`;
stalls: `min_stall_frac` of the step). A link degraded on most steps is steadily slow (`slow_link`);
one that collapses and recovers in episodes flaps (`network_flap`, with the episodes and their count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.episodes import runs
from megascope.analyzer.event_pass import has_wait_spans
from megascope.analyzer.findings import Finding, hosts_of, rank_list
from megascope.analyzer.layout import group_members as layout_members
from megascope.analyzer.peer_stats import noise_sigma, warmup_steps
from megascope.analyzer.store import Store, load_sql


@dataclass
class FlapConfig:
    flag_ratio: float = 1.3
    min_extra_s: float = 1e-4       # ignore degradations smaller than this (timer resolution, noise)
    steady_fraction: float = 0.8    # degraded on this share of steps: steadily slow, not flapping
    min_episodes: int = 2
    min_episode_steps: int = 2
    z_flag: float = 4.0             # degraded beyond this many noise sigmas of the log ratio
    min_stall_frac: float = 0.1     # p2p stalls: extra host time >= this share of the step


class FlapDetector:
    def __init__(self, config: FlapConfig | None = None) -> None:
        self.cfg = config or FlapConfig()

    def detect(self, store: Store) -> list[Finding]:
        bounds = store.query("SELECT step, min(start_ns) AS start_ns, max(end_ns) AS end_ns, "
                             "median(step_time_s) AS step_time_s FROM rank_step GROUP BY step")
        warm = set(warmup_steps(bounds, 2.0)) if len(bounds) else set()
        bounds = bounds[~bounds.step.isin(warm)].set_index("step")
        n_steps = len(bounds)
        if n_steps == 0:
            return []
        out = self._p2p(store, n_steps, bounds, warm) + self._stalls(store, n_steps, bounds, warm)
        return _dedupe_links(out) + self._collectives(store, n_steps, bounds, warm)

    def _degraded(self, series: pd.DataFrame, key: list[str], value: str, warm: set[int]) -> pd.DataFrame:
        """Rows of a (key, step, value, baseline_s, ratio) series that are degraded beyond the noise."""
        c = self.cfg
        series = series[~series.step.isin(warm)].copy()
        if series.empty:
            return series
        with np.errstate(divide="ignore", invalid="ignore"):
            series["lr"] = np.log(series.ratio.astype(float))
        sigma = noise_sigma(series[np.isfinite(series.lr)], "lr", key=key)
        threshold = max(np.log(c.flag_ratio), c.z_flag * sigma)
        return series[(series.lr >= threshold) & (series[value] - series.baseline_s >= c.min_extra_s)]

    def _p2p(self, store: Store, n_steps: int, bounds: pd.DataFrame, warm: set[int]) -> list[Finding]:
        if has_wait_spans(store):
            # CPU (gloo) traces: a p2p span ends when its host called wait(), so its floor measures the
            # hosts' scheduling, not the link (8 ranks on 2 cores gave false 2-step "flaps" of +1 ms);
            # there a link shows as both ends stalled before their transfers (_stalls)
            return []
        store.execute(load_sql("p2p_links"))
        bad = self._degraded(store.query(load_sql("p2p_series")), ["src", "dst"], "floor_s", warm)
        return self._links(store, bad, "floor_s", n_steps, bounds, "transfer")

    def _stalls(self, store: Store, n_steps: int, bounds: pd.DataFrame, warm: set[int]) -> list[Finding]:
        c = self.cfg
        st = store.query(load_sql("p2p_stalls"))
        st = st[~st.step.isin(warm)]
        if st.empty:
            return []
        step_time = bounds.step_time_s.reindex(st.step).to_numpy()
        bad = st[(st.stall_s - st.baseline_s >= c.min_stall_frac * step_time) &
                 (st.stall_s >= c.flag_ratio * st.baseline_s)]
        return self._links(store, bad.rename(columns={"a": "src", "b": "dst"}), "stall_s", n_steps, bounds, "stall")

    def _links(self, store: Store, bad: pd.DataFrame, value: str, n_steps: int, bounds: pd.DataFrame,
               how: str) -> list[Finding]:
        if bad.empty:
            return []
        bad = bad.assign(a=bad[["src", "dst"]].min(axis=1), b=bad[["src", "dst"]].max(axis=1))
        out = []
        for (a, b), rows in bad.groupby(["a", "b"]):
            per_step = rows.groupby("step").agg(ratio=("ratio", "max"), value=(value, "max"),
                                                baseline=("baseline_s", "median"))
            f = self._classify([int(a), int(b)], per_step, n_steps, bounds, store, what=f"link {a}<->{b}")
            if f:
                f.evidence["signal"] = how
                out.append(f)
        return out

    def _collectives(self, store: Store, n_steps: int, bounds: pd.DataFrame, warm: set[int]) -> list[Finding]:
        if has_wait_spans(store):
            # CPU (gloo) traces: an async collective's end is when the tracer saw it complete (the next
            # tracer event or sweep, up to ms later), so end - last arrival is not the group's transfer
            # time (a clean real run gave a false dp-group "flap" of +0.9 ms)
            return []
        bad = self._degraded(store.query(load_sql("collective_series")), ["group", "instance", "name"],
                             "effective_s", warm)
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
        # an episode is >= min_episode_steps long: a single degraded step is a hiccup, not a flap
        episodes = [e for e in runs(per_step.index, max_gap=1) if e[2] >= c.min_episode_steps]
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
        # a p2p link may flap once and recover; a collective group's end times also hold its members'
        # late waits on async ops, so one episode there is not evidence enough
        one_recovered = len(episodes) == 1 and episodes[0][2] >= 2 and episodes[0][1] < last_step and group == "pp"
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
    """Global ranks of one collective group instance (the inverse of layout.instance_sql)."""
    man = store.manifest["topology"]
    return layout_members(store.topology, int(man["dp"]), int(man["tp"]), int(man["pp"]), group, instance)


def _dedupe_links(findings: list[Finding]) -> list[Finding]:
    """One finding per link: a stall and a transfer finding on the same pair are the same problem."""
    best: dict[tuple[int, ...], Finding] = {}
    for f in findings:
        key = tuple(sorted(f.ranks))
        if key not in best or f.severity > best[key].severity:
            best[key] = f
    return list(best.values())
