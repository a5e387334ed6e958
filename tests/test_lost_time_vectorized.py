"""The lost-time attribution's array helpers against the one-rank-at-a-time code they replaced
(detect/lost_time.py): the same values bit for bit, NaNs, ties and one-peer stages included."""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.detect import lost_time as lt


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
    a, b = lt._max_subarrays(x)
    assert [(int(i), int(j)) for i, j in zip(a, b)] == [lt._max_subarray(row) for row in x]


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
