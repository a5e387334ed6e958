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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pandas as pd
import pyarrow as pa

from megascope.analyzer.data.store import Store
from megascope.analyzer.settings import WARMUP_FACTOR

MEASURES = ("work_s", "forward_s", "own_s", "gap_s")
"""work_s = own forward + backward compute; forward_s alone; own_s = compute + data wait + host gaps;
gap_s = host gaps alone (launch delays)."""


PEER_GRID_COLUMNS = ("step_time_s", "work_s")
"""The columns of the score grid the workload imbalance detector reads too (context.DetectContext.peer_grid)."""

SCORE_COLUMNS = ("step_time_s", "forward_s", "work_s", "own_s", "gap_s", "gap_p2p_s")
"""The rank_step columns the scores read (work_s = forward_s + backward_s)."""


@dataclass
class ScoreGrid:
    """Rank-step scores as rank x step matrices (numpy, NaN where a rank has no row at a step), not a
    DataFrame of rank-step rows: at 12,288 ranks x 1,000 steps a long frame of ~25 columns held 7.7 GB
    and its groupbys took ~25 s; per-stage and per-group statistics here are reductions along an axis.

    `values` holds the SCORE_COLUMNS but forward_s, their peer references `ref_<m>` (MEASURES but
    forward_s) and scores `x_<m>` (MEASURES but gap_s); `derived` the columns only candidates' rows are
    read in (tp_ratio, x_replica_work_s), made for the rows asked (a rank x step matrix each is ~100 MB
    at 12,288 x 1,000). `frame(rows)` gives the long rows of a few ranks (the per-rank analysis of
    candidates) with both."""

    ranks: np.ndarray
    steps: np.ndarray
    present: np.ndarray
    """(ranks, steps) bool: the rank has a (non-warm-up) row at that step."""
    pp: np.ndarray
    dp: np.ndarray
    tp: np.ndarray
    host: np.ndarray
    values: dict[str, np.ndarray]
    derived: dict[str, Callable[[ScoreGrid, np.ndarray], np.ndarray]] = field(default_factory=dict)
    """name -> f(grid, rows): the column's (len(rows), steps) matrix for the grid rows `rows` (the grid is
    an argument, not held: a grid that referred to itself would be freed only by the cyclic GC)."""

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    @property
    def empty(self) -> bool:
        return not self.present.any()

    def members(self) -> pd.DataFrame:
        """rank, pp, dp, tp of every rank with a row (merge_tp_groups' groups)."""
        return pd.DataFrame({"rank": self.ranks, "pp": self.pp, "dp": self.dp, "tp": self.tp})

    def per_rank_mean(self, flag: np.ndarray) -> np.ndarray:
        """Per rank: the share of its rows where `flag` holds."""
        return (flag & self.present).sum(axis=1) / self.present.sum(axis=1)

    def part(self, columns: tuple[str, ...]) -> ScoreGrid:
        """The same ranks and steps with only `columns` of the values (the same arrays, not copies: nobody
        writes them) and no derived columns."""
        return ScoreGrid(self.ranks, self.steps, self.present, self.pp, self.dp, self.tp, self.host,
                         {c: self.values[c] for c in columns})

    def frame(self, rows: np.ndarray, columns: list[str] | None = None) -> pd.DataFrame:
        """The long rows (rank, step, pos, pp, dp, tp, host, `columns` or all values) of the ranks at row
        indices `rows`, ordered by rank and step. pos: the step's position among the run's analyzed
        steps, what persistence and onsets count (a sampled trace keeps every Nth step: its ids are N
        apart, its positions adjacent)."""
        rows = np.asarray(rows, dtype=np.int64)
        r, s = np.nonzero(self.present[rows])
        ri = rows[r]
        out = {"rank": self.ranks[ri], "step": self.steps[s], "pos": s, "pp": self.pp[ri], "dp": self.dp[ri],
               "tp": self.tp[ri], "host": self.host[ri]}
        for name in columns if columns is not None else [*self.values, *self.derived]:
            out[name] = self.values[name][ri, s] if name in self.values else self.derived[name](self, rows)[r, s]
        return pd.DataFrame(out)


def rank_step_scores(store: Store, warmup_factor: float = WARMUP_FACTOR) -> ScoreGrid | None:
    """The ScoreGrid of the run's rank_step rows (None: no step with time); warm-up steps dropped."""
    grid = load_grid(store, SCORE_COLUMNS, warmup_factor)
    if grid is None:
        return None
    v = grid.values
    stages = row_groups(grid.pp)
    # x = log(max(v, 1e-9) / max(ref, 1e-9)), in place where it can be: each matrix is ~100 MB at
    # 12,288 x 1,000 (fresh memory costs more in page faults than the arithmetic). forward_s first: only
    # its score is judged, so it becomes x_forward_s and its reference's memory the scratch of the others
    scratch = loo_median_rows(v["forward_s"], grid.present, stages)
    fwd = v.pop("forward_s")
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.maximum(fwd, 1e-9, out=fwd)
        v["x_forward_s"] = np.log(np.divide(x, np.maximum(scratch, 1e-9, out=scratch), out=x), out=x)
    for m in MEASURES:
        if m == "forward_s":
            continue
        v[f"ref_{m}"] = loo_median_rows(v[m], grid.present, stages)
        if m == "gap_s":
            continue  # late launches judge the gap's excess in seconds, not its log ratio: x_gap_s is unread
        x = np.maximum(v[m], 1e-9)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(x, np.maximum(v[f"ref_{m}"], 1e-9, out=scratch), out=x)
            v[f"x_{m}"] = np.log(x, out=x)
    del fwd, x, scratch
    grid.derived["tp_ratio"] = partial(_tp_ratio, row_groups(grid.pp, grid.dp))
    grid.derived["x_replica_work_s"] = replica_score_rows(grid, "x_work_s")
    return grid


def _tp_ratio(groups: list[np.ndarray], grid: ScoreGrid, rows: np.ndarray) -> np.ndarray:
    """work_s / the median of the other ranks of the same tensor-parallel group (pp, dp) at each step
    (NaN without a positive reference), for the grid rows `rows`: leave-one-out medians of their groups
    only (each group's medians do not depend on the others)."""
    group_of = np.empty(len(grid.ranks), dtype=np.int64)
    for i, g in enumerate(groups):
        group_of[g] = i
    mine = [groups[i] for i in np.unique(group_of[rows])]
    sub = np.concatenate(mine)
    starts = np.cumsum([0] + [len(g) for g in mine])
    work = grid["work_s"][sub]
    ref = loo_median_rows(work, grid.present[sub], [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])])
    ref[~(ref > 0)] = np.nan  # no reference (NaN) or a zero one: no ratio
    at = np.empty(len(grid.ranks), dtype=np.int64)
    at[sub] = np.arange(len(sub))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (work / ref)[at[rows]]


def load_grid(store: Store, columns: tuple[str, ...], warmup_factor: float = WARMUP_FACTOR) -> ScoreGrid | None:
    """rank_step's `columns` (step_time_s among them; work_s = forward_s + backward_s) as a ScoreGrid
    without scores, warm-up steps dropped (None: no rank-step with time)."""
    grid = fetch_grid(store, columns)
    return None if grid is None else drop_warmup(grid, warmup_factor)[0]


def drop_warmup(grid: ScoreGrid, warmup_factor: float) -> tuple[ScoreGrid | None, list[int]]:
    """The grid without its warm-up steps (warmup_from_medians of the per-step medians of step_time_s)
    and without the ranks left with no step (None: nothing left); and the warm-up steps."""
    warm = warmup_from_medians(column_medians(grid["step_time_s"], grid.present), grid.steps, warmup_factor)
    keep = ~np.isin(grid.steps, warm)
    if not keep.all():
        grid.steps, grid.present = grid.steps[keep], grid.present[:, keep]
        grid.values = {k: v[:, keep] for k, v in grid.values.items()}
        alive = grid.present.any(axis=1)  # a rank with warm-up rows only is not in the scores
        if not alive.all():
            grid.ranks, grid.present = grid.ranks[alive], grid.present[alive]
            grid.pp, grid.dp, grid.tp, grid.host = grid.pp[alive], grid.dp[alive], grid.tp[alive], grid.host[alive]
            grid.values = {k: v[alive] for k, v in grid.values.items()}
    return (None if grid.empty else grid), warm


GRID_EXPRESSIONS = {"work_s": "forward_s + backward_s"}
"""Grid columns that are expressions over rank_step's (fetch_grid: the others are its columns)."""


def fetch_grid(store: Store, columns: tuple[str, ...], chunk_ranks: int = 512,
               expressions: dict[str, str] | None = None) -> ScoreGrid | None:
    """rank_step's `columns` (or `expressions`, name -> SQL over rank_step's columns, beside
    GRID_EXPRESSIONS) of its rows with step time placed into rank x step matrices, `chunk_ranks` ranks a
    query (a bounded result each time, never one long table of all rows). Results come as Arrow columns
    turned into numpy arrays, not pandas frames: at 12,288 ranks x 1,000 steps the frames cost ~1 s of
    the ~1.7 s. Small chunks: DuckDB's allocator keeps a while what a result held (2,048 ranks a query:
    ~200 MB more resident after the fetch, 512: ~30 MB; the fetch's CPU time did not change measurably)."""
    where = "FROM rank_step WHERE step_time_s > 0"
    ids = store.arrow(f"SELECT DISTINCT rank, pp, dp, tp {where}")
    if not ids.num_rows:
        return None
    # one row per rank (its first, as pandas' drop_duplicates kept it), in rank order
    ranks, first_row = np.unique(_ints(ids, "rank"), return_index=True)
    steps = np.unique(_ints(store.arrow(f"SELECT DISTINCT step {where}"), "step"))
    shape = (len(ranks), len(steps))
    hosts = store.topology.set_index("rank")["host"]
    grid = ScoreGrid(ranks, steps, np.zeros(shape, dtype=bool), _ints(ids, "pp")[first_row],
                     _ints(ids, "dp")[first_row], _ints(ids, "tp")[first_row],
                     hosts.reindex(ranks).to_numpy(), {c: np.empty(shape) for c in columns})
    exprs = GRID_EXPRESSIONS | (expressions or {})
    select = ", ".join(f"{exprs[c]} AS {c}" if c in exprs else c for c in columns)
    for lo in range(0, len(ranks), chunk_ranks):
        hi = min(lo + chunk_ranks, len(ranks))
        first, last = int(ranks[lo]), int(ranks[hi - 1])
        rows = store.arrow(f"SELECT rank, step, {select} {where} AND rank BETWEEN $lo AND $hi",
                      {"lo": first, "hi": last})
        # flat positions in the matrices (every rank in [first, last] is one of ranks); rank_step is in
        # the event pass's batch order, not sorted, so the rows are scattered
        at = _positions(ranks, rows.column("rank").to_numpy()) * len(steps)
        at += _positions(steps, rows.column("step").to_numpy())
        grid.present.ravel()[at] = True
        for c in columns:
            grid.values[c].ravel()[at] = rows.column(c).to_numpy(zero_copy_only=False)  # NULL: NaN
    if not grid.present.all():  # NaN where a rank has no row (the matrices were not filled first: one pass less)
        for c in columns:
            grid.values[c][~grid.present] = np.nan
    return grid


def _positions(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The index of each value in the sorted, distinct `keys` (all values are keys): a lookup table over
    the keys' span when it is compact (a gather: 12,288 ranks x 1,000 steps took 0.3 s in searchsorted),
    else a binary search."""
    lo, span = int(keys[0]), int(keys[-1]) - int(keys[0]) + 1
    if span > 4 * len(keys) + 4096:
        return np.searchsorted(keys, values)
    table = np.zeros(span, dtype=np.int64)
    table[keys - lo] = np.arange(len(keys))
    return table[values - lo]


def _ints(table: pa.Table, column: str) -> np.ndarray:
    """An integer column of a query result as int64 (no NULLs in the key columns)."""
    return table.column(column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def median_inplace(a: np.ndarray) -> np.ndarray:
    """np.median along the last axis, the same values, partitioning `a` in place (its last axis
    reordered): without NaN, only the middle element(s) are placed; np.median also places each lane's
    maximum for its NaN check, ~8x the time at odd lengths (1,024 ranks x 999 differences: 9 ms
    against 1.2). With a NaN (or nothing), np.median itself."""
    n = a.shape[-1]
    if n == 0 or np.isnan(a).any():
        return np.asarray(np.median(a, axis=-1, overwrite_input=True))
    h = n // 2
    if n % 2:
        a.partition(h, axis=-1)
        return a[..., h].copy()
    a.partition([h - 1, h], axis=-1)
    return (a[..., h - 1] + a[..., h]) / 2


def column_medians(m: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Per step (column): the median over the ranks with a row."""
    if present.all():
        return np.median(m, axis=0)
    out = np.full(m.shape[1], np.nan)
    for j in np.flatnonzero(present.any(axis=0)):
        out[j] = np.median(m[present[:, j], j])
    return out


def row_groups(*keys: np.ndarray) -> list[np.ndarray]:
    """Row indices of each distinct combination of per-rank keys (e.g. the ranks of each stage)."""
    _, gid = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    gid = gid.ravel()
    order = np.argsort(gid, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(gid[order])) + 1)


def loo_median_rows(m: np.ndarray, present: np.ndarray, groups: list[np.ndarray], small: int = 16) -> np.ndarray:
    """leave_one_out_median for rank x step matrices: per step, the median of `m` over the other rows of
    each row's group (row index arrays); same rules (NaN alone, the group median beyond `small`)."""
    out = np.full(m.shape, np.nan)
    by_size: dict[int, list[np.ndarray]] = {}
    for g in groups:
        by_size.setdefault(len(g), []).append(g)
    for k, gs in by_size.items():
        # a few MB of groups at a time: the sorts below hold several copies of their values
        per_chunk = max(1, (1 << 21) // max(1, k * m.shape[1]))
        for c in range(0, len(gs), per_chunk):
            _loo_groups(m, present, np.stack(gs[c:c + per_chunk]), small, out)
    return out


def _loo_groups(m: np.ndarray, present: np.ndarray, idx: np.ndarray, small: int, out: np.ndarray) -> None:
    """loo_median_rows for groups of one size (`idx`: groups x k row indices), into `out`."""
    k = idx.shape[1]
    if k > small and len(idx) == 1 and idx[0, -1] - idx[0, 0] == k - 1 and (np.diff(idx[0]) == 1).all():
        # one large group of consecutive rows (a pipeline stage, ranks laid out stage by stage): views, no
        # gather and scatter of its rows (8 stages x 4 measures at 12,288 x 1,000: ~12 MB each way each)
        rows = slice(int(idx[0, 0]), int(idx[0, 0]) + k)
        if present[rows].all() and not np.isnan(m[rows]).any():
            out[rows] = np.median(m[rows], axis=0)
            return
    vals, here = m[idx], present[idx]          # (groups, k, steps)
    if not here.all() or np.isnan(vals).any():
        # absent rows (partial traces): the long form, which counts each group's rows per step
        g, j, s = np.nonzero(here)
        res = leave_one_out_median_ids(g * m.shape[1] + s, vals[g, j, s], small)
        out[idx[g, j], s] = res
    elif k > small:
        out[idx] = np.median(vals, axis=1, overwrite_input=True)[:, None, :]  # vals: a copy
    elif k > 1:
        out[idx] = _loo_sorted(vals)


def _loo_sorted(vals: np.ndarray) -> np.ndarray:
    """Leave-one-out medians along axis 1 of a (groups, k, steps) array without NaN: the median of the
    sorted values with the member's own position skipped (_loo_small's rule). Only the order statistics
    next to the middle are placed (a partition, not an argsort), and "the member sorts at or before j"
    is read from its value: x <= the j-th smallest, which differs from its position only on a tie with
    the (j+1)-th smallest, where both give the same value."""
    k = vals.shape[1]
    m = k - 1
    lo, hi = (m - 1) // 2, m // 2
    srt = np.partition(vals, sorted({lo, lo + 1, hi, hi + 1}), axis=1)

    def remaining(j: int) -> np.ndarray:  # j-th smallest of the others
        at, after = srt[:, j:j + 1], srt[:, j + 1:j + 2]
        return np.where(vals <= at, after, at)

    return (remaining(lo) + remaining(hi)) / 2


def replica_score_rows(grid: ScoreGrid, column: str) -> Callable[[ScoreGrid, np.ndarray], np.ndarray]:
    """Per rank-step of the grid rows asked: the median over the same data-parallel replica's OTHER
    stages of their mean score (NaN with one stage). Those ranks compute the same micro-batches: when
    the replica drew long sequences they are slow at the same steps, while a slow GPU slows only its
    own stage. The per-block medians (blocks x steps) are computed here, the rank x step matrix is not."""
    blocks = row_groups(grid.dp, grid.pp)     # (dp, pp) blocks, in (dp, pp) order
    keys = np.array([(grid.dp[b[0]], grid.pp[b[0]]) for b in blocks])
    x, here = grid[column], grid.present
    mean, has = kahan_means(x, here, blocks)
    # the blocks of each replica are the members of its groups: the same leave-one-out rule
    replicas = row_groups(keys[:, 0])
    other = loo_median_rows(mean, has, replicas)
    block_of = np.empty(len(x), dtype=np.int64)
    for i, b in enumerate(blocks):
        block_of[b] = i

    def rows_of(of: ScoreGrid, rows: np.ndarray) -> np.ndarray:
        return np.where(of.present[rows], other[block_of[rows]], np.nan)
    return rows_of


def kahan_means(vals: np.ndarray, here: np.ndarray, groups: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per group of rows (row index arrays) and column: the mean of the non-NaN values of present rows,
    summed as pandas' groupby mean sums (compensated, row by row), NaN where none; and whether any row
    is present (the group exists). Both as (groups, columns) matrices. The groups of one size are
    summed together, row by row (one call per group cost a Python loop per row: 12,288 ranks in 1,536
    blocks of 8 or 192 replicas of 64 took 0.2-0.9 s)."""
    mean = np.full((len(groups), vals.shape[1]), np.nan)
    has = np.zeros(mean.shape, dtype=bool)
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_size.setdefault(len(g), []).append(i)
    for which in by_size.values():
        mean[which], has[which] = _kahan_rows(vals, here, np.stack([groups[i] for i in which]))
    return mean, has


def _kahan_rows(vals: np.ndarray, here: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kahan_means of the groups of rows `idx` (groups x k row indices), all groups at once."""
    shape = (idx.shape[0], vals.shape[1])
    total, comp, count = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    has = np.zeros(shape, dtype=bool)
    for j in range(idx.shape[1]):
        row, h = vals[idx[:, j]], here[idx[:, j]]
        ok = h & ~np.isnan(row)
        if ok.all():  # the same steps as below with every value taken (a dense trace), in place
            row -= comp
            t = total + row
            np.subtract(t, total, out=comp)
            comp -= row
            comp[np.isnan(comp)] = 0.0
            total = t
            count += 1.0
            has |= h
            continue
        y = np.where(ok, row, 0.0) - np.where(ok, comp, 0.0)
        t = total + y
        comp = np.where(ok, t - total - y, comp)
        comp = np.where(np.isnan(comp), 0.0, comp)
        total = np.where(ok, t, total)
        count += ok
        has |= h
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan), has


def group_ids(df: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """One integer per distinct combination of the (integer) key columns: cheaper to group by than
    several columns, and computed once for all measures."""
    return df.groupby(keys, sort=False).ngroup().to_numpy()


def warmup_steps(rs: pd.DataFrame, factor: float) -> list[int]:
    """Leading steps whose median step time exceeds `factor` x the run's median step time."""
    per_step = rs.groupby("step").step_time_s.median().sort_index()
    return warmup_from_medians(per_step.to_numpy(), per_step.index.to_numpy(), factor)


def warmup_from_medians(medians: np.ndarray, steps: np.ndarray, factor: float) -> list[int]:
    """warmup_steps from the per-step median step times (steps ascending)."""
    typical = float(np.median(medians))
    out: list[int] = []
    for step, value in zip(steps, medians):
        if value <= factor * typical or len(out) >= len(medians) // 4:
            break
        out.append(int(step))
    return out


def noise_sigma(scores: pd.DataFrame, column: str, key: str | list[str] = "rank", floor: float = 0.003) -> float:
    """The run's step-to-step noise of a score: per `key` (rank), 1.4826 x MAD of the first differences
    over steps / sqrt(2), then the median over keys. Differences ignore a rank's level (its
    asymmetry, or a fault's shift), and the median over keys ignores the few culprits."""
    keys = [key] if isinstance(key, str) else list(key)
    df = scores[keys + ["step", column]]
    if df.isna().to_numpy().any():  # a copy only when there is something to drop (21.5M link-steps: 0.5 GB)
        df = df.dropna()
    if df.empty:
        return floor
    gid = group_ids(df, keys)
    steps, values = df.step.to_numpy(), df[column].to_numpy(dtype=float)
    dense = _dense_matrix(gid, steps, values)
    if dense is not None:
        # every key at every step once: a keys x steps matrix, medians along its rows (the same values
        # as the sort and groupbys below, without them: 21.5M p2p link-steps at 12,288 ranks)
        return noise_sigma_dense(dense, floor)
    order = np.lexsort((steps, gid))  # each key's steps in order (numpy: 10^6 rows fast)
    g, v = gid[order], values[order]
    same = g[1:] == g[:-1]
    d, gd = np.diff(v)[same], g[1:][same]
    keep = np.bincount(gd, minlength=int(gid.max()) + 1)[gd] >= 2  # keys with two differences or more
    d, gd = d[keep], gd[keep]
    if not len(d):
        return floor
    dev = np.abs(d - pd.Series(d).groupby(gd).transform("median").to_numpy())
    per_key = 1.4826 * pd.Series(dev).groupby(gd).median() / math.sqrt(2)
    return max(floor, float(per_key.median()))


def _dense_matrix(gid: np.ndarray, steps: np.ndarray, values: np.ndarray) -> np.ndarray | None:
    """values as a (key, step) matrix, steps ascending, when every key has every step exactly once;
    else None. Placed by index, not sorted."""
    counts = np.bincount(gid)
    if not (counts == counts[0]).all():
        return None
    uniq = np.sort(pd.unique(steps))
    if len(uniq) != counts[0]:
        return None
    col = np.searchsorted(uniq, steps)
    seen = np.zeros((len(counts), len(uniq)), dtype=bool)
    seen[gid, col] = True
    if not seen.all():  # a key twice at a step (and so missing another)
        return None
    out = np.empty(seen.shape)
    out[gid, col] = values
    return out


def leave_one_out_median(df: pd.DataFrame, groups: np.ndarray | list[str], col: str, small: int = 16) -> pd.Series:
    """Median of `col` over the other members of each row's group (NaN for a group of one); `groups`:
    group ids (group_ids) or key columns. Groups larger than `small` use the group median: one member
    moves it by less than the noise."""
    gid = group_ids(df, groups) if isinstance(groups, list) else np.asarray(groups)
    return pd.Series(leave_one_out_median_ids(gid, df[col].to_numpy(dtype=float), small), index=df.index)


def leave_one_out_median_ids(gid: np.ndarray, values: np.ndarray, small: int = 16) -> np.ndarray:
    """leave_one_out_median on arrays: group ids and values."""
    by = pd.Series(values).groupby(gid, sort=False)
    size = by.transform("size").to_numpy()
    out = by.transform("median").to_numpy(dtype=float).copy()
    out[size <= 1] = np.nan
    sel = np.flatnonzero((size > 1) & (size <= small))
    if len(sel):
        out[sel] = _loo_small(gid[sel], values[sel], small)
    return out


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


def noise_sigma_grid(grid: ScoreGrid, values: np.ndarray, floor: float = 0.003) -> float:
    """noise_sigma per rank of a rank x step matrix of scores (the same statistic): with every rank
    scored at every step, the differences and medians are reductions along the step axis."""
    ok = grid.present & ~np.isnan(values)
    if not ok.all():
        r, s = np.nonzero(ok)
        long = pd.DataFrame({"rank": grid.ranks[r], "step": grid.steps[s], "v": values[r, s]})
        return noise_sigma(long, "v", floor=floor)
    return noise_sigma_dense(values, floor)


def noise_sigma_dense(values: np.ndarray, floor: float = 0.003) -> float:
    """noise_sigma of a keys x steps matrix with every cell scored (no NaN): per row (a rank, a link),
    the MAD of its step-to-step differences, median over the rows."""
    if values.shape[1] < 3:  # a rank needs two differences
        return floor
    # a row's median does not depend on the order of its values, so the partitions may reorder d, and
    # the deviations reuse its memory; 1,024 ranks at a time (a rank x step copy is ~100 MB at 12,288 x 1,000)
    per_key = np.empty(len(values))
    for c in range(0, len(values), 1024):
        d = np.diff(values[c:c + 1024], axis=1)
        d -= median_inplace(d)[:, None]
        per_key[c:c + 1024] = median_inplace(np.abs(d, out=d))
    per_key = 1.4826 * per_key / math.sqrt(2)
    return max(floor, float(np.median(per_key)))
