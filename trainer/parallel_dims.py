"""The one place that knows how ranks map to (pp, dp, tp) coordinates and owns the process groups.

Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (fastest), then data-parallel,
then pipeline stages outermost, so a tensor-parallel group stays inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    vpp: int = 1
    groups: dict[str, object] = field(default_factory=dict, repr=False)
    """Process groups of *this* rank by name: tp, dp, pp, mp (tp x pp), world; filled by build_groups."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> Coords:
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of the given kind, as lists of global ranks."""
        r = range
        if name == "tp":
            return [[self.rank_of(p, d, t) for t in r(self.tp)] for p in r(self.pp) for d in r(self.dp)]
        if name == "dp":
            return [[self.rank_of(p, d, t) for d in r(self.dp)] for p in r(self.pp) for t in r(self.tp)]
        if name == "pp":
            return [[self.rank_of(p, d, t) for p in r(self.pp)] for d in r(self.dp) for t in r(self.tp)]
        if name == "world":
            return [list(r(self.world_size))]
        raise KeyError(f"unknown group kind '{name}'")

    def peers(self, name: str, rank: int) -> list[int]:
        """The members of `rank`'s group of the given kind."""
        return next(g for g in self.group_ranks(name) if rank in g)

    def build_groups(self, method: str = "local") -> None:
        """Create the tp/dp/pp groups (size-1 groups too, so callers never special-case a degree of 1).

        method="local" (MegaScale 3.5): each rank creates only the three groups it belongs to, with
        `use_local_synchronization=True`, so a group's set-up synchronizes its members only (names
        come from the member list, so non-members need not take part) and no step waits on the whole
        world. method="enumeration" is the classic way: every rank calls new_group for every group of
        every kind (a torch rule without local synchronization), O(groups) calls on every rank."""
        self.groups["world"] = dist.group.WORLD
        if method == "enumeration":
            for name in ("tp", "dp", "pp"):
                mine, _ = dist.new_subgroups_by_enumeration(self.group_ranks(name))
                self.groups[name] = mine
            return
        if method != "local":
            raise ValueError(f"group creation method '{method}' unknown; use local or enumeration")
        rank = dist.get_rank()
        for name in ("tp", "dp", "pp"):
            self.groups[name] = dist.new_group(self.peers(name, rank), use_local_synchronization=True,
                                               group_desc=f"megascope_{name}")

    def topology(self, hosts: list[str] | None = None, local_ranks: list[int] | None = None) -> dict:
        """The topology block of run.json."""
        ranks = []
        for rank in range(self.world_size):
            c = self.coords(rank)
            ranks.append({"rank": rank, "pp": c.pp, "dp": c.dp, "tp": c.tp,
                          "host": hosts[rank] if hosts else "localhost",
                          "local_rank": local_ranks[rank] if local_ranks else rank})
        return {"world": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "vpp": self.vpp, "ranks": ranks}
