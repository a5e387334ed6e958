"""workload_imbalance detector on hand-made rank_step tables: what it must not call workload imbalance
(per-rank jitter, a replica slow every other step, pure data parallelism) and what it must."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.peer_stats import PEER_GRID_COLUMNS, load_grid
from megascope.analyzer.detect.stragglers import StragglerDetector
from megascope.analyzer.detect.workload_imbalance import WorkloadImbalanceDetector

DP, PP, TP, STEPS = 4, 2, 2, 20


@pytest.fixture(scope="module")
def stores(simulated_run):
    """A real Store (DuckDB over a simulated run's directory) per layout; each case puts its hand-made
    rows in the store's `rank_step`, the table the detector reads."""
    made: dict[tuple[int, int, int], Store] = {}

    def get(dp: int, pp: int, tp: int) -> Store:
        if (dp, pp, tp) not in made:
            made[dp, pp, tp] = Store(simulated_run(dp=dp, tp=tp, pp=pp, steps=2))
        return made[dp, pp, tp]
    return get


def table(replica_factor, rank_jitter: float = 0.005, dp: int = DP, pp: int = PP, tp: int = TP,
          seed: int = 0) -> pd.DataFrame:
    """rank_step rows; replica_factor(step, dp) scales the work of every rank of replica dp."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(STEPS):
        for s in range(pp):
            for d in range(dp):
                for t in range(tp):
                    work = 0.1 * replica_factor(step, d) * np.exp(rng.normal(0, rank_jitter))
                    rows.append(((s * dp + d) * tp + t, step, s, d, t, work / 3, 2 * work / 3, 0.5))
    return pd.DataFrame(rows, columns=["rank", "step", "pp", "dp", "tp", "forward_s", "backward_s", "step_time_s"])


def put(stores, df: pd.DataFrame) -> Store:
    store = stores(int(df.dp.max()) + 1, int(df.pp.max()) + 1, int(df.tp.max()) + 1)
    store.con.register("_case_rows", df)
    store.execute("CREATE OR REPLACE TEMP TABLE rank_step AS SELECT * FROM _case_rows")
    store.con.unregister("_case_rows")
    return store


def detect(stores, df: pd.DataFrame) -> list:
    return WorkloadImbalanceDetector().detect(DetectContext(put(stores, df)))


def test_random_replica_factor_is_found(stores):
    rng = np.random.default_rng(1)
    factors = np.exp(rng.normal(0, 0.12, size=(STEPS, DP)))
    found = detect(stores, table(lambda step, d: factors[step, d]))
    assert [f.kind for f in found] == ["workload_imbalance"]
    assert found[0].evidence["replicas"] == DP and found[0].evidence["ranks_per_replica"] == PP * TP
    assert found[0].hosts  # the ranks' hosts


def test_clean_and_persistent_slow_replica_are_not(stores):
    assert detect(stores, table(lambda step, d: 1.0)) == []
    # a replica 30% slower on every step (a slow host): a level, not a changing workload
    assert detect(stores, table(lambda step, d: 1.3 if d == 2 else 1.0)) == []
    # ... or from step 10 on: the rank's running level follows it
    assert detect(stores, table(lambda step, d: 1.3 if d == 2 and step >= 10 else 1.0)) == []


def test_same_replica_slow_every_other_step_is_not(stores):
    found = detect(stores, table(lambda step, d: 1.3 if d == 1 and step % 2 else 1.0))
    assert found == [], [f.evidence for f in found]


def test_per_rank_jitter_is_not(stores):
    # 15% jitter per rank, shared by no other rank of the replica: noise, however large
    assert detect(stores, table(lambda step, d: 1.0, rank_jitter=0.15)) == []


def test_one_rank_per_replica_abstains(stores):
    rng = np.random.default_rng(2)
    factors = np.exp(rng.normal(0, 0.2, size=(STEPS, DP)))
    assert detect(stores, table(lambda step, d: factors[step, d], pp=1, tp=1)) == []


def test_the_straggler_detectors_grid_is_taken_once(stores):
    df = table(lambda step, d: float(np.exp(np.random.default_rng(step * 10 + d).normal(0, 0.12))))
    df = df.assign(gap_s=0.001, own_s=df.forward_s + df.backward_s, gap_p2p_s=0.0)  # the straggler's columns
    store = put(stores, df)
    alone = WorkloadImbalanceDetector().detect(DetectContext(store))
    assert [f.kind for f in alone] == ["workload_imbalance"]
    ctx = DetectContext(store)
    StragglerDetector().detect(ctx)  # leaves its step_time_s and work_s in the context
    fresh = load_grid(store, PEER_GRID_COLUMNS)
    handed = ctx.take_peer_grid()
    assert handed is not None and ctx.take_peer_grid() is None  # once
    for name in ("ranks", "steps", "present", "pp", "dp", "tp", "host"):
        np.testing.assert_array_equal(getattr(handed, name), getattr(fresh, name))
    assert set(handed.values) == set(PEER_GRID_COLUMNS) and not handed.derived
    for column in PEER_GRID_COLUMNS:
        np.testing.assert_array_equal(handed[column], fresh[column])
    StragglerDetector().detect(ctx)
    assert ctx.peer_grid is not None
    assert WorkloadImbalanceDetector().detect(ctx) == alone  # through the context: the same finding
    assert ctx.peer_grid is None  # taken
