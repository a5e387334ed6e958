"""Collective group instances from the topology: which ranks share one instance of a group.

Events name their group (`dp`, `tp`, `pp`, `world`, `embedding`, ...) and a per-group `seq`; the
same op on all members of one group instance has the same seq. The instance key here is what the
members share: dp peers share (pp, tp), tp peers (pp, dp), pp peers (dp, tp); the trainer's
`embedding` group (first and last stage ranks with the same dp/tp coordinates) is keyed like pp;
`world` is one instance. Any other group name is not matched across ranks (instance NULL): it still
counts in each rank's own time, but arrival skew is not judged on a group we cannot reconstruct.

When ranks are numbered regularly (rank = (pp * dp_size + dp) * tp_size + tp, as the trainer and the
simulator do) the key is rank arithmetic, which saves a join per event on 10^8-event scans.
"""

from __future__ import annotations

import pandas as pd

MATCHED_GROUPS = ("dp", "tp", "pp", "world", "embedding")


def is_regular(topology: pd.DataFrame, dp: int, tp: int) -> bool:
    """True when rank = (pp * dp + dp_coord) * tp + tp_coord for every rank."""
    expect = (topology.pp * dp + topology.dp) * tp + topology.tp
    return bool((expect == topology["rank"]).all())


def instance_sql(topology: pd.DataFrame, dp: int, tp: int, table: str = "") -> str:
    """SQL expression of the group instance of an event row (columns "group", rank; with a joined
    topology row `table`.pp/dp/tp when the ranks are not numbered regularly)."""
    if is_regular(topology, dp, tp):
        pp_c, dp_c, tp_c = f"(rank // {dp * tp})", f"((rank // {tp}) % {dp})", f"(rank % {tp})"
    else:
        pp_c, dp_c, tp_c = (f"{table}.pp", f"{table}.dp", f"{table}.tp")
    return (f"""CASE "group" WHEN 'dp' THEN {pp_c} * {tp} + {tp_c} WHEN 'tp' THEN {pp_c} * {dp} + {dp_c} """
            f"""WHEN 'pp' THEN {dp_c} * {tp} + {tp_c} WHEN 'embedding' THEN {dp_c} * {tp} + {tp_c} """
            f"""WHEN 'world' THEN 0 ELSE NULL END""")


def group_members(topology: pd.DataFrame, dp: int, tp: int, pp: int, group: str, instance: int) -> list[int]:
    """Global ranks of one group instance (the inverse of instance_sql)."""
    topo = topology
    if group == "dp":
        sel = (topo.pp == instance // tp) & (topo.tp == instance % tp)
    elif group == "tp":
        sel = (topo.pp == instance // dp) & (topo.dp == instance % dp)
    elif group in ("pp", "embedding"):
        sel = (topo.dp == instance // tp) & (topo.tp == instance % tp)
        if group == "embedding":
            sel &= topo.pp.isin([0, pp - 1])
    elif group == "world":
        sel = topo["rank"] >= 0
    else:
        sel = topo["rank"] < 0
    return topo.loc[sel, "rank"].astype(int).tolist()


def instance_keys(events: pd.DataFrame, topology: pd.DataFrame, dp: int, tp: int) -> pd.Series:
    """The same instance key for a frame of collective events (group, rank): NaN for unknown groups."""
    coords = topology.set_index("rank")[["pp", "dp", "tp"]]
    c = coords.reindex(events["rank"].to_numpy())
    pp_c, dp_c, tp_c = c.pp.to_numpy(), c.dp.to_numpy(), c.tp.to_numpy()
    group = events["group"].to_numpy()
    key = pd.Series(float("nan"), index=events.index)
    for name, value in (("dp", pp_c * tp + tp_c), ("tp", pp_c * dp + dp_c), ("pp", dp_c * tp + tp_c),
                        ("embedding", dp_c * tp + tp_c), ("world", 0 * pp_c)):
        mask = group == name
        key[mask] = value[mask]
    return key
