"""What the FSDP2 adapter reads of ``fully_shard``'s internals (torch 2.13), in one place.

FSDP2's public API gives the hooks (``set_all_reduce_hook``, ``set_custom_reduce_scatter``,
``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
``set_reduce_scatter_unused_params``) but not what the adapter must know to use them: which
parameters a module's reduce-scatter output holds, in which order and with how much padding, which
process group it reduce-scatters over, and whether ``set_requires_all_reduce(False)`` is in force
(with a 1-D mesh FSDP2 calls the all-reduce hook whatever that flag says). This module reads those
from the parameter groups (``fully_shard.state(module)._fsdp_param_groups``), so a torch release that
moves them breaks here, with :class:`FSDPInternalsError` naming what is missing, and nowhere else.

The reduce-scatter output of one parameter group (``foreach_reduce``): for every parameter that
requires a gradient, in the group's order, ``padded_sharded_param_size.numel()`` elements (this
rank's shard, padded so that every rank of the island holds as many); the views FSDP makes of it
start at those offsets. With ``set_reduce_scatter_unused_params(True)`` (the adapter sets it) every
such parameter is in it at every step, with zeros when it got no gradient, so the layout is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["FSDPInternalsError", "Unit", "units_of", "mesh_kind", "shard_ranks", "reduce_dtype"]


class FSDPInternalsError(RuntimeError):
    """FSDP2 does not look as this adapter expects (another torch release); names what is missing."""


def _need(obj: Any, attr: str, what: str) -> Any:
    if not hasattr(obj, attr):
        raise FSDPInternalsError(f"topo_align: FSDP2's {what} has no attribute {attr!r}; the FSDP2 adapter is "
                                 "written against torch 2.13's fully_shard")
    return getattr(obj, attr)


@dataclass(eq=False)
class Unit:
    """One FSDP2 parameter group: one reduce-scatter per backward, one all-reduce hook call."""

    index: int
    """Position among the model's parameter groups (``model.modules()`` order): the same on every rank."""
    module: nn.Module
    """The ``fully_shard``-ed module (an ``FSDPModule``) that owns the group."""
    group: Any
    """FSDP2's ``FSDPParamGroup``."""

    @property
    def key(self) -> str:
        return f"fsdp{self.index}"

    def trainable(self) -> list:
        """The ``FSDPParam`` s whose gradients the reduce-scatter output holds, in its order."""
        return [fp for fp in _need(self.group, "fsdp_params", "parameter group")
                if _need(fp, "sharded_param", "FSDPParam").requires_grad]

    def segments(self) -> list[tuple[Any, int]]:
        """``(sharded parameter, elements in the reduce-scatter output)`` in the output's order."""
        return [(fp.sharded_param, _need(fp, "padded_sharded_param_size", "FSDPParam").numel())
                for fp in self.trainable()]

    @property
    def all_reduce_grads(self) -> bool:
        """False under ``set_requires_all_reduce(False)`` (accumulate island sums, no cross-island step)."""
        return bool(_need(self.group, "all_reduce_grads", "parameter group"))

    @property
    def mesh_info(self) -> Any:
        return _need(self.group, "mesh_info", "parameter group")


def units_of(model: nn.Module) -> list[Unit]:
    """Every FSDP2 parameter group of ``model`` (``fully_shard`` applied to it or its submodules), once
    (accelerate shards ``[final norm, lm_head]`` in one ``fully_shard`` call)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out: list[Unit] = []
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        if id(state) in seen:  # fully_shard([a, b]): the modules of one call share one state and group
            continue
        seen.add(id(state))
        groups = _need(state, "_fsdp_param_groups", "FSDPState")
        if len(groups) > 1:
            raise ValueError(f"topo_align: {type(module).__name__} has {len(groups)} FSDP2 parameter groups (a "
                             "per-parameter mesh from shard_placement_fn); the FSDP2 adapter hooks one reduce-scatter "
                             "per module, as set_all_reduce_hook does: shard that module on one mesh")
        out += [Unit(len(out), module, g) for g in groups]
    return out


def mesh_kind(unit: Unit) -> str:
    """``"shard"`` (a 1-D mesh: FSDP2 reduce-scatters, nothing more), ``"hsdp"`` (a 2-D mesh: FSDP2
    all-reduces across replicas itself) or ``"replicate"`` (no sharding)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo

    info = unit.mesh_info
    if isinstance(info, HSDPMeshInfo):
        return "hsdp"
    if isinstance(info, DDPMeshInfo):
        return "replicate"
    if isinstance(info, FSDPMeshInfo):
        return "shard"
    raise FSDPInternalsError(f"topo_align: unknown FSDP2 mesh info {type(info).__name__}")


def shard_ranks(unit: Unit) -> tuple[int, ...]:
    """Global ranks of the group's shard (reduce-scatter) process group, in its rank order."""
    pg = _need(unit.mesh_info, "shard_process_group", "mesh info")
    return tuple(dist.get_process_group_ranks(pg))


def reduce_dtype(unit: Unit) -> torch.dtype | None:
    """The dtype FSDP2 reduce-scatters the unit's gradients in: the mixed-precision policy's
    ``reduce_dtype``, else its ``param_dtype``, else the parameters' own dtype."""
    mp = _need(unit.group, "mp_policy", "parameter group")
    params = unit.trainable()
    own = params[0].sharded_param.dtype if params else None
    return mp.reduce_dtype or mp.param_dtype or own
