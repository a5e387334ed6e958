"""The flap detector's array paths (analyzer/flaps.py) against the pandas computations they replaced:
the noise keyed by dense link ids (matrix or frame), the observed steps per unordered link (bitmap or
first-of-duplicates), and query results streamed into preallocated arrays (or read whole when the
count or a NULL says otherwise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from megascope.analyzer.flaps import _arrays, _key_ids, _keyed_noise, _LinkIds
from megascope.analyzer.peer_stats import noise_sigma
from megascope.analyzer.store import Store
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
    links = _LinkIds(df.src.to_numpy(), df.dst.to_numpy(), TOPO)
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
        links = _LinkIds(df.src.to_numpy(), df.dst.to_numpy(), TOPO)
        got = links.observed_steps(steps.to_numpy(dtype=np.int64))
        assert list(got.index.names) == ["lo", "hi", "a", "b"]
        assert {(int(a), int(b)): int(n) for (_, _, a, b), n in got.items()} == _observed_reference(
            df.assign(step=steps))
        assert got.index.is_monotonic_increasing
        assert (got.index.get_level_values("lo") <= got.index.get_level_values("hi")).all()


def test_arrays_streamed_equal_whole(tmp_path: Path):
    cfg = GenConfig(dp=1, tp=1, pp=2, steps=3, seed=0)
    import_run("ndtimeline", [write_parquet(cfg, tmp_path / "t.parquet")], tmp_path / "run", dp=1, tp=1, pp=2)
    store = Store(tmp_path / "run")
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
