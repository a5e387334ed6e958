"""Who a rank talks to, from the topology table: its tp/dp/pp groups and pipeline neighbours."""

from __future__ import annotations

import pandas as pd

GROUP_DIMS = ("dp", "pp", "tp")


def group_members(topology: pd.DataFrame, rank: int, dim: str) -> list[int]:
    """Ranks of `rank`'s `dim` group: those sharing its other two coordinates (itself included)."""
    me = topology[topology["rank"] == rank]
    if me.empty or dim not in GROUP_DIMS:
        return [rank]
    mask = pd.Series(True, index=topology.index)
    for other in GROUP_DIMS:
        if other != dim:
            mask &= topology[other] == int(me.iloc[0][other])
    return sorted(int(r) for r in topology.loc[mask, "rank"])


def rank_neighbours(topology: pd.DataFrame, rank: int) -> dict[str, list[int]]:
    """Group peers and the pipeline neighbours activations come from and go to."""
    me = topology[topology["rank"] == rank]
    if me.empty:
        return {}
    peers = {f"{dim} group": group_members(topology, rank, dim) for dim in ("tp", "dp", "pp")}
    stage_of = topology.set_index("rank")["pp"]
    pipeline = peers["pp group"]
    stage = int(me.iloc[0]["pp"])
    peers["activations from (previous stage)"] = [r for r in pipeline if stage_of[r] == stage - 1]
    peers["activations to (next stage)"] = [r for r in pipeline if stage_of[r] == stage + 1]
    return peers


def rank_label(topology: pd.DataFrame, rank: int) -> str:
    """'rank 5 · pp1 dp0 tp1' (or just 'rank 5' when the topology does not list it)."""
    me = topology[topology["rank"] == rank]
    if me.empty:
        return f"rank {rank}"
    r = me.iloc[0]
    return f"rank {rank} · pp{int(r['pp'])} dp{int(r['dp'])} tp{int(r['tp'])}"
