"""The layout of an attached job: which rank holds which (pp, dp, cp, tp) coordinates, which named
group (dp, tp, pp, cp, world) a process group is, and the run.json topology block.

Three sources, as `megascope.tracer.attach` takes them:
  - explicit sizes (dp, tp, pp, cp; missing dp = world / (tp x cp x pp)): Megatron rank order, tp
    fastest, then cp, dp, pp (the trainer's and the importers' order, tracer/importers/layout.py);
  - a torch DeviceMesh: each rank's coordinates are read from the mesh itself, so a mesh in any
    dimension order is described as it is (the analyzer joins on the topology when the ranks are not
    numbered in Megatron order);
  - nothing: every rank is data parallel (world = dp).
Groups follow Megatron's, as the analyzer matches them (analyzer/data/group_instances.py): tp peers share
(pp, dp, cp), cp peers (pp, dp, tp), pp peers (dp, cp, tp), and dp is the gradient group, which with
context parallelism spans dp x cp and shares (pp, tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megascope.tracer.layout import Layout

KINDS = ("dp", "tp", "pp", "cp")
_AXES = ("pp", "dp", "cp", "tp")
"""Coordinate order of a rank's tuple (outermost first)."""
_SHARED = {"tp": ("pp", "dp", "cp"), "cp": ("pp", "dp", "tp"), "pp": ("dp", "cp", "tp"), "dp": ("pp", "tp")}
"""The coordinates a group's members share (the others vary inside the group)."""

MESH_DIMS = {"dp": "dp", "dp_replicate": "dp", "dp_shard": "dp", "fsdp": "dp", "ddp": "dp", "hsdp": "dp",
             "tp": "tp", "pp": "pp", "cp": "cp"}
"""DeviceMesh dimension names and the kind they are (torchtitan's pp, dp_replicate, dp_shard, cp, tp;
the data-parallel ones together make the dp coordinate, replicate outermost)."""


@dataclass(frozen=True)
class AttachLayout:
    sizes: dict[str, int]
    """dp, tp, pp, cp."""
    coords: tuple[tuple[int, int, int, int], ...]
    """(pp, dp, cp, tp) of each global rank, indexed by rank."""

    @property
    def world(self) -> int:
        return len(self.coords)

    def coord(self, rank: int, kind: str) -> int:
        return self.coords[rank][_AXES.index(kind)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """Members of `rank`'s group of that kind (dp, tp, pp, cp; world: every rank), ascending."""
        if kind == "world":
            return list(range(self.world))
        keep = [_AXES.index(a) for a in _SHARED[kind]]
        mine = [self.coords[rank][i] for i in keep]
        return [r for r, c in enumerate(self.coords) if [c[i] for i in keep] == mine]

    def group_name(self, ranks: list[int]) -> str:
        """dp, tp, pp, cp or world for a process group's members; "" for any other group. A group
        that is several kinds at once (dp = world when tp = pp = cp = 1) is the first of dp, tp, pp, cp,
        the name the trainer's tracer gives it."""
        members = sorted(int(r) for r in ranks)
        if len(members) <= 1 or members[0] < 0 or members[-1] >= self.world:
            return ""
        for kind in KINDS:
            if members == self.group_of(kind, members[0]):
                return kind
        return "world" if members == list(range(self.world)) else ""

    def p2p_group(self, rank: int, peer: int) -> str:
        """The group a transfer between two ranks belongs to, whatever process group carried it
        (pipeline code often sends on the world group): pp first, then dp, tp, cp; "" when none."""
        if not (0 <= peer < self.world) or peer == rank:
            return ""
        for kind in ("pp", "dp", "tp", "cp"):
            if peer in self.group_of(kind, rank):
                return kind
        return ""

    def topology(self, hosts: list[str], local_ranks: list[int]) -> dict[str, Any]:
        """The run.json topology block (cp only when > 1, as the importers write it)."""
        cp = self.sizes["cp"] > 1
        rows = []
        for rank, (pp, dp, cpc, tp) in enumerate(self.coords):
            row = {"rank": rank, "pp": pp, "dp": dp, "tp": tp, "host": hosts[rank], "local_rank": local_ranks[rank]}
            if cp:
                row["cp"] = cpc
            rows.append(row)
        out: dict[str, Any] = {"world": self.world, **{k: self.sizes[k] for k in ("dp", "tp", "pp")}, "vpp": 1,
                               "ranks": rows}
        if cp:
            out["cp"] = self.sizes["cp"]
        return out


def from_sizes(world: int, dp: int | None = None, tp: int | None = None, pp: int | None = None,
               cp: int | None = None) -> AttachLayout:
    """Megatron order; missing sizes are 1, except dp, which takes what the others leave of the world."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"attach: {name}={value!r} is not a positive integer")
    tp, pp, cp = tp or 1, pp or 1, cp or 1
    if dp is None:
        if world % (tp * pp * cp):
            raise ValueError(f"attach: the world size {world} is not divisible by tp={tp} x pp={pp} x cp={cp}; "
                             "pass sizes whose product is the world size")
        dp = world // (tp * pp * cp)
    if dp * tp * pp * cp != world:
        raise ValueError(f"attach: dp={dp} x tp={tp} x pp={pp} x cp={cp} = {dp * tp * pp * cp}, but the world "
                         f"size is {world}; pass sizes whose product is the world size")
    lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp)
    coords = tuple((*lay.coords(r)[:2], lay.cp_of(r), lay.coords(r)[2]) for r in range(world))
    return AttachLayout({"dp": dp, "tp": tp, "pp": pp, "cp": cp}, coords)


def from_mesh(mesh: Any, world: int) -> AttachLayout:
    """Coordinates from a DeviceMesh (the job's root mesh, spanning every rank)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("attach: the DeviceMesh has no mesh_dim_names; create it with "
                         f"mesh_dim_names (any of {', '.join(MESH_DIMS)}) or pass dp/tp/pp/cp sizes")
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ValueError(f"attach: DeviceMesh dimension(s) {', '.join(unknown)} are not one of "
                         f"{', '.join(MESH_DIMS)}; rename them or pass dp/tp/pp/cp sizes")
    grid = mesh.mesh
    if grid.numel() != world:
        raise ValueError(f"attach: the DeviceMesh holds {grid.numel()} ranks, the world {world}; "
                         "pass the job's root mesh, not a sub-mesh")
    sizes = {k: 1 for k in KINDS}
    for name, size in zip(names, grid.shape):
        sizes[MESH_DIMS[name]] *= int(size)
    coords: dict[int, tuple[int, int, int, int]] = {}
    for index, rank in _enumerate_grid(grid.tolist(), ()):
        value = dict.fromkeys(KINDS, 0)
        for name, size, i in zip(names, grid.shape, index):
            kind = MESH_DIMS[name]
            value[kind] = value[kind] * int(size) + i  # several dp dimensions: the outer one is major
        coords[int(rank)] = (value["pp"], value["dp"], value["cp"], value["tp"])
    if sorted(coords) != list(range(world)):
        raise ValueError(f"attach: the DeviceMesh does not hold ranks 0..{world - 1} once each")
    return AttachLayout(sizes, tuple(coords[r] for r in range(world)))


def _enumerate_grid(grid: Any, index: tuple[int, ...]):
    if not isinstance(grid, list):
        yield index, grid
        return
    for i, sub in enumerate(grid):
        yield from _enumerate_grid(sub, index + (i,))


def resolve(world: int, layout: Any = None, dp: int | None = None, tp: int | None = None,
            pp: int | None = None, cp: int | None = None) -> AttachLayout:
    """attach's `layout` argument: None, a DeviceMesh, a mapping of sizes, or an AttachLayout;
    dp/tp/pp/cp keywords are the sizes given one by one (not with a mesh)."""
    if isinstance(layout, AttachLayout):
        if layout.world != world:
            raise ValueError(f"attach: the layout has {layout.world} ranks, the world {world}")
        return layout
    if layout is not None and hasattr(layout, "mesh") and hasattr(layout, "mesh_dim_names"):
        if any(v is not None for v in (dp, tp, pp, cp)):
            raise ValueError("attach: pass a DeviceMesh or dp/tp/pp/cp sizes, not both")
        return from_mesh(layout, world)
    if isinstance(layout, Mapping):
        extra = set(layout) - set(KINDS)
        if extra:
            raise ValueError(f"attach: layout keys {', '.join(sorted(extra))} unknown; use dp, tp, pp, cp")
        merged = {**layout, **{k: v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)) if v is not None}}
        return from_sizes(world, **merged)
    if layout is not None:
        raise TypeError(f"attach: layout must be a DeviceMesh, a dict of dp/tp/pp/cp sizes or None, "
                        f"not {type(layout).__name__}")
    return from_sizes(world, dp, tp, pp, cp)
