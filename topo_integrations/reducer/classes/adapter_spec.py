"""What an adapter tells the engine when it builds one: the tensors it reduces (:class:`EngineTensors`)
and what it can do (:class:`AdapterTraits`). Two small frozen records, so that
``Engine(cfg, groups, tensors, device=..., traits=...)`` takes a few objects, not a dozen arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from ..kinds import Level

__all__ = ["EngineTensors", "AdapterTraits"]


@dataclass(frozen=True)
class EngineTensors:
    """The tensors an adapter reduces, in registration order (the class policy's input)."""

    names: Sequence[str]
    numels: Sequence[int]
    """Elements of each name (a ZeRO-3 partitioned parameter: its full size)."""
    layers: Mapping[str, int | None]
    """Global layer index per name (None outside layers): `sync.last_n_layers` counts from these."""
    num_layers: int | None = None
    params: Mapping[str, torch.Tensor] | None = None
    """name -> parameter, for the magnitude and hutchinson scores (None: fisher only)."""
    forced_sync: frozenset[str] = field(default_factory=frozenset)
    """Names that must stay SYNC (e.g. Megatron's shared embedding)."""
    loss_closure: Callable[[], torch.Tensor] | None = None
    """The loss `hutchinson` differentiates (``Engine.set_loss_closure`` may set one later)."""


@dataclass(frozen=True)
class AdapterTraits:
    """What the adapter can do beside reducing buckets."""

    workers: bool = False
    """Buckets may be handed over while the caller goes on (the dispatcher's thread on the CPU)."""
    levels: tuple[Level, ...] = tuple(Level)
    """The adaptive levels the adapter can apply (GroupedReducer: all four)."""
    can_regroup: bool = False
    """Whether adaptive regrouping may rebuild the groups (GroupedReducer only: a framework's
    data-parallel layout is fixed at its start)."""

    @classmethod
    def fixed_layout(cls, *, workers: bool = False) -> "AdapterTraits":
        """An adapter whose framework owns the data-parallel layout (DeepSpeed, Megatron, the DDP
        hook): no `flat` level (it would change who reduces with whom), no regrouping."""
        return cls(workers=workers, levels=(Level.NORMAL, Level.RECONCILE, Level.FP16))
