"""Blame follows the lost time (issue 31): each step's lost time (its step time above the run's own
healthy level) is attributed to the rank whose own time grew while its peers waited, or, when no rank's
own time explains it, to the network between the hosts whose transfer waits grew; a culprit is where the
attributed loss accumulates, and its finding says what it cost (seconds, share of the run's lost time,
GPU-hours: the seconds times the job's ranks, since every rank waits for a culprit in a synchronous step).
Whether a culprit is named is decided by its evidence (persistence, significance against its own history
and its peers), how much it cost only ranks it (DESIGN.md section 7).

- rank: its own time (every moment of its step it was not waiting for others: compute, data, host
  time inside and outside spans) above its stage peers' at the same step, beyond the level it keeps
  outside the stretch (its own history). The stretch is the one with the largest summed excess (means,
  not medians: a rank stopped from outside for 30 ms in every 100 ms slows a few ops a lot, a heavy
  tail, not a shift); it must be long, its mean excess significant (Welch's t against the rest of the
  run) and material against the step time, the rank's own time must have grown against its own
  history, not only its peers' shrunk, and the job's step time with it (a stretch the job ran faster
  in lost no time). Its cost is the what-if by its own history: the stretch's whole
  loss (shared with culprits active at the same steps, by their excess).
- network: steps whose loss no rank explains while the waits of ranks with a peer on another host
  grew (p2p receives for pipeline links, collectives for data-parallel groups) at least as much as
  their own time, in episodes of consecutive steps; one finding for the host pair naming its links,
  with its episodes and cost. A single-host run has no network to blame.

Steps are positions, not numbers: sampled traces (every Nth step), gaps and restarts count the steps
that exist. `settle` (settle.py) applies the attribution to every detector's findings (Run.findings): another
detector's straggler / late_launch on a rank charged (next to) nothing over its steps is a victim's
and goes, one whose excess over its steps is not persistent and significant goes, the rest get their
cost, however small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.episodes import runs
from megascope.analyzer.detect.peer_stats import drop_warmup, fetch_grid
from megascope.analyzer.detect.stragglers import DATA_WORK_SHARE
from megascope.analyzer.detect.stretch_search import stretches
from megascope.analyzer.findings import Finding, Kind, cost_text, gpu_hours, hosts_of
from megascope.analyzer.settings import LostTimeConfig

EXPRESSIONS = {"own_s": "greatest(step_time_s - recv_s - collective_s, 0)", "work_s": "forward_s + backward_s"}
"""own_s here: every moment of the rank's step it was not waiting for others (compute, data, host time
inside spans and outside any span: an attached job's untraced host time belongs to its rank too)."""
MATRICES = ("own_s", "work_s", "recv_s", "collective_s", "step_time_s")


def _matrices(store: Store, warmup_factor: float) -> tuple[dict[str, pd.DataFrame] | None, pd.DataFrame]:
    """Rank x step matrices (ranks and steps ascending, NaN where a rank has no row) of MATRICES over
    the steps after the warm-up, and each rank's place (pp, dp, tp, host); (None, empty) with fewer than
    two ranks. Placed straight from Arrow results a few hundred ranks at a time (peer_stats.fetch_grid):
    the 12.3 M rank-steps as one pandas frame, filtered, then placed by np.unique's inverse took 1.3 CPU s
    at 3,072 ranks x 1,000 steps and held the detector's peak (3.3 GB at 12,288 ranks); the frames wrap
    the matrices, no copies."""
    grid = fetch_grid(store, MATRICES, expressions=EXPRESSIONS)
    if grid is None or len(grid.ranks) < 2:
        return None, pd.DataFrame()
    grid, warm = drop_warmup(grid, warmup_factor)
    if grid is None:
        return None, pd.DataFrame()
    ranks, steps = pd.Index(grid.ranks, name="rank"), pd.Index(grid.steps, name="step")
    m = {c: pd.DataFrame(grid.values.pop(c), index=ranks, columns=steps, copy=False) for c in MATRICES}
    # each rank's place as its first analyzed row says (the same on every row of a rank)
    # (the warm-up is a prefix of the steps)
    topo = store.query("SELECT rank, arg_min(pp, step) AS pp, arg_min(dp, step) AS dp, arg_min(tp, step) AS tp, "
                       "arg_min(host, step) AS host FROM rank_step WHERE step_time_s > 0 AND step > $after "
                       "GROUP BY rank ORDER BY rank", {"after": max(warm) if warm else -(1 << 62)}).set_index("rank")
    return m, topo


@dataclass
class Attribution:
    """Per step (columns: positions of `steps`) the lost time and what it is charged to."""
    steps: np.ndarray
    lost: np.ndarray
    """seconds per step above the healthy level (>= 0)"""
    step_s: np.ndarray | None = None
    """the job's step time per step (the ranks' median), which settle measures other detectors' culprits'
    steps against their own history with (None: lost + baseline_s)"""
    run_s: float = 0.0
    """the analyzed steps' summed step time"""
    charged: dict[int, np.ndarray] = field(default_factory=dict)
    """rank -> seconds per step charged to its own excess (the culprits found)"""
    excess: dict[int, np.ndarray] = field(default_factory=dict)
    """rank -> its own time minus its stage peers' median, per step (every rank with peers)"""
    network: np.ndarray | None = None
    """seconds per step charged to the network between hosts (its episodes' steps)"""
    baseline_s: float = 0.0
    cfg: LostTimeConfig = field(default_factory=LostTimeConfig)
    """the thresholds it was made with, which settle applies"""
    world: int = 0
    """the job's ranks (run.json's world; the traced ranks when it has none): all of them wait for a
    culprit in a synchronous step, so its cost in GPU time is its cost in seconds times this"""

    def cost_evidence(self, cost_s: float, lost_s: float) -> dict[str, float]:
        """A culprit's cost as every finding states it (DESIGN.md section 7): `cost_s` (seconds of the
        job's lost time charged to it), `lost_share` (its share of `lost_s`, the run's lost time) and
        `gpu_hours` (cost_s x the job's ranks / 3600: every rank waited those seconds)."""
        return {"cost_s": round(cost_s, 3), "lost_share": round(cost_s / lost_s, 3) if lost_s > 0 else 0.0,
                "gpu_hours": gpu_hours(cost_s, self.world)}


class LostTimeDetector:
    def __init__(self, config: LostTimeConfig | None = None) -> None:
        self.cfg = config or LostTimeConfig()

    def detect(self, ctx: DetectContext) -> list[Finding]:
        """Its findings; the attribution (with this detector's thresholds) goes to ctx.attribution, which
        settle applies to the other detectors' findings."""
        store = ctx.store
        m, topo = _matrices(store, ctx.warmup_factor)
        if m is None:
            return []
        steps = m["own_s"].columns.to_numpy()
        if len(steps) < self.cfg.min_steps + self.cfg.min_history:
            return []
        step_time = m["step_time_s"].median(axis=0).to_numpy()
        excess = _excess(m["own_s"], topo)
        # The network's episodes first, each step's loss explained by the ranks' excess over their own
        # level or not: a step the network explains is no evidence against a rank (measured: tbf-pp at
        # load ~12 gave stage 1's rank 3 a t >= 6 stretch over the episodes, which then took their loss).
        episodes = self._network_episodes(m, topo, step_time, excess)
        net = np.zeros(len(steps), bool)
        for a, b in episodes:
            net[a:b + 1] = True
        findings, att = self._ranks(store, m, topo, steps, step_time, excess, net)
        ctx.attribution = att
        return findings + self._network(store, m, topo, att, episodes)

    # ---- ranks ----------------------------------------------------------------------------------
    def _ranks(self, store: Store, m: dict[str, pd.DataFrame], topo: pd.DataFrame, steps: np.ndarray,
               step_time: np.ndarray, excess: dict[int, np.ndarray], net: np.ndarray
               ) -> tuple[list[Finding], Attribution]:
        own = m["own_s"]
        found: list[tuple[int, int, int, np.ndarray, dict]] = []
        for rank in self._candidates(excess, own, net):
            d = excess[rank]
            hit = self._stretch(np.where(net, np.nan, d), own.loc[rank].to_numpy(), step_time)
            if hit is not None:
                a, b, ev = hit
                found.append((int(rank), a, b, d, ev))
        work = _PeerExcess(m["work_s"], topo)
        found = [f for f in found if not self._replica_work(topo, excess, work, *f[:3])]
        inside = net.copy()
        for _, a, b, _, _ in found:
            inside[a:b + 1] = True
        healthy = step_time[~inside] if (~inside).sum() >= self.cfg.min_history else step_time
        base = float(np.median(healthy))
        att = Attribution(steps, np.clip(step_time - base, 0, None), step_time, float(np.nansum(step_time)),
                          baseline_s=base, excess=excess, cfg=self.cfg, world=_world(store, topo))
        # What-if by the culprit's own history: had it kept its level from outside its stretch, the
        # stretch's steps would have been at the healthy level, so their whole loss is its cost; culprits
        # active at the same step share it by their excess over their own level (a small floor keeps a
        # culprit whose excess fell into a wait on that step in the split).
        weight = {}
        for rank, a, b, d, ev in found:
            w = np.zeros(len(steps))
            w[a:b + 1] = np.clip(np.nan_to_num(d[a:b + 1]) - ev["level_out_s"], 1e-6, None)
            weight[rank] = w
        total_w = sum(weight.values()) if weight else np.zeros(len(steps))
        for rank, w in weight.items():
            share = np.where(total_w > 0, att.lost * w / np.where(total_w > 0, total_w, 1), 0.0)
            att.charged[rank] = np.where(net, np.minimum(w * (w > 1e-6), att.lost), share)
        # Whether a culprit is named is its evidence's (the stretch's tests above), never its cost's; a
        # rank charged ~nothing of its stretch's loss is a victim (held-out ddp-stop-r0: the stopped rank's
        # peer had a stretch too, charged 0.0 s where the stopped rank took the shared steps' loss).
        out = [self._rank_finding(store, work, att, rank, a, b, d, ev) for rank, a, b, d, ev in found
               if float(att.charged[rank][a:b + 1].sum()) >= self.cfg.victim_share * float(att.lost[a:b + 1].sum())]
        return out, att

    def _replica_work(self, topo: pd.DataFrame, excess: dict[int, np.ndarray], work: _PeerExcess, rank: int,
                      a: int, b: int) -> bool:
        """The stretch's excess is its replica's work (longer sequences, more tokens), not the rank's, when
        the rank's compute carries a material part of it (stragglers.DATA_WORK_SHARE) and the replica's
        other stages' compute grew >= replica_share as much at the same steps (stragglers.py's rule).
        Their compute, not their own time: in a trace without p2p rows the other stages' waits on a slow
        rank are host gaps, and their own time grew with its (a 1.5x straggler from step 40 of a dp4 x
        pp4 generated trace was taken for data; no lost time was then found and settle dropped the
        straggler the other detector had named as a trifle)."""
        mates = [int(r) for r in topo.index[(topo.dp == topo.dp[rank]) & (topo.pp != topo.pp[rank])] if r in excess]
        if not mates:
            return False
        mask = np.zeros(len(excess[rank]), bool)
        mask[a:b + 1] = True

        def shift(d: np.ndarray) -> float:
            return float(np.nanmean(d[mask]) - np.nanmean(d[~mask]))

        mine = shift(work(rank))
        if mine < DATA_WORK_SHARE * shift(excess[rank]):
            return False
        return float(np.median([shift(work(r)) for r in mates])) >= self.cfg.replica_share * mine

    def _candidates(self, excess: dict[int, np.ndarray], own: pd.DataFrame, net: np.ndarray) -> list[int]:
        """The ranks whose stretch (_stretch) may pass its t and own-growth tests, judged for all ranks
        at once; _stretch then decides each exactly. Kadane's recurrence runs over the steps for every
        rank together (the same operations, so the same stretch); the means and variances differ from
        _stretch's only in rounding, so the screen lets through anything within a 1e-6 relative margin
        (12,288 ranks one by one: ~15 s at 100 steps)."""
        if not excess:
            return []
        ranks = np.fromiter(excess, int, len(excess))
        d = np.where(net, np.nan, np.stack(list(excess.values())))
        ok = ~np.isnan(d)
        keep = ok.sum(axis=1) >= self.cfg.min_steps + self.cfg.min_history
        ranks, d, ok = ranks[keep], d[keep], ok[keep]
        if not len(ranks):
            return []
        x = np.where(ok, d, _row_nanmedian(d)[:, None])
        a, b = stretches(x, self.cfg.min_steps, self.cfg.min_history)
        x = x - np.median(x, axis=1)[:, None]
        n = x.shape[1]
        col = np.arange(n)[None, :]
        inside = (col >= a[:, None]) & (col <= b[:, None])
        n_in = (b - a + 1).astype(float)
        n_out = n - n_in
        sized = (n_in >= self.cfg.min_steps) & (n_out >= self.cfg.min_history)
        n_in, n_out = np.maximum(n_in, 2), np.maximum(n_out, 2)
        m_in = np.where(inside, x, 0).sum(axis=1) / n_in
        m_out = np.where(inside, 0, x).sum(axis=1) / n_out
        v_in = np.where(inside, (x - m_in[:, None]) ** 2, 0).sum(axis=1) / (n_in - 1)
        v_out = np.where(inside, 0, (x - m_out[:, None]) ** 2).sum(axis=1) / (n_out - 1)
        exc = m_in - m_out
        se = np.sqrt(v_in / n_in + v_out / n_out)
        o = own.loc[ranks].to_numpy()
        o_ok = ~np.isnan(o)
        oz = np.where(o_ok, o, 0)
        c_in, c_out = (o_ok & inside).sum(axis=1), (o_ok & ~inside).sum(axis=1)
        growth = (oz * inside).sum(axis=1) / np.maximum(c_in, 1) - (oz * ~inside).sum(axis=1) / np.maximum(c_out, 1)
        slack = 1e-6 * (np.abs(exc) + se + np.abs(growth)) + 1e-12
        t_ok = exc + slack >= self.cfg.t_min * se
        # no own time on one side: _stretch's growth is NaN, which its test lets pass
        g_ok = (growth + slack >= self.cfg.min_own_growth * exc) | (c_in == 0) | (c_out == 0)
        return [int(r) for r in ranks[sized & t_ok & g_ok]]

    def _stretch(self, d: np.ndarray, own: np.ndarray, step_time: np.ndarray) -> tuple[int, int, dict] | None:
        """The stretch [a, b] (positions) with the largest summed excess of d over its typical level,
        when significant; with its evidence."""
        self.last_stretch: dict = {}
        ok = ~np.isnan(d)
        if ok.sum() < self.cfg.min_steps + self.cfg.min_history:
            return None
        x = np.where(ok, d, np.nanmedian(d))
        a, b = (int(v[0]) for v in stretches(x[None, :], self.cfg.min_steps, self.cfg.min_history))
        n_in, n_out = b - a + 1, len(x) - (b - a + 1)
        if n_in < self.cfg.min_steps or n_out < self.cfg.min_history:
            return None
        mask = np.zeros(len(x), bool)
        mask[a:b + 1] = True
        xin, xout = x[mask], x[~mask]
        excess = float(xin.mean() - xout.mean())
        se = float(np.sqrt(xin.var(ddof=1) / n_in + xout.var(ddof=1) / n_out)) or 1e-12
        oin, oout = own[mask], own[~mask]
        healthy_step = float(np.median(step_time[~mask]))
        growth = float(np.nanmean(oin) - np.nanmean(oout))
        # the job's steps over the stretch against the rest (the network's steps and the rank's missing
        # ones left out, as in d): blame follows the lost time, and a stretch the job ran faster in lost none
        step_growth = float(np.nanmean(step_time[mask & ok]) - np.nanmean(step_time[~mask & ok]))
        ev = {"excess_ms": round(1e3 * excess, 2), "t": round(excess / se, 1), "level_out_s": float(xout.mean()),
              "own_growth_ms": round(1e3 * growth, 2), "step_growth_ms": round(1e3 * step_growth, 2)}
        self.last_stretch = ev
        if excess / se < self.cfg.t_min or growth < self.cfg.min_own_growth * excess:
            return None
        if min(excess, step_growth) < self.cfg.min_excess * healthy_step:
            return None
        return a, b, ev

    def _rank_finding(self, store: Store, work: _PeerExcess, att: Attribution, rank: int, a: int, b: int,
                      d: np.ndarray, ev: dict) -> Finding:
        dw = work(rank)
        mask = np.zeros(len(dw), bool)
        mask[a:b + 1] = True
        work_excess = float(np.nanmean(dw[mask]) - np.nanmean(dw[~mask]))
        kind: Kind = "straggler" if work_excess >= 0.5 * ev["excess_ms"] / 1e3 else "late_launch"
        cost = float(att.charged[rank].sum())
        lost_in = float(att.lost[a:b + 1].sum())
        price = att.cost_evidence(cost, float(att.lost.sum()))
        first, last = int(att.steps[a]), int(att.steps[b])
        where = "computing" if kind == "straggler" else "in host time outside its compute (pauses, launches)"
        summary = (f"Rank {rank} spends {ev['excess_ms']:.1f} ms more per step than its stage peers {where} "
                   f"from step {first}; it cost {_seconds_and_share(price)}, the time its peers waited; check "
                   f"that host and process (stops, CPU quota, contention).")
        evidence = {**price, "lost_s": round(lost_in, 3),
                    "baseline_step_s": round(att.baseline_s, 5), "compute_excess_ms": round(1e3 * work_excess, 2),
                    "source": "lost_time", **{k: v for k, v in ev.items() if k != "level_out_s"}}
        severity = (att.baseline_s + ev["excess_ms"] / 1e3) / att.baseline_s if att.baseline_s > 0 else 1.0
        return Finding(kind, [rank], hosts_of(store.topology, [rank]), (first, last), severity, summary, evidence)

    # ---- network ---------------------------------------------------------------------------------
    def _network_episodes(self, m: dict[str, pd.DataFrame], topo: pd.DataFrame, step_time: np.ndarray,
                          excess: dict[int, np.ndarray]) -> list[tuple[int, int]]:
        """Positions [a, b] of the steps whose loss the network between hosts carries: no rank's excess
        over its own level explains it, and the cross-host ranks' transfer waits grew."""
        if topo.host.nunique() < 2:
            return []
        cross_p2p, cross_coll = _cross_host(topo)
        cross = sorted({r for link in cross_p2p for r in link} | {r for g in cross_coll for r in g})
        if not cross:
            return []
        base = float(np.median(step_time))  # episodes are a minority of the steps (tbf-pp: 14 of 390)
        explained: np.ndarray | float = 0.0  # summed rank by rank, in rank order (the same bits as one by one)
        if excess:
            e = np.stack(list(excess.values()))
            for row in np.clip(np.nan_to_num(e - _row_nanmedian(e)[:, None]), 0, None):
                explained = explained + row
        unexplained = np.clip(step_time - base - explained, 0, None)
        waits = _growth(m["recv_s"], cross, m["collective_s"])
        own = _growth(m["own_s"], cross)
        # "Compute holds" is judged against peers (no rank's excess explains the step), and the cross-host
        # waits must have grown at least as much as those ranks' own time and carry >= 30% of the loss:
        # measured, a harsher 2mbit tbf under load grew the waits by 0.095-0.12 s and the ranks' own time
        # by 0.05-0.08 s alike on every rank (gloo's transport spinning on the 2 shared cores); at 8mbit
        # (tbf-pp) the waits carried ~0.43 of the 0.44 s lost and compute held.
        bad = (unexplained >= self.cfg.net_min_share * base) & (waits >= own) & (waits >= 0.3 * unexplained)
        eps = [(a, b) for a, b, n in runs(np.flatnonzero(bad).tolist(), max_gap=1)]
        # an episode is a few steps long, or one step the network stretched many times over: when a step
        # takes longer than the throttle's on-time (tbf on a dp-crossing job: 0.23 -> 1.6-2.6 s in a 2 s
        # window) or a link is cut for under a second, the episode is one step; those come and go, so
        # at least two of them
        spikes = [(a, b) for a, b in eps if b - a + 1 < self.cfg.net_min_steps
                  and unexplained[a:b + 1].max() >= self.cfg.net_spike_share * base]
        long = [(a, b) for a, b in eps if b - a + 1 >= self.cfg.net_min_steps]
        return sorted(long + (spikes if len(spikes) >= 2 else []))

    def _network(self, store: Store, m: dict[str, pd.DataFrame], topo: pd.DataFrame, att: Attribution,
                 eps: list[tuple[int, int]]) -> list[Finding]:
        if not eps:
            return []
        cross_p2p, cross_coll = _cross_host(topo)
        charged = sum(att.charged.values()) if att.charged else np.zeros(len(att.steps))
        unexplained = np.clip(att.lost - charged, 0, None)
        step_time = att.lost + att.baseline_s
        pos = np.concatenate([np.arange(a, b + 1) for a, b in eps])
        att.network = np.zeros(len(att.steps))
        att.network[pos] = unexplained[pos]
        p2p_ranks = sorted({r for link in cross_p2p for r in link})
        coll_ranks = sorted({r for g in cross_coll for r in g})
        grow_p2p, grow_coll = _growth(m["recv_s"], p2p_ranks), _growth(m["collective_s"], coll_ranks)
        via_p2p = bool(cross_p2p) and (not cross_coll or float(grow_p2p[pos].sum()) >= float(grow_coll[pos].sum()))
        links = cross_p2p if via_p2p else cross_coll
        ranks = sorted({r for link in links for r in link})
        cost = float(unexplained[pos].sum())
        total = float(att.lost.sum())
        pair = hosts_of(store.topology, ranks)
        episodes = [[int(att.steps[a]), int(att.steps[b])] for a, b in eps]
        what = "pipeline transfers (p2p receives)" if via_p2p else "data-parallel collectives"
        kind: Kind = "network_flap" if len(eps) > 1 else "slow_link"
        step_in = float(np.median(step_time[pos]))
        price = att.cost_evidence(cost, total)
        summary = (f"The network between {' and '.join(pair)} slowed in {len(eps)} episode(s) while compute held: "
                   f"the {what} crossing them waited, step time {att.baseline_s:.3f} -> {step_in:.3f} s; it cost "
                   f"{_seconds_and_share(price)}; check the NICs, cables and switch ports between those hosts.")
        evidence = {**price, "episodes": episodes, "episode_count": len(eps),
                    "links": [list(map(int, lk)) for lk in links],
                    "waits": "p2p" if via_p2p else "collective", "baseline_step_s": round(att.baseline_s, 5),
                    "episode_step_s": round(step_in, 5), "source": "lost_time"}
        return [Finding(kind, ranks, pair, (episodes[0][0], episodes[-1][1]), step_in / att.baseline_s,
                        summary, evidence)]


def _seconds_and_share(price: dict[str, float]) -> str:
    """'4.7 s (85% of the run's lost time)' for a summary (the report adds the GPU-hours beside it)."""
    return cost_text({k: price[k] for k in ("cost_s", "lost_share")})


def _world(store: Store, topo: pd.DataFrame) -> int:
    """The job's ranks: run.json's world (an import of tp rank 0 alone holds 1 in 8 of them), else the ranks
    with rows."""
    return int((store.manifest.get("topology") or {}).get("world") or len(topo))


def _excess(own: pd.DataFrame, topo: pd.DataFrame) -> dict[int, np.ndarray]:
    """Per rank with stage peers: its own time minus their median, per step (one stage at a time:
    12,288 ranks' peer medians one by one took 114 s)."""
    x = own.to_numpy()
    out = np.full_like(x, np.nan)
    has = np.zeros(len(x), bool)
    stage = topo.pp.reindex(own.index).to_numpy()
    for pp in pd.unique(stage):
        rows = np.flatnonzero(stage == pp)
        if len(rows) > 1:
            out[rows] = x[rows] - _median_of_others(x[rows])
            has[rows] = True
    return {int(r): out[i] for i, r in enumerate(own.index) if has[i]}


def _median_of_others(x: np.ndarray) -> np.ndarray:
    """[i, j]: the median of column j's values without row i's, NaNs skipped (pandas' median of the
    other rows; NaN where none is left). Exactly: one sort per column, then the middle one or two of
    what is left once row i's value (at its sorted position) is taken out, the pair's mean as (a + b) / 2."""
    n = len(x)
    if n >= 2 and not np.isnan(x).any():
        return _median_of_others_dense(x)
    order = np.argsort(x, axis=0, kind="stable")  # NaNs last
    srt = np.take_along_axis(x, order, axis=0)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(n)[:, None], order.shape), axis=0)
    nan = np.isnan(x)
    left = np.where(nan, (~nan).sum(axis=0), (~nan).sum(axis=0) - 1)  # values left per cell
    cut = np.where(nan, n, pos)  # the sorted position taken out (a NaN takes none)

    def kth(k: np.ndarray) -> np.ndarray:
        i = np.clip(np.where(k < cut, k, k + 1), 0, n - 1)
        return np.take_along_axis(srt, i, axis=0)

    lo, hi = kth((left - 1) // 2), kth(left // 2)
    med = np.where(left % 2 == 1, lo, (lo + hi) / 2)
    return np.where(left > 0, med, np.nan)


def _median_of_others_dense(x: np.ndarray) -> np.ndarray:
    """_median_of_others of a matrix without NaN (two rows or more), the same values from a partition of
    each column around its middle instead of a sort (a 1,536-rank stage's sort was most of the detector's
    peer medians). The j-th smallest of the others is the column's (j+1)-th when row i's value sorts at or
    before j, else its j-th; "sorts at or before j" is read from the value, x <= the j-th smallest, which
    differs from the position only on a tie with the (j+1)-th, where both give the same value."""
    m = len(x) - 1
    lo, hi = (m - 1) // 2, m // 2
    srt = np.partition(x, sorted({lo, lo + 1, hi, hi + 1}), axis=0)

    def remaining(j: int) -> np.ndarray:  # the j-th smallest of the others
        return np.where(x <= srt[j], srt[j + 1], srt[j])

    return remaining(lo) if lo == hi else (remaining(lo) + remaining(hi)) / 2


class _PeerExcess:
    """Per rank: its row of `m` minus its stage peers' median at each step (NaN steps skipped; NaN without
    peers), one stage's ranks at a time when first asked (_median_of_others: one sort per stage). The
    replica test asks for a culprit's mates on every other stage: their peer medians taken rank by rank
    through pandas (a ~1,500 x 1,000 copy each at 12,288 ranks) took 0.7 of the detector's 3.4 s at
    3,072 ranks."""

    def __init__(self, m: pd.DataFrame, topo: pd.DataFrame) -> None:
        self.x = m.to_numpy()
        self.row = {int(r): i for i, r in enumerate(m.index)}
        self.stage = topo.pp.reindex(m.index).to_numpy()
        self.done: dict[int, np.ndarray] = {}

    def __call__(self, rank: int) -> np.ndarray:
        i = self.row[int(rank)]
        if i not in self.done:
            rows = np.flatnonzero(self.stage == self.stage[i])
            if i not in rows:  # no stage (NaN): no peers
                rows = np.array([i])
            diff = self.x[rows] - _median_of_others(self.x[rows])
            self.done.update(zip(rows.tolist(), diff))
        return self.done[i]


def _row_nanmedian(x: np.ndarray) -> np.ndarray:
    """np.nanmedian of each row (the same values as row by row; NaN for an all-NaN row, silently)."""
    return _nanmedian(x, axis=1)


def _nanmedian(x: np.ndarray, axis: int = 1) -> np.ndarray:
    """np.nanmedian of a matrix along `axis` (the same values; NaN for an all-NaN lane, silently). The
    lanes without NaN go to np.median together: np.nanmedian makes one Python call per lane of 600
    values or more (12,288 ranks: ~0.3 s a call of it) and a masked-array sort below that. The rest
    go to np.nanmedian without the columns that are NaN in all of them (a network episode's steps)."""
    x = x if axis == 1 else x.T
    out = np.full(len(x), np.nan)
    if not x.size:
        return out
    nan = np.isnan(x)
    clean = ~nan.any(axis=1)
    if clean.all():
        return np.median(x, axis=1)
    if clean.any():
        out[clean] = np.median(x[clean], axis=1, overwrite_input=True)   # (a copy: partitioned in place)
    rest = np.flatnonzero(~clean)
    cols = np.flatnonzero(~nan[rest].all(axis=0))
    if not len(cols):
        return out
    sub = x[np.ix_(rest, cols)]
    if not np.isnan(sub).any():  # NaN only in lanes' common gaps (a rank without receives: stage 0)
        out[rest] = np.median(sub, axis=1, overwrite_input=True)
        return out
    # each lane sorted (NaN last) and its middle one or two values taken: np.median's values (the middle
    # one; the pair's mean, (a + b) / 2), all lanes at once
    srt = np.sort(sub, axis=1)
    n = (~np.isnan(sub)).sum(axis=1)
    at = np.maximum(n, 1)[:, None]  # (a lane without values is NaN whatever it picks)
    lo, hi = np.take_along_axis(srt, (at - 1) // 2, axis=1)[:, 0], np.take_along_axis(srt, at // 2, axis=1)[:, 0]
    out[rest] = np.where(n == 0, np.nan, np.where(n % 2 == 1, lo, (lo + hi) / 2))
    return out


def _growth(wait: pd.DataFrame, ranks: list[int], plus: pd.DataFrame | None = None) -> np.ndarray:
    """Per step: the median over `ranks` of the wait (`wait` + `plus`, when given) above the rank's own
    median (0 without ranks). numpy, not DataFrame medians (the same values: pandas' median is
    np.nanmedian), and only the ranks' rows added."""
    if not ranks:
        return np.zeros(wait.shape[1])
    at = wait.index.get_indexer(ranks)   # rows by position: .loc of 12,288 ranks took ~0.2 s a matrix
    if (at < 0).any():
        raise KeyError(f"ranks without rows: {[r for r, i in zip(ranks, at) if i < 0][:5]}")
    w = wait.to_numpy().take(at, axis=0)   # a copy, changed in place below
    if plus is not None:
        w += plus.to_numpy().take(at, axis=0)
    w -= _nanmedian(w)[:, None]
    return np.nan_to_num(_nanmedian(w, axis=0))


def _cross_host(topo: pd.DataFrame) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """Pipeline links (rank, next stage's rank) and data-parallel groups whose ranks are on different hosts."""
    key = topo.reset_index()
    key["at"] = np.arange(len(key))
    nxt = key.assign(pp=key.pp - 1)
    pairs = key.merge(nxt, on=["pp", "dp", "tp"], suffixes=("", "_next")).sort_values(["at", "at_next"])
    pairs = pairs[pairs.host != pairs.host_next]
    p2p = [(int(a), int(b)) for a, b in zip(pairs["rank"], pairs["rank_next"])]
    coll = []
    for _, g in key.groupby(["pp", "tp"]):
        if g.host.nunique() > 1:
            coll.append(tuple(int(x) for x in g["rank"]))
    return p2p, coll


__all__ = ["LostTimeConfig", "LostTimeDetector", "Attribution"]


def attributed_what_if(store: Store, f: Finding) -> dict | None:
    """The what-if of a finding the lost-time attribution charged (its own, or another detector's finding
    of the same rank and cause it handed its cost to: `cost_from`), None for the others: its steps
    without the cost it was charged. A replay of 1-3 sampled steps cannot stand for an episodic or
    heavy-tailed fault (tbf-pp: 3 five-step episodes in a 200-step finding; a SIGSTOP hits some steps)."""
    cost = f.evidence.get("cost_s")
    if cost is None or "lost_time" not in (f.evidence.get("source"), f.evidence.get("cost_from")):
        return None  # not charged by the attribution (itself, or handed to its twin by settle)
    row = store.query("SELECT count(*) AS n, sum(t) AS total FROM (SELECT step, median(step_time_s) AS t "
                      "FROM rank_step WHERE step BETWEEN $first AND $last AND step_time_s > 0 GROUP BY step)",
                      {"first": int(f.steps[0]), "last": int(f.steps[1])})
    n, total = int(row.n.iloc[0]), float(row.total.iloc[0] or 0.0)
    if n == 0 or total <= 0:
        return None
    saved = min(float(cost), total) / n
    return {"applicable": True, "method": "lost-time attribution over every step of the finding",
            "steps_sampled": [], "steps_counted": n, "step_time_s": round(total / n, 6),
            "what_if_step_time_s": round(total / n - saved, 6), "saved_per_step_s": round(saved, 6),
            "throughput_lost": round(saved * n / total, 4), "replayed_ranks": "all"}
