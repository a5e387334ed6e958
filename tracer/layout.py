"""Rank arithmetic of a 3D(+cp)-parallel job, with no dependencies: the one place that maps a rank to
its (pp, dp, tp, cp) coordinates and back, and names its groups. The trainer's process groups
(trainer/parallel/parallel_dims.py), the importers, the simulator and the analyzer's group instances all use it.

Rank order is Megatron-LM's, tp fastest, then cp (context/sequence parallel), dp, pp:
rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp)), so a tensor-parallel group stays inside
one node. Groups follow Megatron's: tp shares (pp, dp, cp); cp shares (pp, dp, tp); pp shares
(dp, cp, tp); dp is the gradient group, which with context parallelism spans dp x cp ranks
(Megatron's data-parallel group with context parallelism) and shares (pp, tp).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GROUP_KINDS = ("dp", "tp", "pp", "cp")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    vpp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank (cp_of gives its cp coordinate)."""
        tp = rank % self.tp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return pp, dp, tp

    def cp_of(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_of(self, name: str, rank: int) -> list[int]:
        """Members of `rank`'s group of the given kind (dp, tp, pp, cp; world: every rank), ascending."""
        if name == "world":
            return list(range(self.world))
        pp, dp, tp = self.coords(rank)
        cp = self.cp_of(rank)
        if name == "tp":
            return [self.rank_of(pp, dp, t, cp) for t in range(self.tp)]
        if name == "cp":
            return [self.rank_of(pp, dp, tp, c) for c in range(self.cp)]
        if name == "pp":
            return [self.rank_of(p, dp, tp, cp) for p in range(self.pp)]
        if name == "dp":
            return sorted(self.rank_of(pp, d, tp, c) for d in range(self.dp) for c in range(self.cp))
        raise KeyError(f"unknown group kind '{name}'")

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of the given kind, as lists of global ranks."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world):
            if rank not in seen:
                members = self.group_of(name, rank)
                seen.update(members)
                out.append(members)
        return out

    def group_name(self, ranks: list[int]) -> str:
        """dp, tp, pp, cp or world for a group's rank list; "" when it is none of this layout's groups.
        A group that is several kinds at once (dp == world when tp = pp = 1) takes the first of
        dp, tp, pp, cp: the name our own tracer gives such a group."""
        members = sorted(int(r) for r in ranks)
        if len(members) <= 1 or members[0] < 0 or members[-1] >= self.world:
            return ""
        for name in GROUP_KINDS:
            if members == self.group_of(name, members[0]):
                return name
        if members == list(range(self.world)):
            return "world"
        return ""

    def topology(self, ranks: Iterable[int], hosts: dict[int, str] | None = None,
                 local_ranks: dict[int, int] | None = None) -> dict:
        """The run.json topology block, listing the ranks the run holds (imported traces with one worker
        per (dp, stage) list only those). `cp` is written only for context-parallel jobs: readers take
        a missing cp as 1 (coordinate 0), so runs stay readable by older megascope versions."""
        rows = []
        for rank in sorted(ranks):
            pp, dp, tp = self.coords(rank)
            row = {"rank": rank, "pp": pp, "dp": dp, "tp": tp, "host": (hosts or {}).get(rank, "unknown"),
                   "local_rank": (local_ranks or {}).get(rank, 0)}
            if self.cp > 1:
                row["cp"] = self.cp_of(rank)
            rows.append(row)
        out = {"world": self.world, "dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ranks": rows}
        if self.cp > 1:
            out["cp"] = self.cp
        return out
