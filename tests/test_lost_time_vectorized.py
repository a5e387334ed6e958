"""The lost-time attribution's array helpers against the one-rank-at-a-time code they replaced
(detect/lost_time.py): the same values bit for bit, NaNs, ties and one-peer stages included."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from megascope.analyzer.detect import lost_time as lt
from megascope.analyzer.detect import stretch_search as ss


def _matrix(seed: int, ranks: int = 24, steps: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = np.round(rng.lognormal(-3, 0.3, (ranks, steps)), 4)  # rounded: ties
    x[rng.random(x.shape) < 0.1] = np.nan
    x[3] = np.nan  # a rank without rows
    x[:, 7] = np.nan  # a step nobody has
    return pd.DataFrame(x, index=pd.Index(np.arange(ranks) * 3 + 1, name="rank"))


def _topo(index: pd.Index) -> pd.DataFrame:
    n = len(index)
    pp = np.array([i % 4 for i in range(n)])
    pp[-1] = 9  # a stage of one rank: no peers
    return pd.DataFrame({"pp": pp, "dp": np.arange(n) // 8, "tp": np.arange(n) // 4 % 2,
                         "host": [f"h{i // 6}" for i in range(n)]}, index=index)


def _excess_one_by_one(own: pd.DataFrame, topo: pd.DataFrame) -> dict[int, np.ndarray]:
    out = {}
    for rank in own.index:
        peers = topo.index[(topo.pp == topo.pp[rank]) & (topo.index != rank)]
        if len(peers):
            out[int(rank)] = (own.loc[rank] - own.loc[peers].median(axis=0)).to_numpy()
    return out


def test_excess_is_the_peer_median_rank_by_rank():
    for seed in range(5):
        own = _matrix(seed)
        topo = _topo(own.index)
        want, got = _excess_one_by_one(own, topo), lt._excess(own, topo)
        assert list(got) == list(want)
        for rank in want:
            np.testing.assert_array_equal(got[rank], want[rank])


def test_kadane_for_all_rows_at_once():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (50, 80))
    x[4] = -1.0  # every value negative: the largest single one
    x[5] = 0.0   # ties everywhere
    a, b = ss.max_subarrays(x)
    assert [(int(i), int(j)) for i, j in zip(a, b)] == [ss.max_subarray(row) for row in x]


def test_row_nanmedian_matches_row_by_row():
    x = _matrix(2).to_numpy()
    got = lt._row_nanmedian(x)
    for i, row in enumerate(x):
        want = np.nanmedian(row) if (~np.isnan(row)).any() else np.nan
        np.testing.assert_array_equal(got[i], want)


def test_cross_host_links_in_rank_order():
    topo = _topo(pd.Index(np.arange(40), name="rank"))
    key = topo.reset_index()
    want = []
    for r in key.itertuples():
        for s in key[(key.pp == r.pp + 1) & (key.dp == r.dp) & (key.tp == r.tp)].itertuples():
            if s.host != r.host:
                want.append((int(r.rank), int(s.rank)))
    p2p, coll = lt._cross_host(topo)
    assert p2p == want and want
    assert coll and all(len({topo.host[r] for r in g}) > 1 for g in coll)


def test_candidates_keep_every_stretch_that_passes():
    rng = np.random.default_rng(3)
    own = pd.DataFrame(rng.normal(0.1, 0.002, (32, 120)), index=pd.Index(range(32), name="rank"))
    own.iloc[5, 60:100] += 0.01  # a slow stretch
    own.iloc[9, 30:50] += 0.004
    topo = _topo(own.index)
    excess = lt._excess(own, topo)
    det = lt.LostTimeDetector()
    net = np.zeros(own.shape[1], bool)
    net[10:13] = True
    step_time = own.max(axis=0).to_numpy()
    passing = [r for r, d in excess.items()
               if det._stretch(np.where(net, np.nan, d), own.loc[r].to_numpy(), step_time) is not None]
    candidates = det._candidates(excess, own, net)
    assert 5 in passing and set(passing) <= set(candidates)
    assert len(candidates) < len(excess)  # a screen, not everyone


def _dense(seed: int, ranks: int = 24, steps: int = 60) -> pd.DataFrame:
    """_matrix without NaN (every rank at every step): the partition path of the peer medians."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.lognormal(-3, 0.3, (ranks, steps)), 3)  # coarser: more ties
    return pd.DataFrame(x, index=pd.Index(np.arange(ranks) * 3 + 1, name="rank"))


def test_excess_without_nan_is_the_peer_median_rank_by_rank():
    for seed in range(5):
        for ranks in (2, 3, 5, 24, 25):  # stages of one to seven ranks, odd and even
            own = _dense(seed, ranks)
            topo = _topo(own.index)
            want, got = _excess_one_by_one(own, topo), lt._excess(own, topo)
            assert list(got) == list(want)
            for rank in want:
                np.testing.assert_array_equal(got[rank], want[rank])


def test_peer_excess_is_the_peer_median_rank_by_rank():
    """_PeerExcess (the replica test's and the finding's compute excess) against the pandas median of the
    stage peers it replaced, asked in any order, the one-rank stage (NaN) included."""
    for seed in range(3):
        for work in (_matrix(seed), _dense(seed)):
            topo = _topo(work.index)
            got = lt._PeerExcess(work, topo)
            for rank in reversed(work.index):
                peers = topo.index[(topo.pp == topo.pp[rank]) & (topo.index != rank)]
                want = (work.loc[rank] - work.loc[peers].median(axis=0)).to_numpy()
                np.testing.assert_array_equal(got(int(rank)), want)


def test_nanmedian_matches_numpy_along_either_axis():
    rng = np.random.default_rng(3)
    for x in (_matrix(4).to_numpy(), _dense(4).to_numpy(), np.round(rng.normal(0, 1, (40, 700)), 2)):
        y = x.copy()
        y[:, 5] = np.nan  # a step nobody has: the rows' common gap
        for m in (x, y):
            for axis in (0, 1):
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    want = np.nanmedian(m, axis=axis)
                np.testing.assert_array_equal(lt._nanmedian(m, axis=axis), want)


def test_growth_matches_the_frame_medians():
    for wait in (_matrix(5), _dense(5)):
        plus = wait * 0.5
        ranks = [int(r) for r in wait.index[::2]]
        w = (wait + plus).loc[ranks]
        want = np.nan_to_num((w.sub(w.median(axis=1), axis=0)).median(axis=0).to_numpy())
        np.testing.assert_array_equal(lt._growth(wait, ranks, plus), want)


def test_stretch_helpers_match_plain_numpy():
    rng = np.random.default_rng(4)
    y = np.round(rng.normal(0, 1, (40, 70)), 1)  # ties
    a = rng.integers(0, 70, 40)
    b = np.minimum(a + rng.integers(0, 70, 40), 69)
    b[-1] = 69  # the last row's stretch ends the matrix
    a[3], b[3] = 0, 69  # nothing outside: keeps its level
    sums = ss.stretch_sums(y, a, b)
    mid = ss.midlevel(y, a, b, np.full(40, -7.0))
    for i in range(40):
        inside, out = y[i, a[i]:b[i] + 1], np.r_[y[i, :a[i]], y[i, b[i] + 1:]]
        np.testing.assert_allclose(sums[i], inside.sum(), rtol=1e-12)
        assert mid[i] == ((np.median(inside) + np.median(out)) / 2 if len(out) else -7.0)


def test_stretch_of_a_fault_over_most_of_the_run():
    """The median of all steps is the fault's level when the fault covers most of them (a rank slowed
    from step 10 of 60): the stretch is found at the level halfway between the first stretch's median
    and the rest's, steps 10-59; a fault over a minority is found as it was; _stretch (one row) and
    stretches (all rows) agree."""
    rng = np.random.default_rng(5)
    x = rng.normal(0, 0.002, (6, 60))
    x[0, 10:] += 0.03   # most of the run
    x[1, 25:45] += 0.03  # a minority
    a, b = ss.stretches(x, min_steps=20, min_history=10)
    assert (a[0], b[0]) == (10, 59)
    assert (a[1], b[1]) == (25, 44)
    for i, row in enumerate(x):
        one = ss.stretches(row[None, :], 20, 10)
        assert (one[0][0], one[1][0]) == (a[i], b[i])
    det = lt.LostTimeDetector()
    hit = det._stretch(x[0], x[0] + 0.1, x[0] + 0.1)  # the job waited for it: its steps grew alike
    assert hit is not None and hit[:2] == (10, 59) and hit[2]["t"] > det.cfg.t_min
