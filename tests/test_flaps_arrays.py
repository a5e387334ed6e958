"""The flap detector's array paths (analyzer/detect/flaps.py) against the pandas computations they replaced:
the noise keyed by dense link ids (matrix or frame), the observed steps per unordered link (bitmap or
first-of-duplicates), and query results streamed into preallocated arrays (or read whole when the
count or a NULL says otherwise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.detect.flaps import _arrays, _key_ids, _keyed_noise
from megascope.analyzer.detect.p2p_link_ids import LinkIds
from megascope.analyzer.detect.peer_stats import noise_sigma
from megascope.tracer.importers.cli import import_run
from tests.megatron_1f1b_gen import GenConfig, write_parquet

TOPO = pd.DataFrame({"rank": range(16), "pp": [r // 4 for r in range(16)]})


def _series(seed: int, steps: int = 30, n_links: int = 12) -> pd.DataFrame:
    """Both directions of the (first n_links) 12 links between consecutive stages of TOPO, every step, in
    random order."""
    rng = np.random.default_rng(seed)
    links = [(a, a + 4) for a in range(n_links)]
    rows = [(s, d, t) for a, b in links for s, d in ((a, b), (b, a)) for t in range(100, 100 + steps)]
    df = pd.DataFrame(rows, columns=["src", "dst", "step"]).sample(frac=1.0, random_state=seed)
    df["lr"] = rng.normal(0, 0.02, len(df)) + np.where(rng.random(len(df)) < 0.03, 0.5, 0.0)
    return df.astype({"src": np.int32, "dst": np.int32}).reset_index(drop=True)


def _old_noise(df: pd.DataFrame) -> float:
    """What the detector computed before: noise_sigma over the finite rows, keyed by src and dst."""
    ok = df[np.isfinite(df.lr)]
    return noise_sigma(ok[["src", "dst", "step", "lr"]].reset_index(drop=True), "lr", key=["src", "dst"])


def _noise(df: pd.DataFrame) -> float:
    links = LinkIds(df.src.to_numpy(), df.dst.to_numpy(), TOPO)
    return _keyed_noise(links.directed, df.step.to_numpy(dtype=np.int64), df.lr.to_numpy(dtype=float))


def test_link_noise_equals_the_src_dst_noise():
    for seed in range(3):
        dense = _series(seed)
        assert _noise(dense) == _old_noise(dense)   # the links x steps matrix
        gappy = dense.drop(index=dense.index[::7]).reset_index(drop=True)
        assert _noise(gappy) == _old_noise(gappy)   # not every link at every step: the frame
        # as many rows as cells, but one link-step twice and another missing: not a matrix either (one
        # link: two keys, whose mean the median is, so the duplicate's extra difference shows)
        twice = _series(seed, n_links=1)
        twice.loc[twice.index[3], ["src", "dst", "step"]] = twice.loc[twice.index[4], ["src", "dst", "step"]]
        assert _noise(twice) == _old_noise(twice)
        nonfinite = dense.copy()
        nonfinite.loc[nonfinite.index[::11], "lr"] = np.nan
        nonfinite.loc[nonfinite.index[5], "lr"] = -np.inf
        assert _noise(nonfinite) == _old_noise(nonfinite)
    assert _noise(_series(0)) != _noise(_series(1))   # not a constant (the floor)


def test_keyed_noise_by_string_keys_equals_noise_sigma():
    # collective-like rows: (group, instance, name) keys, two of them strings; then a missing key
    rng = np.random.default_rng(5)
    keys = [("tp", i, "all_reduce") for i in range(3)] + [("dp", 0, n) for n in ("all_gather", "reduce_scatter")]
    key = ["group", "instance", "name"]
    df = pd.DataFrame([(g, i, n, t) for g, i, n in keys for t in range(20)], columns=key + ["step"])
    df["lr"] = rng.normal(0, 0.05, len(df))
    for rows in (df, df.drop(index=df.index[::9]), df.assign(name=df.name.where(df.index % 13 != 0))):
        rows = rows.reset_index(drop=True)
        ids = _key_ids(rows, key)
        assert (ids[rows.name.isna().to_numpy()] == -1).all()
        assert _keyed_noise(ids, rows.step.to_numpy(dtype=np.int64), rows.lr.to_numpy()) == noise_sigma(
            rows[key + ["step", "lr"]], "lr", key=key)


def _observed_reference(df: pd.DataFrame) -> dict[tuple[int, int], int]:
    a, b = np.minimum(df.src, df.dst), np.maximum(df.src, df.dst)
    staged = a.isin(TOPO["rank"]) & b.isin(TOPO["rank"])
    per = pd.DataFrame({"a": a, "b": b, "step": df.step})[staged].groupby(["a", "b"]).step.nunique()
    return {(int(x), int(y)): int(n) for (x, y), n in per.items()}


def test_observed_steps_per_unordered_link():
    df = _series(3, steps=12)
    df = df.drop(index=df.index[::5])   # some link-steps seen in one direction only
    extra = pd.DataFrame({"src": [0, 0, 99], "dst": [4, 4, 3], "step": [100, 500, 100], "lr": 0.0})  # twice; no stage
    df = pd.concat([df, extra.astype({"src": np.int32, "dst": np.int32})], ignore_index=True)
    for steps in (df.step, df.step.where(df.step != 500, 10**9)):   # a bitmap, then steps too sparse for one
        links = LinkIds(df.src.to_numpy(), df.dst.to_numpy(), TOPO)
        got = links.observed_steps(steps.to_numpy(dtype=np.int64))
        assert list(got.index.names) == ["lo", "hi", "a", "b"]
        assert {(int(a), int(b)): int(n) for (_, _, a, b), n in got.items()} == _observed_reference(
            df.assign(step=steps))
        assert got.index.is_monotonic_increasing
        assert (got.index.get_level_values("lo") <= got.index.get_level_values("hi")).all()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A real run's store: 4 ranks, 2 stages (ranks 0, 1: stage 0; 2, 3: stage 1)."""
    cfg = GenConfig(dp=2, tp=1, pp=2, steps=3, seed=0)
    import_run("ndtimeline", [write_parquet(cfg, tmp_path / "t.parquet")], tmp_path / "run", dp=2, tp=1, pp=2)
    return Store(tmp_path / "run")


# the two p2p series as the detector built them before one pairing served both (p2p_link_steps: the sends
# joined to the receives; the stalls: the two ends joined again)
_OLD_LINKS = """CREATE OR REPLACE TEMP TABLE p2p_link_steps AS
WITH _sends AS (SELECT rank AS src, peer AS dst, step, send_min_ns AS send_ns FROM _p2p_peer_step WHERE sends > 0),
_recvs AS (SELECT peer AS src, rank AS dst, step, recv_min_ns AS recv_ns FROM _p2p_peer_step
           WHERE recv_min_ns IS NOT NULL)
SELECT s.src, s.dst, s.step, least(s.send_ns, r.recv_ns) / 1e9 AS floor_s, ts.pp AS src_pp, td.pp AS dst_pp
FROM _sends s JOIN _recvs r USING (src, dst, step) JOIN topology ts ON ts.rank = s.src
JOIN topology td ON td.rank = s.dst"""
_OLD_SERIES = """WITH _baseline AS (
    SELECT src_pp, dst_pp, step, median(floor_s) AS baseline_s FROM p2p_link_steps GROUP BY ALL)
SELECT l.src, l.dst, l.step, l.floor_s, b.baseline_s, l.floor_s / nullif(b.baseline_s, 0) AS ratio
FROM p2p_link_steps l JOIN _baseline b USING (src_pp, dst_pp, step) WHERE NOT list_contains($warm, l.step)"""
_OLD_STALLS = """WITH _lo AS (SELECT rank AS a, peer AS b, step, gap_p2p_ns FROM _p2p_peer_step WHERE rank < peer),
_hi AS (SELECT peer AS a, rank AS b, step, gap_p2p_ns FROM _p2p_peer_step WHERE rank > peer),
_ends AS (SELECT coalesce(l.a, h.a) AS a, coalesce(l.b, h.b) AS b, coalesce(l.step, h.step) AS step,
    CASE WHEN l.a IS NOT NULL AND h.a IS NOT NULL THEN least(l.gap_p2p_ns, h.gap_p2p_ns) / 1e9 ELSE 0 END AS stall_s
    FROM _lo l FULL JOIN _hi h ON l.a = h.a AND l.b = h.b AND l.step = h.step),
_links AS (SELECT e.a, e.b, e.step, e.stall_s, ta.pp AS a_pp, tb.pp AS b_pp
    FROM _ends e JOIN topology ta ON ta.rank = e.a JOIN topology tb ON tb.rank = e.b),
_baseline AS (SELECT a_pp, b_pp, step, median(stall_s) AS baseline_s FROM _links GROUP BY ALL)
SELECT l.a, l.b, l.step, l.stall_s, b.baseline_s, l.stall_s / nullif(b.baseline_s, 0) AS ratio
FROM _links l JOIN _baseline b USING (a_pp, b_pp, step) WHERE NOT list_contains($warm, l.step)"""


def test_one_pairing_gives_both_series_as_before(store: Store):
    # (rank, step, peer, sends, send_min_ns, recv_min_ns, gap_p2p_ns): links 0<->2 and 1<->3 (stages 0-1) on
    # steps 0-3 (0: warm-up); then a rank that sent nothing, a receive not recorded, one end without a row,
    # a NULL gap, and a rank's transfers to itself (one recorded receive, one not)
    rows = [(r, t, p, 1, 1000 + 7 * r + t, 1100 + 5 * r - t, 200 * (r + 1) + t)
            for t in range(4) for r, p in ((0, 2), (2, 0), (1, 3), (3, 1))]
    rows += [(0, 4, 2, 0, None, None, 300), (2, 4, 0, 2, 1400, 1500, 100), (1, 4, 3, 1, 1300, 1250, 50),
             (1, 5, 3, 1, 1200, 1210, None), (3, 5, 1, 1, 1220, 1190, 70), (0, 5, 2, 1, 900, 950, 10),
             (2, 5, 0, 1, 990, 940, 20), (0, 3, 0, 1, 800, 850, 5), (2, 3, 2, 1, 700, None, 5)]
    values = ", ".join("(" + ", ".join("NULL" if v is None else str(v) for v in row) + ")" for row in rows)
    store.execute("CREATE OR REPLACE TEMP TABLE _p2p_peer_step AS SELECT * FROM (VALUES " + values + ") "
                  "t(rank, step, peer, sends, send_min_ns, recv_min_ns, gap_p2p_ns)")
    warm = {"warm": [0]}
    store.execute(_OLD_LINKS)
    old_series, old_stalls = store.query(_OLD_SERIES, warm), store.query(_OLD_STALLS, warm)
    store.execute(load_sql("p2p_links"), warm)
    new_series, new_stalls = store.query(load_sql("p2p_series")), store.query(load_sql("p2p_stalls"))
    # steps 1-3: 4 directed link-steps and 2 links each, and 0's transfer to itself on step 3; step 4: no
    # transfer (0 sent nothing and recorded no receive from 2, 3 has no row), links 0-2 and 1-3 (one end: no
    # stall); step 5: all
    assert len(old_series) == 17 and len(old_stalls) == 10
    assert len(old_stalls[old_stalls.stall_s == 0]) == 1
    for old, new, key in ((old_series, new_series, ["src", "dst", "step"]),
                          (old_stalls, new_stalls, ["a", "b", "step"])):
        pd.testing.assert_frame_equal(new.sort_values(key).reset_index(drop=True),
                                      old.sort_values(key).reset_index(drop=True))


def test_arrays_streamed_equal_whole(store: Store):
    n = 3_000_000   # three Arrow batches
    sql = ("SELECT range::INT AS i, range * 0.5 AS x, CASE WHEN range % 7 = 0 THEN NULL ELSE range END AS j "
           "FROM range(3000000)")
    whole = _arrays(store, sql)
    assert whole["i"].dtype == np.int32 and np.isnan(whole["j"][0])   # NULL in an integer column: NaN
    for rows in (n, n - 1, n + 1, 10, None):   # the count right, wrong, unknown: the same arrays
        got = _arrays(store, sql, rows)
        assert got.keys() == whole.keys()
        for k in whole:
            assert got[k].dtype == whole[k].dtype
            np.testing.assert_array_equal(got[k], whole[k])
    exact = _arrays(store, "SELECT range::INT AS i, range * 0.5 AS x FROM range(3000000)", n)
    np.testing.assert_array_equal(exact["i"], np.arange(n, dtype=np.int32))
    np.testing.assert_array_equal(exact["x"], np.arange(n) * 0.5)
    empty = _arrays(store, "SELECT 1::INT AS i WHERE false", 0)
    assert empty["i"].dtype == np.int32 and len(empty["i"]) == 0
