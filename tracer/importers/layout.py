"""The 3D layout of an imported job: sizes given on the command line, read from a job file, or
inferred from the process groups a dump lists; and the name (dp/tp/pp/world) of a group's rank list.

Rank order is Megatron-LM's, owned by `ParallelDims` (rank = (pp * dp + dp_idx) * tp + tp_idx); this
module only decides the sizes and never recomputes coordinates itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascope.trainer.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    vpp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, vpp=self.vpp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank."""
        c = self.dims.coords(rank)
        return c.pp, c.dp, c.tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return self.dims.rank_of(pp, dp, tp)

    def group_name(self, ranks: list[int]) -> str:
        """dp, tp, pp or world for a group's rank list; "" when it is none of this layout's groups.
        A group that is several kinds at once (dp == world when tp = pp = 1) takes the first of
        dp, tp, pp: the name our own tracer gives such a group."""
        members = sorted(int(r) for r in ranks)
        if len(members) <= 1:
            return ""
        dims = self.dims
        for name in ("dp", "tp", "pp"):
            if members in (sorted(g) for g in dims.group_ranks(name)):
                return name
        if members == list(range(self.world)):
            return "world"
        return ""

    def group_of(self, name: str, rank: int) -> list[int]:
        """Members of `rank`'s group of the given kind (world: every rank)."""
        return self.dims.peers(name, rank)

    def topology(self, ranks: list[int], hosts: dict[int, str] | None = None) -> dict:
        """The run.json topology block, listing the ranks the import holds (traces with one worker per
        (dp, stage) list only those)."""
        rows = []
        for rank in sorted(ranks):
            pp, dp, tp = self.coords(rank)
            host = (hosts or {}).get(rank, "unknown")
            rows.append({"rank": rank, "pp": pp, "dp": dp, "tp": tp, "host": host, "local_rank": 0})
        return {"world": self.world, "dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp,
                "ranks": rows}


def layout_from_sizes(world: int, dp: int | None, tp: int | None, pp: int | None, vpp: int | None = None,
                      groups: list[list[int]] | None = None) -> Layout:
    """Sizes from the command line win; missing ones come from the groups (when they pin them down),
    then from the world size (the rest is data parallel). Raises ValueError when they disagree."""
    tp_g, pp_g = _infer_from_groups(world, groups or [])
    tp = tp or (tp_g if dp is None or pp is None else None) or 1
    pp = pp or pp_g or 1
    if dp is None:
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by tp={tp} x pp={pp}; pass --dp/--tp/--pp")
        dp = world // (tp * pp)
    if dp * tp * pp != world:
        raise ValueError(f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp}, but the trace's world size is {world}; "
                         "pass sizes whose product is the world size")
    return Layout(dp=dp, tp=tp, pp=pp, vpp=vpp or 1)


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
