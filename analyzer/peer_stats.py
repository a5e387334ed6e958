"""Each rank-step judged against the ranks doing the same work, on a log scale, with the run's own noise.

- Peers: the ranks of the same pipeline stage (same layers and chunks; the rank's tensor-parallel
  group and the same-position ranks of the other data-parallel replicas). The reference is the
  peers' median *without the rank itself*: with two ranks per stage (dp=2) a median that includes the
  culprit is the mean of culprit and victim and blames both alike.
- Score x = log(value / reference): 0 = like its peers, 0.26 = 30% slower.
- Noise: sigma = the typical step-to-step change of x (1.4826 x MAD of first differences, median over
  ranks): a rank's persistent level or a fault's shift does not inflate it, nor do a few culprits. A
  simulated run has sigma ~ 0.5%; eight ranks sharing two CPU cores have 20-30%. Thresholds are
  multiples of sigma, so the same detector finds a 5% straggler in the one and ignores scheduler noise
  in the other.
- Warm-up: leading steps far slower than the run's typical step (graph capture, allocator growth,
  first-touch) are left out of every judgement.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from megascope.analyzer.store import Store

MEASURES = ("work_s", "forward_s", "own_s", "gap_s")
"""work_s = own forward + backward compute; forward_s alone; own_s = compute + data wait + host gaps;
gap_s = host gaps alone (launch delays)."""


def rank_step_scores(store: Store, warmup_factor: float = 2.0) -> pd.DataFrame:
    """rank, step, pp, dp, tp, host, step_time_s, the measures, their peer references (`ref_<m>`) and
    scores (`x_<m>`), gap_p2p_s, gap_coll_s, tp_ratio; warm-up steps dropped."""
    # numbers only from DuckDB (10^6 rows: Python strings per row would cost seconds); the host is a
    # categorical taken from the topology
    rs = store.query("""SELECT rank, step, pp, dp, tp, step_time_s, forward_s, backward_s,
                               forward_s + backward_s AS work_s, own_s, gap_s, gap_p2p_s, gap_coll_s
                        FROM rank_step WHERE step_time_s > 0""")
    if rs.empty:
        return rs.assign(host=pd.Series(dtype=object))
    topo = store.topology.set_index("rank")["host"].astype("category")
    rs.insert(5, "host", topo.reindex(rs["rank"].to_numpy()).to_numpy())
    rs = rs[~rs.step.isin(warmup_steps(rs, warmup_factor))].reset_index(drop=True)
    stage = group_ids(rs, ["step", "pp"])
    for m in MEASURES:
        rs[f"ref_{m}"] = leave_one_out_median(rs, stage, m)
        with np.errstate(divide="ignore", invalid="ignore"):
            rs[f"x_{m}"] = np.log(rs[m].clip(lower=1e-9) / rs[f"ref_{m}"].clip(lower=1e-9))
    tp_ref = leave_one_out_median(rs, group_ids(rs, ["step", "pp", "dp"]), "work_s")
    rs["tp_ratio"] = rs.work_s / tp_ref.where(tp_ref > 0)
    rs["x_replica_work_s"] = replica_score(rs, "x_work_s")
    return rs


def replica_score(rs: pd.DataFrame, column: str) -> pd.Series:
    """Per rank-step: the median over the same data-parallel replica's OTHER stages of their mean score
    (NaN with one stage). Those ranks compute the same micro-batches: when the replica drew long
    sequences they are slow at the same steps, while a slow GPU slows only its own stage."""
    stage = rs.groupby(["step", "dp", "pp"], sort=False)[column].mean().reset_index()
    stage["other"] = leave_one_out_median(stage, ["step", "dp"], column).to_numpy()
    key = pd.MultiIndex.from_frame(stage[["step", "dp", "pp"]])
    lookup = pd.Series(stage["other"].to_numpy(), index=key)
    return pd.Series(lookup.reindex(pd.MultiIndex.from_frame(rs[["step", "dp", "pp"]])).to_numpy(), index=rs.index)


def group_ids(df: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """One integer per distinct combination of the (integer) key columns: cheaper to group by than
    several columns, and computed once for all measures."""
    return df.groupby(keys, sort=False).ngroup().to_numpy()


def warmup_steps(rs: pd.DataFrame, factor: float) -> list[int]:
    """Leading steps whose median step time exceeds `factor` x the run's median step time."""
    per_step = rs.groupby("step").step_time_s.median().sort_index()
    typical = float(per_step.median())
    out: list[int] = []
    for step, value in per_step.items():
        if value <= factor * typical or len(out) >= len(per_step) // 4:
            break
        out.append(int(step))
    return out


def noise_sigma(scores: pd.DataFrame, column: str, key: str | list[str] = "rank", floor: float = 0.003) -> float:
    """The run's step-to-step noise of a score: per `key` (rank), 1.4826 x MAD of the first differences
    over steps / sqrt(2), then the median over keys. Differences ignore a rank's level (its
    asymmetry, or a fault's shift), and the median over keys ignores the few culprits."""
    keys = [key] if isinstance(key, str) else list(key)
    df = scores[keys + ["step", column]].dropna()
    if df.empty:
        return floor
    gid = group_ids(df, keys)
    order = np.lexsort((df.step.to_numpy(), gid))  # each key's steps in order (numpy: 10^6 rows fast)
    g, v = gid[order], df[column].to_numpy(dtype=float)[order]
    same = g[1:] == g[:-1]
    d, gd = np.diff(v)[same], g[1:][same]
    keep = np.bincount(gd, minlength=int(gid.max()) + 1)[gd] >= 2  # keys with two differences or more
    d, gd = d[keep], gd[keep]
    if not len(d):
        return floor
    dev = np.abs(d - pd.Series(d).groupby(gd).transform("median").to_numpy())
    per_key = 1.4826 * pd.Series(dev).groupby(gd).median() / math.sqrt(2)
    return max(floor, float(per_key.median()))


def leave_one_out_median(df: pd.DataFrame, groups: np.ndarray | list[str], col: str, small: int = 16) -> pd.Series:
    """Median of `col` over the other members of each row's group (NaN for a group of one); `groups`:
    group ids (group_ids) or key columns. Groups larger than `small` use the group median: one member
    moves it by less than the noise."""
    gid = group_ids(df, groups) if isinstance(groups, list) else np.asarray(groups)
    values = df[col].to_numpy(dtype=float)
    by = pd.Series(values).groupby(gid, sort=False)
    size = by.transform("size").to_numpy()
    out = by.transform("median").to_numpy(dtype=float).copy()
    out[size <= 1] = np.nan
    sel = np.flatnonzero((size > 1) & (size <= small))
    if len(sel):
        out[sel] = _loo_small(gid[sel], values[sel], small)
    return pd.Series(out, index=df.index)


def _loo_small(gid: np.ndarray, values: np.ndarray, width: int) -> np.ndarray:
    """Vectorized leave-one-out medians for groups of 2..width members: sort each group, then the
    median of the sorted values with the row's own position skipped."""
    order = np.lexsort((values, gid))           # by group, then value (NaN last within a group)
    g_sorted = gid[order]
    _, group, n = np.unique(g_sorted, return_inverse=True, return_counts=True)
    starts = np.concatenate(([0], np.cumsum(n)[:-1]))
    pos = np.arange(len(order)) - starts[group]
    n = n[group]
    grid = np.full((group.max() + 1, width + 1), np.nan)
    grid[group, pos] = values[order]
    m = n - 1                                   # members left once the row itself is skipped

    def remaining(j: np.ndarray) -> np.ndarray:  # j-th smallest of the others
        return grid[group, j + (j >= pos)]

    lo, hi = (m - 1) // 2, m // 2
    out = np.empty(len(order))
    out[order] = (remaining(lo) + remaining(hi)) / 2
    return out
