"""The layout of an imported job: sizes given on the command line, read from a job file, or
inferred from the process groups a dump lists. The rank arithmetic itself (Megatron order, group
membership, the run.json topology block) is tracer/layout.py's `Layout`.
"""

from __future__ import annotations

from megascope.tracer.layout import Layout


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
