"""Reducer process groups for a Megatron data-parallel group (dense ``dp_cp`` or expert ``expt_dp``).

Megatron has one data-parallel group per (tensor, pipeline, ...) coordinate. The reducer's
`build_groups` must create the groups of *all* of them on every rank in the same order, so this
module first learns every data-parallel group of the job, plans the topology of one, checks that
every other one has the same layout, then builds.

Built groups can be shared through a `GroupSet` the caller owns and passes explicitly (keyed by
topology settings and data-parallel groups): a model with several chunks (virtual pipeline) or a
dense and an expert buffer over the same ranks then share one set of communicators instead of
creating new ones per chunk (every `new_group` is a collective over the whole job and a
communicator costs memory on every GPU). There is no module-level cache: `TopoAlignDDP` keeps its
`GroupSet` on itself (and on the DDP config object Megatron-LM passes to every chunk).
"""

from __future__ import annotations

import json

import torch.distributed as dist

from ..config import TopoAlignConfig
from ..reducer.plan.discover import discover_plan
from ..reducer.plan.groups import ReducerGroups, build_groups
from ..reducer.plan.planning import broadcast_plan
from ..reducer.wire.replicas import all_dp_layouts

__all__ = ["groups_for_dp_group", "GroupSet", "LayoutError"]


class GroupSet:
    """Built `ReducerGroups` by (topology settings, every data-parallel group of the job); owned by
    the caller (a `TopoAlignDDP`, or the DDP config shared by a model's chunks), never global."""

    def __init__(self) -> None:
        self.built: dict[tuple[str, tuple[tuple[int, ...], ...]], ReducerGroups] = {}

    def all(self) -> list[ReducerGroups]:
        return list(self.built.values())

    def share_schedule(self, groups: ReducerGroups) -> None:
        """One schedule per process (reducer/schedule/schedule.py): ``groups`` (e.g. the expert data-parallel
        groups) issue through the schedule the other groups of this set already use, so every engine
        of the model (chunks, expert engine) runs one issuing order, one trace and one watch."""
        if getattr(groups, "schedule", None) is not None:
            return
        for g in self.built.values():
            if g is not groups and getattr(g, "schedule", None) is not None:
                g.schedule.attach(groups)
                return


class LayoutError(ValueError):
    """The topology's groups do not fit the data-parallel layout Megatron uses; the message says how to fix it."""


def groups_for_dp_group(cfg: TopoAlignConfig, dp_group, known: GroupSet | None = None) -> ReducerGroups:
    """This rank's `ReducerGroups` over the data-parallel group ``dp_group`` (collective over the world).

    ``known``: groups built before for the same settings and layout are reused from it, and new
    ones are added to it.

    Phases:
      1. all-gather every rank's data-parallel group (global ranks) over the world;
      2. each data-parallel group plans its topology (`discover_plan`: hostnames gathered inside
         the group, or the topology file), then the plan of the group holding global rank 0 is
         broadcast to the world and every group checks its own plan has the same groups;
      3. `build_groups` creates the intra/inter groups of every data-parallel group.
    """
    all_dp = tuple(all_dp_layouts(dp_group, timeout_s=cfg.fallback.timeout_s))
    key = (json.dumps({"t": cfg.topology.model_dump(), "timeout": cfg.fallback.timeout_s}, sort_keys=True), all_dp)
    if known is not None and key in known.built:
        return known.built[key]
    me = dist.get_rank()
    mine = next(g for g in all_dp if me in g)
    whole_world = len(all_dp) == 1
    plan = discover_plan(cfg, dp_ranks=list(mine), dp_group=None if whole_world else dp_group)
    if not whole_world:
        ref = broadcast_plan(plan if me == 0 else None, None, src=0)
        if (ref.intra_groups, ref.inter_groups) != (plan.intra_groups, plan.inter_groups):
            raise LayoutError(
                f"topo_align: the data-parallel group of global rank 0 plans intra groups {list(ref.intra_groups)} "
                f"(positions) but the one holding global ranks {list(mine)} plans {list(plan.intra_groups)}; "
                "every data-parallel group must have the same node layout: place tensor/pipeline-parallel ranks "
                "inside nodes the same way on every node"
            )
        plan = ref
    groups = build_groups(plan, dp_ranks_all=[list(g) for g in all_dp], timeout_s=cfg.fallback.timeout_s)
    if known is not None:
        known.built[key] = groups
    return groups
