"""workload_imbalance detector on hand-made rank_step tables: what it must not call workload imbalance
(per-rank jitter, a replica slow every other step, pure data parallelism) and what it must."""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.workload_imbalance import WorkloadImbalanceDetector

DP, PP, TP, STEPS = 4, 2, 2, 20


class FakeStore:
    """The two things the detector reads: the rank_step query and the topology."""

    def __init__(self, table: pd.DataFrame) -> None:
        self.table = table
        self.topology = (table[["rank", "pp", "dp"]].drop_duplicates()
                         .assign(host=lambda t: "h" + (t["rank"] // 8).astype(str)))

    def query(self, sql: str, params=None) -> pd.DataFrame:
        assert "FROM rank_step" in sql
        return self.table[["rank", "step", "pp", "dp"]].assign(
            work_s=self.table.forward_s + self.table.backward_s, step_time_s=self.table.step_time_s)


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
                    rows.append(((s * dp + d) * tp + t, step, s, d, work / 3, 2 * work / 3, 0.5))
    return pd.DataFrame(rows, columns=["rank", "step", "pp", "dp", "forward_s", "backward_s", "step_time_s"])


def detect(df: pd.DataFrame) -> list:
    return WorkloadImbalanceDetector().detect(FakeStore(df))


def test_random_replica_factor_is_found():
    rng = np.random.default_rng(1)
    factors = np.exp(rng.normal(0, 0.12, size=(STEPS, DP)))
    found = detect(table(lambda step, d: factors[step, d]))
    assert [f.kind for f in found] == ["workload_imbalance"]
    assert found[0].evidence["replicas"] == DP and found[0].evidence["ranks_per_replica"] == PP * TP
    assert found[0].hosts  # the ranks' hosts


def test_clean_and_persistent_slow_replica_are_not():
    assert detect(table(lambda step, d: 1.0)) == []
    # a replica 30% slower on every step (a slow host): a level, not a changing workload
    assert detect(table(lambda step, d: 1.3 if d == 2 else 1.0)) == []
    # ... or from step 10 on: the rank's running level follows it
    assert detect(table(lambda step, d: 1.3 if d == 2 and step >= 10 else 1.0)) == []


def test_same_replica_slow_every_other_step_is_not():
    found = detect(table(lambda step, d: 1.3 if d == 1 and step % 2 else 1.0))
    assert found == [], [f.evidence for f in found]


def test_per_rank_jitter_is_not():
    # 15% jitter per rank, shared by no other rank of the replica: noise, however large
    assert detect(table(lambda step, d: 1.0, rank_jitter=0.15)) == []


def test_one_rank_per_replica_abstains():
    rng = np.random.default_rng(2)
    factors = np.exp(rng.normal(0, 0.2, size=(STEPS, DP)))
    assert detect(table(lambda step, d: factors[step, d], pp=1, tp=1)) == []
