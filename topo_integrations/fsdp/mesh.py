"""The device mesh FSDP2 shards on: one row per island of the plan (docs/fsdp.md).

``island_mesh`` builds a 2-D ``DeviceMesh`` with dimensions ``("replicate", "shard")``: row i is the
i-th island of the plan (its global ranks ascending), column j the engine's rail j (the j-th smallest
rank of every island). ``mesh["shard"]`` is this rank's island, the mesh to ``fully_shard`` on with
topo-align; the whole 2-D mesh is native HSDP's (``fully_shard(..., mesh=mesh)``), the reference
topo-align's `hierarchical` mode equals. Because a reduce-scatter hands chunk j to the group's j-th
rank, the rank holding shard j in every island is rail j's member: the cross-island step of a shard is
an all-reduce over the rail.
"""

from __future__ import annotations

import torch

from ..reducer.plan.groups import ReducerGroups

__all__ = ["island_rows", "island_mesh", "check_mesh_rows"]

MESH_DIMS = ("replicate", "shard")


def island_rows(groups: ReducerGroups) -> list[list[int]]:
    """The islands as rows of global ranks (ascending), in the plan's order; one row with every
    data-parallel rank when the plan has one tier. Unequal islands are refused (a mesh is a grid)."""
    if not groups.hierarchical:
        return [sorted(groups.dp_ranks)]
    rows = [sorted(groups.dp_ranks[p] for p in g) for g in groups.plan.intra_groups]
    sizes = sorted({len(r) for r in rows})
    if len(sizes) != 1:
        raise ValueError(f"topo_align: the islands have {sizes} ranks; FSDP2 shards on a grid (a DeviceMesh), "
                         "so every island must hold as many ranks")
    return rows


def island_mesh(groups: ReducerGroups, device_type: str = "cpu"):
    """A 2-D ``DeviceMesh`` ``("replicate", "shard")`` whose rows are the plan's islands (module
    docstring). Collective over the default group (the mesh creates its process groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.tensor(island_rows(groups), dtype=torch.int), mesh_dim_names=MESH_DIMS)


def check_mesh_rows(shard_ranks: tuple[int, ...], groups: ReducerGroups, where: str) -> None:
    """``shard_ranks`` (FSDP2's reduce-scatter group, in its rank order) must be this rank's island in
    ascending order: then shard j is held by rail j's member in every island."""
    mine = list(groups.intra_ranks) if groups.hierarchical else sorted(groups.dp_ranks)
    if list(shard_ranks) != mine:
        raise ValueError(f"topo_align: {where} is sharded over global ranks {list(shard_ranks)}, but this rank's "
                         f"island is {mine}; shard with fully_shard(..., mesh=island_mesh(groups)['shard'])")
