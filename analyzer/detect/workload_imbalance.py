"""Workload imbalance: the data-parallel replicas get uneven work, and a different replica is the
slowest at each step (sequence lengths that vary from batch to batch: attention cost grows with the
length, so a replica that draws the long sequences computes longer while the others wait at the
gradient reduction). No rank is at fault, so the straggler detector must not blame one, and the cure
is in the data pipeline (balanced or packed batches), not the hardware.

Per step, each replica's compute is the mean over its ranks (every stage and tensor-parallel rank it
has) of log(rank's forward+backward / the median of its stage at that step); stage differences and
the job-wide step factor cancel. A step is flagged when the replicas' spread (slowest / fastest)
is >= `min_spread` both as measured and after each rank's own running level (a rolling median over
steps) is taken out: a persistent difference (a straggler, a slow host) is the straggler detector's,
only the part that changes from step to step is workload. A finding needs flagged steps on
>= `min_step_share` of the analyzed steps and no single replica slowest on more than `max_top_share`
of them.

Noise: a rank's own jitter (CPU contention, clock noise) also makes replicas differ per step, but it
is not shared by the other ranks of the replica, while a workload change is (the same micro-batches
flow through every stage and tensor-parallel rank of a replica). The within-replica disagreement
gives the noise of one rank; the spread must exceed `z_noise` times the noise of a replica mean. A
replica of one rank (pure data parallelism) gives no such reference: the detector then abstains,
as it cannot tell sequence-length imbalance from per-rank jitter at step granularity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.peer_stats import (
    PEER_GRID_COLUMNS,
    ScoreGrid,
    column_medians,
    kahan_means,
    load_grid,
    median_inplace,
    row_groups,
)
from megascope.analyzer.findings import Finding, hosts_of, rank_list
from megascope.analyzer.settings import WorkloadImbalanceConfig


class WorkloadImbalanceDetector:
    """A default detector (Run: `detect(ctx)`; diagnose.py)."""

    def __init__(self, config: WorkloadImbalanceConfig | None = None) -> None:
        self.cfg = config or WorkloadImbalanceConfig()

    def detect(self, ctx: DetectContext) -> list[Finding]:
        store = ctx.store
        grid = compute_per_rank_step(ctx)
        if grid is None or len(np.unique(grid.dp)) < 2:
            return []
        stats = replica_spread(grid, self.cfg.level_window)
        if stats is None or stats.steps.step.nunique() < self.cfg.min_steps:
            return []
        finding = self._judge(store, grid, stats)
        return [finding] if finding is not None else []

    def _judge(self, store: Store, grid: ScoreGrid, st: "SpreadStats") -> Finding | None:
        cfg = self.cfg
        if st.ranks_per_replica < 2:
            return None  # one rank per replica: per-rank jitter and workload look the same
        threshold = max(math.log(cfg.min_spread), cfg.z_noise * st.rank_sigma / math.sqrt(st.ranks_per_replica))
        steps = st.steps
        flag = (steps.spread >= threshold) & (steps.spread_own >= threshold)
        flagged = steps[flag]
        if len(flagged) < cfg.min_step_share * len(steps) or len(flagged) < 2:
            return None
        top = flagged.slowest.value_counts()
        top_share = float(top.iloc[0]) / len(flagged)
        if top_share > cfg.max_top_share or len(top) < 2:
            return None  # one replica slowest nearly always: persistent, the straggler detector's case
        ratio = math.exp(float(flagged.spread.median()))
        first, last = int(flagged.step.min()), int(flagged.step.max())
        ranks = [int(r) for r in grid.ranks]
        lost = float((flagged.lost_s / flagged.step_time_s.where(flagged.step_time_s > 0)).median())
        replicas = [int(d) for d in top.index]
        return Finding(
            kind="workload_imbalance", ranks=ranks, hosts=hosts_of(store.topology, ranks),
            steps=(first, last), severity=ratio,
            summary=(f"The data-parallel replicas' compute differs by {100 * (ratio - 1):.0f}% on "
                     f"{len(flagged)} of {len(steps)} steps and a different replica is the slowest each time "
                     f"(replicas {rank_list(replicas)} in turn): uneven work per batch, not a slow rank; "
                     f"balance sequence lengths across data-parallel replicas (length-grouped batches or "
                     f"sequence packing)."),
            evidence={"cause": "workload_imbalance", "spread_median": round(ratio, 4),
                      "spread_max": round(math.exp(float(flagged.spread.max())), 4),
                      "flagged_steps": int(len(flagged)), "analyzed_steps": int(len(steps)),
                      "slowest_replica_counts": {str(int(d)): int(n) for d, n in top.items()},
                      "top_replica_share": round(top_share, 4), "replicas": int(st.replicas),
                      "ranks_per_replica": round(st.ranks_per_replica, 2),
                      "rank_noise_sigma": round(st.rank_sigma, 4), "threshold": round(math.exp(threshold), 4),
                      "est_throughput_lost": round(lost, 4) if lost == lost else None})


def compute_per_rank_step(ctx: DetectContext) -> ScoreGrid | None:
    """work_s (own forward + backward) and step_time_s per rank and step (rank x step matrices), warm-up
    steps dropped as the straggler detector drops them (its grid's, when it ran first); None: no
    rank-step with time."""
    return ctx.take_peer_grid() or load_grid(ctx.store, PEER_GRID_COLUMNS, ctx.warmup_factor)


@dataclass
class SpreadStats:
    steps: pd.DataFrame
    """step, spread (log slowest/fastest replica), spread_own (the same after each rank's own level is
    taken out), slowest (dp of the slowest replica), lost_s (slowest replica's mean rank compute - the
    replicas' mean), step_time_s (median over ranks)."""
    rank_sigma: float
    """Noise of one rank's score: robust sd of its disagreement with its replica's mean."""
    ranks_per_replica: float
    replicas: int


def replica_spread(grid: ScoreGrid, level_window: int) -> SpreadStats | None:
    """Per step: how far apart the data-parallel replicas' compute is (see the module docstring). The
    rank-step statistics are reductions over rank x step matrices (12,288 ranks x 1,000 steps: a long
    frame's groupbys and per-rank rolling medians took ~13 s); the per-replica table is small."""
    work = grid["work_s"]
    with np.errstate(invalid="ignore"):
        ok = grid.present & (work > 0)
    if not ok.any():
        return None
    z = np.full(work.shape, np.nan)
    for rows in row_groups(grid.pp):  # log(work / its stage's median at the step), in place in the stage's copy
        w, here = work[rows], ok[rows]
        med = column_medians(w, here)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.log(np.divide(w, med, out=w), out=w)
        w[~here] = np.nan
        z[rows] = w
    z_own = _rolling_median(z, ok, level_window)
    np.subtract(z, z_own, out=z_own)
    # per (step, replica), the ranks in rank order (the order the long frame summed them in)
    replicas = row_groups(grid.dp)
    shape = (len(replicas), work.shape[1])
    y, _ = kahan_means(z, ok, replicas)
    y_own, _ = kahan_means(z_own, ok, replicas)
    mean_work, _ = kahan_means(work, ok, replicas)
    n, step_time = np.full(shape, np.nan), np.full(shape, np.nan)
    for i, rows in enumerate(replicas):
        here = ok[rows]
        n[i] = here.sum(axis=0)
        step_time[i] = column_medians(np.where(here, grid["step_time_s"][rows], np.nan), here)
    dps = np.array([grid.dp[r[0]] for r in replicas])
    d, j = np.nonzero(n > 0)
    order = np.lexsort((dps[d], grid.steps[j]))   # (step, dp) order, as a groupby gives
    d, j = d[order], j[order]
    rep = pd.DataFrame({"step": grid.steps[j], "dp": dps[d], "y": y[d, j], "y_own": y_own[d, j],
                        "n": n[d, j].astype(np.int64), "work": mean_work[d, j], "step_time": step_time[d, j]})
    # disagreement of each rank with its replica's mean (after its own level): per-rank noise; gathered
    # replica by replica (the medians below do not depend on the order), never as rank x step copies
    parts = []
    for i, rows in enumerate(replicas):
        multi = ok[rows] & (n[i] >= 2)
        n_i, y_i = np.broadcast_to(n[i], multi.shape)[multi], np.broadcast_to(y_own[i], multi.shape)[multi]
        parts.append((z_own[rows][multi] - y_i) / np.sqrt(1 - 1 / n_i))  # residual from a mean it is in
    e = np.concatenate(parts)
    del parts
    k = float(rep.n.median())
    if not len(e):
        sigma = float("nan")
    else:
        e -= median_inplace(e)
        sigma = max(1e-3, 1.4826 * float(median_inplace(np.abs(e, out=e))))
    rep = rep[rep.groupby("step").dp.transform("size") >= 2]
    if rep.empty:
        return None
    g = rep.groupby("step")
    slowest = rep.loc[g.y.idxmax(), ["step", "dp"]].set_index("step").dp
    steps = pd.DataFrame({
        "spread": g.y.max() - g.y.min(),
        "spread_own": g.y_own.max() - g.y_own.min(),
        "slowest": slowest,
        "lost_s": g.work.max() - g.work.mean(),
        "step_time_s": g.step_time.median(),
    }).reset_index()
    return SpreadStats(steps=steps, rank_sigma=sigma, ranks_per_replica=k, replicas=int(rep.dp.nunique()))


def _rolling_median(z: np.ndarray, ok: np.ndarray, window: int) -> np.ndarray:
    """Each rank's centred rolling median of z over its own steps (`window` of its rows, fewer at the
    ends: pandas' rolling(window, center=True, min_periods=1).median()); NaN where not ok."""
    out = np.full(z.shape, np.nan)
    dense = ok.all(axis=1)
    half_hi = (window - 1) // 2                           # pandas centres an even window one step early
    half_lo = window - 1 - half_hi
    n = z.shape[1]
    idx = np.flatnonzero(dense)
    for c in range(0, len(idx), 1024):                  # bounded memory: 1,024 ranks at a time
        rows = z[idx[c:c + 1024]]
        res = np.empty_like(rows)
        if n >= window == 5 and not np.isnan(rows).any():
            res[:, 2:n - 2] = _median5([rows[:, i:n - 4 + i] for i in range(5)])
        elif n >= window:
            res[:, half_lo:n - half_hi] = np.median(np.lib.stride_tricks.sliding_window_view(rows, window, axis=1),
                                                    axis=2)
        for j in list(range(min(half_lo, n))) + list(range(max(half_lo, n - half_hi), n)):
            res[:, j] = np.median(rows[:, max(0, j - half_lo):min(n, j + half_hi + 1)], axis=1)
        out[idx[c:c + 1024]] = res
    for r in np.flatnonzero(~dense):                     # partial traces: the rank's own rows
        cols = np.flatnonzero(ok[r])
        out[r, cols] = pd.Series(z[r, cols]).rolling(window, center=True, min_periods=1).median().to_numpy()
    return out


def _median5(p: list[np.ndarray]) -> np.ndarray:
    """The element-wise median of five arrays without NaN (the middle value: np.median's result, exactly)
    by a 7 compare-exchange selection network: the default level window's rolling median over 12,288
    ranks x 1,000 steps, ~3x faster than np.median over a sliding window view (which copies it 5-fold)."""
    p = list(p)

    def order(i: int, j: int) -> None:  # p[i] <= p[j] after
        p[i], p[j] = np.minimum(p[i], p[j]), np.maximum(p[i], p[j])

    for i, j in ((0, 1), (3, 4), (0, 3), (1, 4), (1, 2), (2, 3), (1, 2)):
        order(i, j)
    return p[2]
