"""The trainer's parallel layout: this rank's coordinates and the process groups it owns.

The rank arithmetic (Megatron-LM order: tensor-parallel ranks adjacent, then data-parallel, pipeline
stages outermost, so a tensor-parallel group stays inside one node) is tracer/layout.py's, shared with
the importers, the simulator and the analyzer; this module adds the torch.distributed groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from megascope.tracer.layout import Layout


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
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    """Process groups of *this* rank by name: tp, dp, pp, mp (tp x pp), world; filled by build_groups."""

    @cached_property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, vpp=self.vpp)

    @property
    def world_size(self) -> int:
        return self.layout.world

    def coords(self, rank: int) -> Coords:
        return Coords(*self.layout.coords(rank))

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return self.layout.rank_of(pp, dp, tp)

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of the given kind (tp, dp, pp, world), as lists of global ranks."""
        return self.layout.group_ranks(name)

    def peers(self, name: str, rank: int) -> list[int]:
        """The members of `rank`'s group of the given kind."""
        return self.layout.group_of(name, rank)

    def build_groups(self, method: str = "local") -> None:
        """Create the tp/dp/pp groups (size-1 groups too, so callers never special-case a degree of 1).

        method="local" (MegaScale 3.5): each rank creates only the three groups it belongs to, with
        `use_local_synchronization=True`, so a group's set-up synchronizes its members only (names
        come from the member list, so non-members need not take part) and no step waits on the whole
        world. method="enumeration" is the classic way: every rank calls new_group for every group of
        every kind (a torch rule without local synchronization), O(groups) calls on every rank."""
        world = dist.group.WORLD
        assert world is not None, "build_groups runs after init_process_group"
        self.groups["world"] = world
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
        """The topology block of run.json (one process per rank on localhost unless told otherwise)."""
        world = range(self.world_size)
        return self.layout.topology(world, hosts={r: hosts[r] if hosts else "localhost" for r in world},
                                    local_ranks={r: local_ranks[r] if local_ranks else r for r in world})
