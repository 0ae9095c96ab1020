"""The collectives adapters need besides gradient reduction: starting replicas equal, comparing them,
and learning the job's data-parallel layout.

Adapters (``torch/``, ``deepspeed/``, ``megatron/``) issue no ``torch.distributed`` collective of
their own (tests/test_architecture.py): these calls are the reducer's, so they end in
:class:`~topo_integrations.reducer.watch.errors.CollectiveError` naming the operation, the group and
its ranks, and are bounded by ``fallback.timeout_s``. Once an engine exists, call
:func:`gather_dp` through ``engine.call(...)`` so it takes its place in the one schedule
(dispatch.py); the other two run at set-up, before any engine issues anything.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ..watch.bounded import bounded
from .collectives import run

__all__ = ["broadcast_from_first", "gather_dp", "all_dp_layouts"]

BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024
"""Tensors are broadcast in concatenated chunks of about this size (one collective per chunk)."""


def broadcast_from_first(tensors: Iterable[torch.Tensor], groups) -> None:
    """Every replica starts from DP position 0's values of ``tensors`` (parameters, buffers), as DDP does.

    Phases: tensors grouped by (device, dtype) are concatenated into chunks of about 64 MiB; each
    chunk is one broadcast from DP position 0 over the DP group, then copied back in place.
    """
    if groups.dp_size < 2:
        return
    src = groups.dp_ranks[0]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for ts in by_kind.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for t in ts + [None]:
                if t is not None and (not chunk or size + t.numel() * t.element_size() <= BROADCAST_CHUNK_BYTES):
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                    continue
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                run("broadcast(parameters)", "dp", groups.dp_group, groups, flat.numel() * flat.element_size(), None,
                    lambda flat=flat: dist.broadcast(flat, src=src, group=groups.dp_group), like=flat)
                off = 0
                for c in chunk:
                    c.data.copy_(flat[off:off + c.numel()].view(c.shape))
                    off += c.numel()
                chunk, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def gather_dp(t: torch.Tensor, groups) -> torch.Tensor:
    """``t`` of every DP position, stacked in DP position order (``[dp_size, *t.shape]``), e.g. the
    fingerprints a consistency check compares. Phases: one all-gather over the DP group."""
    parts = [torch.empty_like(t) for _ in range(groups.dp_size)]
    if groups.dp_size > 1:
        run("all_gather", "dp", groups.dp_group, groups, t.numel() * t.element_size(), None,
            lambda: dist.all_gather(parts, t.contiguous(), group=groups.dp_group), like=t)
    else:
        parts[0].copy_(t)
    # all_gather orders by group rank (ascending global rank); reorder to DP positions.
    order = sorted(groups.dp_ranks)
    return torch.stack([parts[order.index(r)] for r in groups.dp_ranks])


def all_dp_layouts(dp_group, *, timeout_s: float | None) -> list[tuple[int, ...]]:
    """Every data-parallel group of the job (global ranks in group order), deduplicated and ordered by
    first rank; ``dp_group`` None means the whole world. Collective over the world (every rank calls
    it at set-up). Phases: one ``all_gather_object`` of each rank's group over the world."""
    world = dist.get_world_size()
    mine = tuple(dist.get_process_group_ranks(dp_group)) if dp_group is not None else tuple(range(world))
    everyone: list = [None] * world
    bounded("all_gather_object(data-parallel groups)", timeout_s, lambda: dist.all_gather_object(everyone, mine))
    return sorted({tuple(g) for g in everyone}, key=lambda g: g[0])
