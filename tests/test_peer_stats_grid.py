"""The detectors' rank x step matrix code (peer_stats.ScoreGrid and friends) gives the same numbers as
the long-form code it replaced, value for value: dense layouts (the fast axis reductions) and partial
ones (ranks missing at some steps: the long-form fallbacks)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer.detect.episodes import cusum_stretches, cusum_stretches_rows
from megascope.analyzer.detect.peer_stats import (
    ScoreGrid,
    _tp_ratio,
    kahan_means,
    leave_one_out_median,
    loo_median_rows,
    median_inplace,
    noise_sigma,
    noise_sigma_grid,
    replica_score_rows,
    row_groups,
)
from megascope.analyzer.detect.workload_imbalance import _rolling_median


def _grid(rng: np.random.Generator, pp: int, dp: int, tp: int, steps: int, missing: float) -> ScoreGrid:
    ranks = np.arange(pp * dp * tp)
    present = rng.random((len(ranks), steps)) >= missing
    present[:, 0] = True  # every rank keeps a row
    values = np.where(present, rng.lognormal(0, 0.3, (len(ranks), steps)), np.nan)
    values[rng.random(values.shape) < 0.02] = 1.0  # ties
    return ScoreGrid(ranks, np.arange(steps) * 2 + 5, present, ranks // (dp * tp), (ranks // tp) % dp, ranks % tp,
                     np.array([f"h{r // 8}" for r in ranks], dtype=object), {"v": values})


def _long(grid: ScoreGrid, values: np.ndarray) -> pd.DataFrame:
    r, s = np.nonzero(grid.present)
    return pd.DataFrame({"rank": grid.ranks[r], "step": grid.steps[s], "pp": grid.pp[r], "dp": grid.dp[r],
                         "v": values[r, s]})


@pytest.mark.parametrize("missing", [0.0, 0.2])
@pytest.mark.parametrize("layout", [(2, 2, 2), (4, 20, 1), (3, 1, 1), (2, 3, 4)])
def test_leave_one_out_medians_match_the_long_form(layout: tuple[int, int, int], missing: float):
    rng = np.random.default_rng(sum(layout) + int(missing * 10))
    grid = _grid(rng, *layout, steps=12, missing=missing)
    long = _long(grid, grid["v"])
    for keys, groups in ((["step", "pp"], row_groups(grid.pp)), (["step", "pp", "dp"], row_groups(grid.pp, grid.dp))):
        want = leave_one_out_median(long, keys, "v").to_numpy()
        got = loo_median_rows(grid["v"], grid.present, groups)[np.nonzero(grid.present)]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("missing", [0.0, 0.3])
def test_noise_sigma_matches_the_long_form(missing: float):
    rng = np.random.default_rng(7)
    grid = _grid(rng, 2, 4, 2, steps=30, missing=missing)
    assert noise_sigma_grid(grid, grid["v"]) == noise_sigma(_long(grid, grid["v"]), "v")
    few = _grid(rng, 2, 2, 1, steps=2, missing=0.0)   # one difference per rank: the floor
    assert noise_sigma_grid(few, few["v"]) == noise_sigma(_long(few, few["v"]), "v") == 0.003


def test_vectorized_cusum_stretches_match_one_by_one():
    rng = np.random.default_rng(3)
    z = rng.normal(0.3, 1.0, (40, 300))
    z[5, 100:200] += 1.5
    z[9, 10:60] += 3.0
    got = cusum_stretches_rows(z, 0.25, 3.0, 10.0)
    assert got == [cusum_stretches(row, 0.25, 3.0, 10.0) for row in z]
    assert got[5] and got[9]


def test_kahan_mean_matches_a_pandas_groupby_mean():
    rng = np.random.default_rng(11)
    vals = rng.normal(size=(16, 500)) * rng.lognormal(0, 4, size=(16, 500))
    here = rng.random(vals.shape) > 0.1
    vals[2, 3] = np.nan
    (mean,), (has,) = kahan_means(vals, here, [np.arange(len(vals))])
    frame = pd.DataFrame({"col": np.tile(np.arange(500), 16), "v": np.where(here, vals, np.nan).ravel()})
    np.testing.assert_array_equal(mean, frame.groupby("col").v.mean().to_numpy())
    np.testing.assert_array_equal(has, here.any(axis=0))


@pytest.mark.parametrize("window", [2, 4, 5])
def test_rolling_level_matches_pandas(window: int):
    rng = np.random.default_rng(window)
    z = rng.normal(size=(5, 23))
    ok = np.ones_like(z, dtype=bool)
    ok[3, [0, 4, 5, 22]] = False
    got = _rolling_median(z, ok, window)
    for r in range(len(z)):
        cols = np.flatnonzero(ok[r])
        want = pd.Series(z[r, cols]).rolling(window, center=True, min_periods=1).median().to_numpy()
        np.testing.assert_array_equal(got[r, cols], want)


def test_noise_sigma_of_a_dense_shuffled_series_is_the_per_key_statistic():
    # every (src, dst) link at every step, rows in random order: the matrix path, no sort
    rng = np.random.default_rng(5)
    src, dst, step = np.meshgrid(np.arange(6), np.arange(3), np.arange(40) * 3, indexing="ij")
    df = pd.DataFrame({"src": src.ravel(), "dst": dst.ravel(), "step": step.ravel(),
                       "v": rng.standard_t(3, src.size) * 0.05}).sample(frac=1.0, random_state=1)

    def by_hand(frame: pd.DataFrame) -> float:
        per_key = []
        for _, rows in frame.groupby(["src", "dst"]):
            d = np.diff(rows.sort_values("step", kind="stable").v.to_numpy())
            per_key.append(1.4826 * np.median(np.abs(d - np.median(d))) / np.sqrt(2))
        return max(0.003, float(np.median(per_key)))

    assert noise_sigma(df, "v", key=["src", "dst"]) == by_hand(df)
    # one link twice at a step: not a matrix; the sorted path, the same statistic
    dup = pd.concat([df, df.iloc[:1].assign(v=0.9)])
    assert noise_sigma(dup, "v", key=["src", "dst"]) == by_hand(dup)


@pytest.mark.parametrize("missing", [0.0, 0.2])
def test_kahan_means_of_many_groups_match_one_group_at_a_time(missing: float):
    rng = np.random.default_rng(13)
    grid = _grid(rng, 3, 4, 2, steps=40, missing=missing)
    if missing:  # else every value is there: the dense steps' in-place path
        grid["v"][rng.random(grid["v"].shape) < 0.05] = np.nan
    groups = row_groups(grid.dp, grid.pp) + [np.array([0, 5, 7])]  # groups of two sizes
    mean, has = kahan_means(grid["v"], grid.present, groups)
    for i, g in enumerate(groups):
        (want_mean,), (want_has,) = kahan_means(grid["v"], grid.present, [g])
        np.testing.assert_array_equal(mean[i], want_mean)
        np.testing.assert_array_equal(has[i], want_has)


@pytest.mark.parametrize("missing", [0.0, 0.2])
def test_derived_columns_for_some_rows_match_the_whole_matrix(missing: float):
    rng = np.random.default_rng(17)
    grid = _grid(rng, 3, 4, 2, steps=25, missing=missing)
    grid.values["work_s"] = grid.values["v"]
    groups = row_groups(grid.pp, grid.dp)
    ref = loo_median_rows(grid["work_s"], grid.present, groups)
    with np.errstate(divide="ignore", invalid="ignore"):
        whole = grid["work_s"] / np.where(ref > 0, ref, np.nan)
    rows = np.array([1, 7, 8, 20])
    np.testing.assert_array_equal(_tp_ratio(groups, grid, rows), whole[rows])
    replica = replica_score_rows(grid, "v")(grid, np.arange(len(grid.ranks)))
    np.testing.assert_array_equal(replica_score_rows(grid, "v")(grid, rows), replica[rows])
    # the long rows carry the derived columns of their rank-steps
    grid.derived["tp_ratio"] = partial(_tp_ratio, groups)
    long = grid.frame(rows)
    r, s = np.nonzero(grid.present[rows])
    np.testing.assert_array_equal(long.tp_ratio.to_numpy(), whole[rows][r, s])


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")  # the (5, 0) lanes
def test_median_inplace_is_np_median_bit_for_bit():
    rng = np.random.default_rng(19)
    for shape in [(7,), (8,), (3, 999), (4, 1000), (2, 1), (5, 0)]:
        for values in (rng.normal(size=shape), rng.integers(0, 3, size=shape).astype(float)):  # ties too
            want = np.median(values, axis=-1)
            got = median_inplace(values.copy())
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    with_nan = rng.normal(size=(3, 9))
    with_nan[1, 4] = np.nan
    np.testing.assert_array_equal(median_inplace(with_nan.copy()), np.median(with_nan, axis=-1))
