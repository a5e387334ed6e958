"""Each rank-step judged against the ranks doing the same work, on a log scale, with the run's own noise.

- Peers: the ranks of the same pipeline stage (same layers and chunks; the rank's tensor-parallel
  group and the same-position ranks of the other data-parallel replicas). The reference is the
  peers' median *without the rank itself*: with two ranks per stage (dp=2) a median that includes the
  culprit is the mean of culprit and victim and blames both alike.
- Score x = log(value / reference): 0 = like its peers, 0.26 = 30% slower.
- Noise: sigma = the typical step-to-step change of x (1.4826 x MAD of first differences, median over
  ranks): a rank's persistent level or a fault's shift does not inflate it, nor do a few culprits. A simulated run has sigma ~ 0.5%; eight ranks sharing two CPU cores have 20-30%. Thresholds are
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
    rs = store.query("""SELECT rank, step, pp, dp, tp, host, step_time_s, forward_s, backward_s,
                               forward_s + backward_s AS work_s, own_s, gap_s, gap_p2p_s, gap_coll_s
                        FROM rank_step WHERE step_time_s > 0""")
    if rs.empty:
        return rs
    rs = rs[~rs.step.isin(warmup_steps(rs, warmup_factor))].reset_index(drop=True)
    for m in MEASURES:
        rs[f"ref_{m}"] = leave_one_out_median(rs, ["step", "pp"], m)
        with np.errstate(divide="ignore", invalid="ignore"):
            rs[f"x_{m}"] = np.log(rs[m].clip(lower=1e-9) / rs[f"ref_{m}"].clip(lower=1e-9))
    tp_ref = leave_one_out_median(rs, ["step", "pp", "dp"], "work_s")
    rs["tp_ratio"] = rs.work_s / tp_ref.where(tp_ref > 0)
    return rs


def warmup_steps(rs: pd.DataFrame, factor: float) -> list[int]:
    """Leading steps whose median step time exceeds `factor` x the run's median step time."""
    per_step = rs.groupby("step").step_time_s.median().sort_index()
    typical = float(per_step.median())
    out = []
    for step, value in per_step.items():
        if value <= factor * typical or len(out) >= len(per_step) // 4:
            break
        out.append(int(step))
    return out


def noise_sigma(scores: pd.DataFrame, column: str, key: str = "rank", floor: float = 0.003) -> float:
    """The run's step-to-step noise of a score: per `key` (rank), 1.4826 x MAD of the first differences
    over steps / sqrt(2), then the median over keys. Differences ignore a rank's level (its
    asymmetry, or a fault's shift), and the median over ranks ignores the few culprits."""
    per_key = []
    for _, rows in scores[[key, "step", column]].dropna().sort_values("step").groupby(key):
        d = rows[column].diff().dropna()
        if len(d) >= 2:
            per_key.append(1.4826 * float((d - d.median()).abs().median()) / math.sqrt(2))
    return max(floor, float(np.median(per_key))) if per_key else floor


def leave_one_out_median(df: pd.DataFrame, keys: list[str], col: str) -> pd.Series:
    """Median of `col` over the other members of each row's group (NaN for a group of one).
    Large groups use the group median: one member moves it by less than the noise."""
    size = df.groupby(keys)[col].transform("size")
    out = df.groupby(keys)[col].transform("median").astype(float)
    out[size <= 1] = np.nan
    small = (size > 1) & (size <= 16)
    if small.any():
        sub = df.loc[small, keys + [col]]
        out.loc[small] = sub.groupby(keys)[col].transform(_loo_median).to_numpy()
    return out


def _loo_median(values: pd.Series) -> np.ndarray:
    v = values.to_numpy(dtype=float)
    return np.array([np.median(np.delete(v, i)) for i in range(len(v))])
