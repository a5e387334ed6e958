"""Collective group instances from the topology: which ranks share one instance of a group.

Events name their group (`dp`, `tp`, `pp`, `cp`, `world`, `embedding`, ...) and a per-group `seq`; the
same op on all members of one group instance has the same seq. The instance key here is what the
members share: tp peers share (pp, dp, cp), cp peers (pp, dp, tp), pp peers (dp, cp, tp); dp peers
share (pp, tp): with context parallelism the gradient group spans dp x cp ranks (Megatron's
data-parallel group with context parallelism); the trainer's `embedding` group (first and last stage
ranks with the same dp/cp/tp coordinates) is keyed like pp; `world` is one instance. Any other group
name is not matched across ranks (instance NULL): it still counts in each rank's own time, but
arrival skew is not judged on a group we cannot reconstruct.

A topology without a `cp` column (the trainer, runs written before context parallelism) has cp = 1.
When ranks are numbered regularly (Megatron order: rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp)),
as the trainer, the simulator and the importers do) the key is rank arithmetic, which saves a join per
event on 10^8-event scans.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.tracer.layout import Layout

MATCHED_GROUPS = ("dp", "tp", "pp", "cp", "world", "embedding")


def cp_size(topology: pd.DataFrame) -> int:
    """The context-parallel size a topology frame shows (1 without a cp column). Callers that have
    run.json pass its topology.cp instead; this serves those that only have the frame."""
    if "cp" not in topology or topology.empty:
        return 1
    return int(topology["cp"].max()) + 1


def _cp_coords(topology: pd.DataFrame) -> pd.Series:
    return topology["cp"] if "cp" in topology else pd.Series(0, index=topology.index)


def is_regular(topology: pd.DataFrame, dp: int, tp: int, cp: int | None = None) -> bool:
    """True when rank = tp_c + tp * (cp_c + cp * (dp_c + dp * pp_c)) for every rank."""
    order = Layout(dp=dp, tp=tp, pp=1, cp=cp or cp_size(topology))  # rank_of needs no pp size
    expect = order.rank_of(topology.pp, topology.dp, topology.tp, _cp_coords(topology))
    return bool((expect == topology["rank"]).all())


def _keys(pp_c, dp_c, tp_c, cp_c, dp: int, tp: int, cp: int) -> dict[str, object]:
    """Instance key per group kind from coordinates (ints, numpy arrays or SQL expression strings)."""
    if isinstance(pp_c, str):
        return {"dp": f"{pp_c} * {tp} + {tp_c}",
                "tp": f"({pp_c} * {dp} + {dp_c}) * {cp} + {cp_c}",
                "pp": f"({dp_c} * {cp} + {cp_c}) * {tp} + {tp_c}",
                "cp": f"({pp_c} * {dp} + {dp_c}) * {tp} + {tp_c}"}
    return {"dp": pp_c * tp + tp_c,
            "tp": (pp_c * dp + dp_c) * cp + cp_c,
            "pp": (dp_c * cp + cp_c) * tp + tp_c,
            "cp": (pp_c * dp + dp_c) * tp + tp_c}


def instance_sql(topology: pd.DataFrame, dp: int, tp: int, table: str = "", cp: int | None = None) -> str:
    """SQL expression of the group instance of an event row (columns "group", rank; with a joined
    topology row `table`.pp/dp/tp/cp when the ranks are not numbered regularly)."""
    cp = cp or cp_size(topology)
    if is_regular(topology, dp, tp, cp):
        pp_c, dp_c = f"(rank // {dp * cp * tp})", f"((rank // {cp * tp}) % {dp})"
        tp_c, cp_c = f"(rank % {tp})", f"((rank // {tp}) % {cp})"
    else:
        pp_c, dp_c, tp_c, cp_c = (f"{table}.pp", f"{table}.dp", f"{table}.tp", f"{table}.cp")
    k = _keys(pp_c, dp_c, tp_c, cp_c, dp, tp, cp)
    return (f"""CASE "group" WHEN 'dp' THEN {k['dp']} WHEN 'tp' THEN {k['tp']} WHEN 'pp' THEN {k['pp']} """
            f"""WHEN 'embedding' THEN {k['pp']} WHEN 'cp' THEN {k['cp']} WHEN 'world' THEN 0 ELSE NULL END""")


def group_members(topology: pd.DataFrame, dp: int, tp: int, pp: int, group: str, instance: int,
                  cp: int | None = None) -> list[int]:
    """Global ranks of one group instance (the inverse of instance_sql)."""
    cp = cp or cp_size(topology)
    if group not in ("dp", "tp", "pp", "cp", "embedding", "world"):
        return []
    if group == "world":
        return topology["rank"].astype(int).tolist()
    c = topology
    keys = _keys(c.pp.to_numpy(), c.dp.to_numpy(), c.tp.to_numpy(), _cp_coords(c).to_numpy(), dp, tp, cp)
    sel = keys["pp" if group == "embedding" else group] == instance
    if group == "embedding":
        sel &= c.pp.isin([0, pp - 1]).to_numpy()
    return c.loc[sel, "rank"].astype(int).tolist()


def instance_keys(events: pd.DataFrame, topology: pd.DataFrame, dp: int, tp: int,
                  cp: int | None = None) -> pd.Series:
    """The same instance key for a frame of collective events (group, rank): NaN for unknown groups."""
    cp = cp or cp_size(topology)
    topo = topology.assign(cp=_cp_coords(topology))
    c = topo.set_index("rank")[["pp", "dp", "tp", "cp"]].reindex(events["rank"].to_numpy())
    keys = _keys(c.pp.to_numpy(), c.dp.to_numpy(), c.tp.to_numpy(), c.cp.to_numpy(), dp, tp, cp)
    keys["embedding"], keys["world"] = keys["pp"], 0 * c.pp.to_numpy()
    group = events["group"].to_numpy()
    key = pd.Series(float("nan"), index=events.index)
    for name, value in keys.items():
        mask = group == name
        key[mask] = np.asarray(value)[mask]
    return key
