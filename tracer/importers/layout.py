"""The layout of an imported job: sizes given on the command line, read from a job file, or
inferred from the process groups a dump lists; and the name (dp/tp/pp/cp/world) of a group's rank list.

Rank order is Megatron-LM's, tp fastest, then cp (context/sequence parallel), dp, pp:
rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp)). With cp = 1 this is the trainer's
`ParallelDims` order (tests/test_import_ndtimeline.py checks that they agree). Groups follow
Megatron's: tp shares (pp, dp, cp); cp shares (pp, dp, tp); pp shares (dp, cp, tp); dp is the
gradient group, which with context parallelism spans dp x cp ranks (Megatron's data-parallel group
with context parallelism) and shares (pp, tp).
"""

from __future__ import annotations

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

    def topology(self, ranks: list[int], hosts: dict[int, str] | None = None) -> dict:
        """The run.json topology block, listing the ranks the import holds (traces with one worker per
        (dp, stage) list only those). `cp` is written only for context-parallel jobs: readers take a
        missing cp as 1 (coordinate 0), so runs stay readable by older megascope versions."""
        rows = []
        for rank in sorted(ranks):
            pp, dp, tp = self.coords(rank)
            host = (hosts or {}).get(rank, "unknown")
            row = {"rank": rank, "pp": pp, "dp": dp, "tp": tp, "host": host, "local_rank": 0}
            if self.cp > 1:
                row["cp"] = self.cp_of(rank)
            rows.append(row)
        out = {"world": self.world, "dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ranks": rows}
        if self.cp > 1:
            out["cp"] = self.cp
        return out


def layout_from_sizes(world: int, dp: int | None, tp: int | None, pp: int | None, vpp: int | None = None,
                      groups: list[list[int]] | None = None, cp: int | None = None) -> Layout:
    """Sizes from the command line win; missing ones come from the groups (when they pin them down),
    then from the world size (the rest is data parallel). Raises ValueError when they disagree."""
    tp_g, pp_g = _infer_from_groups(world, groups or [])
    tp = tp or (tp_g if dp is None or pp is None else None) or 1
    pp = pp or pp_g or 1
    cp = cp or 1
    if dp is None:
        if world % (tp * cp * pp):
            raise ValueError(f"world size {world} is not divisible by tp={tp} x cp={cp} x pp={pp}; "
                             "pass --dp/--tp/--pp/--cp")
        dp = world // (tp * cp * pp)
    layout = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp or 1, cp=cp)
    if layout.world != world:
        raise ValueError(f"{sizes_text(layout)} = {layout.world}, but the trace's world size is {world}; "
                         "pass sizes whose product is the world size")
    return layout


def sizes_text(layout: Layout) -> str:
    """'dp=32 x cp=2 x tp=1 x pp=2' (cp only when > 1): for messages."""
    cp = f" x cp={layout.cp}" if layout.cp > 1 else ""
    return f"dp={layout.dp}{cp} x tp={layout.tp} x pp={layout.pp}"


def _infer_from_groups(world: int, groups: list[list[int]]) -> tuple[int | None, int | None]:
    """(tp, pp) from the strides of the groups: a group of consecutive ranks smaller than the world is
    tensor parallel (Megatron puts tp ranks next to each other); a group whose stride is world/size is
    pipeline parallel. Ambiguous layouts (one group kind only) leave the sizes to the caller."""
    tp = pp = None
    for members in groups:
        members = sorted(set(int(r) for r in members))
        n = len(members)
        if n <= 1 or n >= world:
            continue
        stride = members[1] - members[0]
        if any(b - a != stride for a, b in zip(members, members[1:])):
            continue
        if stride * n == world and stride > 1:
            pp = max(pp or 1, n)
        elif stride == 1 and (world // n) > 1:
            # consecutive ranks: tp, unless another group shows they are a dp group of a pipeline
            tp = max(tp or 1, n) if not _is_dp_of_pipeline(n, groups, world) else tp
    return tp, pp


def _is_dp_of_pipeline(n: int, groups: list[list[int]], world: int) -> bool:
    """With tp = 1 and pp > 1, the dp groups are consecutive too: tell them from tp by the pp groups."""
    for members in groups:
        members = sorted(set(int(r) for r in members))
        if 1 < len(members) < world and len(members) > 1 and members[1] - members[0] == n \
                and n * len(members) == world:
            return True
    return False
