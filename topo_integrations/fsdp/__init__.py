"""FSDP2 adapter (docs/fsdp.md): ``fully_shard`` inside each island, the cross-island reduction of each
reduce-scatter output through FSDP2's all-reduce hook on the engine's dispatcher.

    groups = island_groups(cfg)                   # topology plan + the engine's process groups
    mesh = island_mesh(groups)                    # 2-D ("replicate", "shard"): a row per island
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])    # shard inside the island
    fully_shard(model, mesh=mesh["shard"])
    ta = apply(model, groups, cfg)                # hooks every fully_shard module of the model
    loss.backward(); optimizer.step(); ta.after_optimizer_step(optimizer)

  seams.py     what the adapter reads of fully_shard's internals (torch 2.13), in one place
  mesh.py      island_mesh: the DeviceMesh whose rows are the plan's islands
  comms.py     FSDP2's reduce-scatter in fp32 for a 16-bit reduce dtype (set_custom_reduce_scatter)
  adapter.py   TopoAlignFSDP: the all-reduce hook, steps, reconciliation of shards, clipping, state, DCP
  refusals.py  the keys and set-ups refused at start, with the reason and what to do instead

Like the other adapters it only maps FSDP2's buffers to the engine's buckets; every collective is
the engine's. Importing this package imports no FSDP2 module until one of its names is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .refusals import KEY_REFUSALS, TopoAlignFSDPError, check_config

if TYPE_CHECKING:
    from .adapter import TopoAlignFSDP

__all__ = ["apply", "island_groups", "island_mesh", "TopoAlignFSDP", "TopoAlignFSDPError", "check_config",
           "KEY_REFUSALS"]


def island_groups(cfg, *, plan=None):
    """The engine's process groups for ``cfg`` (the topology discovered and planned unless ``plan`` is
    given; a one-tier plan falls back as the config says). Collective over the default group."""
    check_config(cfg)
    from ..torch.reducer import topology_groups

    return topology_groups(cfg, plan=plan)[0]


def island_mesh(groups, device_type: str = "cpu"):
    """The 2-D ``DeviceMesh`` ("replicate", "shard") whose rows are ``groups``' islands (mesh.py)."""
    from .mesh import island_mesh as build

    return build(groups, device_type)


def apply(model, mesh_or_groups, cfg, **kw) -> "TopoAlignFSDP":
    """Hook every ``fully_shard`` module of ``model`` (sharded on an island mesh) to the engine.

    ``mesh_or_groups``: the ``ReducerGroups`` of :func:`island_groups`, or the ``DeviceMesh`` the model
    was sharded with (2-D: its rows must be the discovered islands; its groups are then discovered
    from ``cfg``). ``kw``: ``plan=`` (a topology plan instead of discovery). Refuses, naming the key or
    the set-up, what it cannot honour (refusals.py)."""
    from ..reducer.plan.groups import ReducerGroups
    from .adapter import TopoAlignFSDP

    if isinstance(mesh_or_groups, ReducerGroups):
        return TopoAlignFSDP(model, cfg, groups=mesh_or_groups, **kw)
    return TopoAlignFSDP(model, cfg, mesh=mesh_or_groups, **kw)


def __getattr__(name: str):
    if name == "TopoAlignFSDP":
        from .adapter import TopoAlignFSDP

        return TopoAlignFSDP
    raise AttributeError(f"module 'topo_integrations.fsdp' has no attribute {name!r}")
