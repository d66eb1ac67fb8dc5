"""A parameter's DTensor layout, as the C++ core takes it: (mesh shape, ranks in the load's group,
placements as (kind, dim, split factor)), the world layout rebuilt for DTensors on a sub-mesh, and the
table of distinct layouts a load or save passes once."""
from __future__ import annotations

from ._shardcast import Unsupported


def _placement(p, ndim: int, where: str):
    """(kind, dim, split factor) of one DTensor placement: 0 Replicate, 1 Shard, 2 _StridedShard."""
    from torch.distributed.tensor import Replicate, Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch
        _StridedShard = ()
    if isinstance(p, Replicate):
        return (0, 0, 1)
    if _StridedShard and isinstance(p, _StridedShard):
        return (2, p.dim % ndim if ndim else p.dim, int(p.split_factor))
    if isinstance(p, Shard):
        return (1, p.dim % ndim if ndim else p.dim, 1)
    raise Unsupported(f"{where}: placement {p} (shardcast loads Shard, _StridedShard and Replicate; a Partial "
                      "placement has no checkpoint value)")


def _group_ranks(pg, world: int):
    """{global rank: rank in pg} for the process group the load runs over."""
    import torch.distributed as dist
    if pg is None:
        return None
    try:
        ranks = dist.get_process_group_ranks(pg)
    except Exception:  # noqa: BLE001 -- the default group
        return None
    if ranks == list(range(world)):
        return None
    return {g: i for i, g in enumerate(ranks)}


def _root_mesh(mesh):
    """The mesh `mesh` was sliced from (itself if it was not), by the API this torch has."""
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    try:  # torch 2.6-2.8
        from torch.distributed.device_mesh import _mesh_resources
        return _mesh_resources.get_root_mesh(mesh)
    except Exception:  # noqa: BLE001
        return mesh


def _whole_mesh(mesh):
    """(mesh shape, ranks) of the layout a DTensor on `mesh` has over the whole world.

    A DTensor on a submesh (FSDP's dp slice of a (dp, tp) mesh) sees only its own slice: rank 0 sees
    ranks [0, 2], rank 1 [1, 3]. Every slice of the root mesh holds the same pieces, so the layout over
    the world has one more, leading, Replicate dim: the slices, each in the order its own ranks list.
    Derived from the root mesh alone, it is the same on every rank.
    """
    import itertools
    sub = mesh.mesh.flatten().tolist()
    root = _root_mesh(mesh)
    if root is None or root is mesh or root.mesh.numel() == len(sub):
        return tuple(mesh.mesh.shape), sub, False
    full = root.mesh
    coords = {int(r): idx for idx, r in zip(itertools.product(*[range(n) for n in full.shape]), full.flatten().tolist())}
    mine = [coords[r] for r in sub]
    varying = [d for d in range(full.dim()) if len({c[d] for c in mine}) > 1]
    others = [d for d in range(full.dim()) if d not in varying]
    ranks = []
    for fixed in itertools.product(*[range(full.shape[d]) for d in others]):
        for c in mine:
            at = list(c)
            for d, v in zip(others, fixed):
                at[d] = v
            ranks.append(int(full[tuple(at)]))
    groups = len(ranks) // len(sub)
    return (groups,) + tuple(mesh.mesh.shape), ranks, True


def world_layout(mesh, meshes=None):
    """_whole_mesh(mesh), worked out once per mesh over a call where `meshes` (a dict kept over it) is given:
    torch 2.11 and 2.15 rebuild `DeviceMesh.mesh` on every access. Keyed by id, the mesh kept beside its
    result, so that its id stays its own while the dict lives."""
    if meshes is None:
        return _whole_mesh(mesh)
    known = meshes.get(id(mesh))
    if known is None:
        known = meshes[id(mesh)] = (mesh, _whole_mesh(mesh))
    return known[1]


def _local(param, where: str = "", group_ranks=None, meshes=None):
    """(local tensor, global shape, layout) of a parameter or buffer. layout: None for a plain tensor
    (Replicate on every rank), else (mesh shape, ranks in the load's group, placements) of its DTensor:
    any mesh of 1-3 dims, Shard(d), _StridedShard and Replicate, a mesh of its own per parameter.
    meshes: a dict kept over one call (`_Layouts.meshes`), for world_layout."""
    from torch.distributed.tensor import DTensor
    if not isinstance(param, DTensor):
        return param.data if hasattr(param, "data") else param, tuple(param.shape), None
    mesh, shape = param.device_mesh, tuple(param.shape)
    placements = tuple(_placement(p, len(shape), where or "a DTensor") for p in param.placements)
    mesh_shape, ranks, sliced = world_layout(mesh, meshes)
    if sliced:
        placements = ((0, 0, 1),) + placements
    if group_ranks is not None:
        missing = [r for r in ranks if r not in group_ranks]
        if missing:
            raise Unsupported(f"{where}: its mesh holds ranks {missing} outside the process group of the load")
        ranks = [group_ranks[r] for r in ranks]
    return param.to_local(), shape, (tuple(mesh_shape), tuple(ranks), placements)


class _Layouts:
    """The layout table the C++ core takes: each distinct (mesh, ranks, placements) once; and, over the same
    call, each mesh's world layout worked out once (`meshes`, for `_local`)."""

    def __init__(self):
        self.table, self._index = [], {}
        self.meshes: dict = {}

    def index(self, layout) -> int:
        if layout is None:
            return -1
        i = self._index.get(layout)
        if i is None:
            i = self._index[layout] = len(self.table)
            row = (list(layout[0]), list(layout[1]), [tuple(p) for p in layout[2]])
            if len(layout) > 3:  # explicit boxes: [(offset, size)], one per rank in layout[1]
                row += ([(list(o), list(z)) for o, z in layout[3]],)
            self.table.append(row)
        return i
