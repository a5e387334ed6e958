"""The flap detector's numpy pairing (analyzer/detect/p2p_pairs.py) against p2p_links.sql, p2p_series.sql
and p2p_stalls.sql on a real run's store: the same rows, every column exact, on hand-written hard cases;
and the layouts it leaves to the SQL (sparse steps, a duplicated row)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.flaps import _SqlPairs
from megascope.analyzer.detect.p2p_pairs import column_medians, read_pairs
from megascope.tracer.importers.cli import import_run
from tests.megatron_1f1b_gen import GenConfig, write_parquet

Row = tuple[int, int, int, int, "int | None", "int | None", "int | None"]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A real run's store: 4 ranks, 2 stages (ranks 0, 1: stage 0; 2, 3: stage 1)."""
    cfg = GenConfig(dp=2, tp=1, pp=2, steps=3, seed=0)
    import_run("ndtimeline", [write_parquet(cfg, tmp_path / "t.parquet")], tmp_path / "run", dp=2, tp=1, pp=2)
    return Store(tmp_path / "run")


def _peer_steps(store: Store, rows: list[Row]) -> None:
    """_p2p_peer_step as (rank, step, peer, sends, send_min_ns, recv_min_ns, gap_p2p_ns) rows."""
    values = ", ".join("(" + ", ".join("NULL" if v is None else str(v) for v in row) + ")" for row in rows)
    values = values or "(0, 0, 0, 0, 0, 0, 0) LIMIT 0"
    store.execute("CREATE OR REPLACE TEMP TABLE _p2p_peer_step AS SELECT rank::INT AS rank, step::BIGINT AS step, "
                  "peer::INT AS peer, sends::BIGINT AS sends, send_min_ns::BIGINT AS send_min_ns, "
                  "recv_min_ns::BIGINT AS recv_min_ns, gap_p2p_ns::BIGINT AS gap_p2p_ns FROM (SELECT * FROM (VALUES "
                  + values + ")) t(rank, step, peer, sends, send_min_ns, recv_min_ns, gap_p2p_ns)")


def _hard_rows() -> list[Row]:
    """Links 0<->2 and 1<->3 (stages 0-1) on steps 0-5 (0: warm-up); then a rank that sent nothing, a
    receive not recorded, one end without a row, a NULL gap, a NULL send minimum of a rank that sent,
    a rank's transfers to itself (recorded, not recorded, not sent), a link within a stage (0<->1), a
    peer outside the topology, and ties in the baselines."""
    rows: list[Row] = [(r, t, p, 1, 1000 + 7 * r + t, 1100 + 5 * r - t, 200 * (r + 1) + t)
                       for t in range(4) for r, p in ((0, 2), (2, 0), (1, 3), (3, 1))]
    rows += [(0, 4, 2, 0, None, None, 300), (2, 4, 0, 2, 1400, 1500, 100), (1, 4, 3, 1, 1300, 1250, 50),
             (1, 5, 3, 1, 1200, 1210, None), (3, 5, 1, 1, 1220, 1190, 70), (0, 5, 2, 1, 900, 950, 10),
             (2, 5, 0, 1, 990, 940, 20), (0, 3, 0, 1, 800, 850, 5), (2, 3, 2, 1, 700, None, 5),
             (1, 2, 1, 0, None, None, 5), (0, 6, 2, 1, None, 1000, 1), (2, 6, 0, 1, 1000, 1000, None),
             (1, 6, 3, 1, 1000, 1000, 3), (3, 6, 1, 1, 1000, 1000, 3), (0, 6, 1, 1, 500, 600, 7),
             (1, 6, 0, 1, 550, 650, 9), (0, 5, 9, 1, 10, 10, 1), (9, 5, 0, 1, 10, 10, 1)]
    return rows


def _equal(new: dict[str, np.ndarray], old: dict[str, np.ndarray], key: list[str]) -> None:
    assert new.keys() <= old.keys()
    a = np.lexsort([new[k] for k in reversed(key)])
    b = np.lexsort([old[k] for k in reversed(key)])
    for k in new:
        assert new[k].dtype == old[k].dtype, k
        np.testing.assert_array_equal(new[k][a], old[k][b], err_msg=k)


def test_numpy_pairing_gives_the_sql_rows(store: Store):
    _peer_steps(store, _hard_rows())
    pairs = read_pairs(store, [0])
    assert pairs is not None
    series, stalls = pairs.series(), pairs.stalls()
    sql = _SqlPairs(store, [0])
    old_series, old_stalls = sql.series(), sql.stalls()
    # steps 1-3: 4 directed link-steps each; step 4: none (0 sent nothing and recorded no receive from 2,
    # 3 has no row); step 5: the 4; 0's transfer to itself on step 3; step 6: all six directed link-steps
    # (0's NULL send minimum: the receive)
    assert len(series["step"]) == 12 + 4 + 1 + 6
    assert np.count_nonzero(stalls["stall_s"] == 0) == 1 and np.isnan(stalls["stall_s"]).sum() == 0
    _equal(series, old_series, ["src", "dst", "step"])
    _equal(stalls, old_stalls, ["a", "b", "step"])


def test_sparse_steps_and_duplicates_go_to_the_sql(store: Store):
    sparse: list[Row] = [(r, t, p, 1, 1000, 1000, 10) for t in (0, 100, 200) for r, p in ((0, 2), (2, 0))]
    _peer_steps(store, sparse)
    assert read_pairs(store, []) is None   # 1 link x 201 steps for 6 rows
    rows = _hard_rows()
    _peer_steps(store, rows + [rows[5]])
    assert read_pairs(store, [0]) is None
    _peer_steps(store, [])
    assert read_pairs(store, [0]) is None


def test_column_medians_are_duckdbs(store: Store):
    rng = np.random.default_rng(0)
    m = rng.random((7, 50)) * 1e-3 + rng.random((7, 50)) * 1e-12
    m[rng.random(m.shape) < 0.3] = np.nan
    m[:, 0] = np.nan
    for rows in (m, m[:6], m[:1], np.nan_to_num(m[:6], nan=0.5)):
        cols = [(j, float(x)) for j in range(rows.shape[1]) for x in rows[:, j] if not np.isnan(x)]
        store.con.execute("CREATE OR REPLACE TEMP TABLE _m (j INT, x DOUBLE)")
        store.con.executemany("INSERT INTO _m VALUES (?, ?)", cols)
        duck = store.query("SELECT j, median(x) AS m FROM _m GROUP BY j")
        want = np.full(rows.shape[1], np.nan)
        want[duck.j.to_numpy()] = duck.m.to_numpy()
        np.testing.assert_array_equal(column_medians(rows), want)
