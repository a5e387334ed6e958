"""Who a rank talks to, from the topology table: its tp/dp/pp (and cp) groups and pipeline neighbours.

Megatron's groups: tp shares (pp, dp, cp), cp shares (pp, dp, tp), pp shares (dp, cp, tp), and dp -
the gradient group - shares (pp, tp), so with context parallelism it spans dp x cp ranks. A topology
without a cp column (the trainer, older runs) has cp = 0 everywhere.
"""

from __future__ import annotations

import pandas as pd

GROUP_DIMS = ("dp", "pp", "tp", "cp")
SHARED = {"tp": ("pp", "dp", "cp"), "cp": ("pp", "dp", "tp"), "pp": ("dp", "cp", "tp"), "dp": ("pp", "tp")}


def _with_cp(topology: pd.DataFrame) -> pd.DataFrame:
    return topology if "cp" in topology else topology.assign(cp=0)


def group_of_rank(topology: pd.DataFrame, rank: int, dim: str) -> list[int]:
    """Ranks of `rank`'s `dim` group: those sharing its coordinates of SHARED[dim] (itself included)."""
    topology = _with_cp(topology)
    me = topology[topology["rank"] == rank]
    if me.empty or dim not in GROUP_DIMS:
        return [rank]
    mask = pd.Series(True, index=topology.index)
    for other in SHARED[dim]:
        mask &= topology[other] == int(me.iloc[0][other])
    return sorted(int(r) for r in topology.loc[mask, "rank"])


def rank_neighbours(topology: pd.DataFrame, rank: int) -> dict[str, list[int]]:
    """Group peers and the pipeline neighbours activations come from and go to."""
    me = topology[topology["rank"] == rank]
    if me.empty:
        return {}
    dims = ("tp", "cp", "dp", "pp") if "cp" in topology and topology["cp"].max() > 0 else ("tp", "dp", "pp")
    peers = {f"{dim} group": group_of_rank(topology, rank, dim) for dim in dims}
    stage_of = topology.set_index("rank")["pp"]
    pipeline = peers["pp group"]
    stage = int(me.iloc[0]["pp"])
    peers["activations from (previous stage)"] = [r for r in pipeline if stage_of[r] == stage - 1]
    peers["activations to (next stage)"] = [r for r in pipeline if stage_of[r] == stage + 1]
    return peers


def rank_label(topology: pd.DataFrame, rank: int) -> str:
    """'rank 5 · pp1 dp0 tp1' ('... dp0 cp1 tp1' with context parallelism; just 'rank 5' when the
    topology does not list it)."""
    me = topology[topology["rank"] == rank]
    if me.empty:
        return f"rank {rank}"
    r = me.iloc[0]
    cp = f" cp{int(r['cp'])}" if "cp" in topology and topology["cp"].max() > 0 else ""
    return f"rank {rank} · pp{int(r['pp'])} dp{int(r['dp'])}{cp} tp{int(r['tp'])}"
