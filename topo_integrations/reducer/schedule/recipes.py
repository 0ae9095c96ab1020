"""What one bucket of one class needs, and the collectives that do it (decided once, here).

An adapter describes a bucket with :class:`CommBucket` (its flat storage, the ranges of the class, the
reduction and which :class:`Collective` the framework still needs); :func:`recipe` turns it into
the function the dispatcher runs: wire dtype of each hop (``sync.dtype`` / ``local.dtype``), the
error-feedback residual (keyed by the bucket), two or three levels (the groups' plan). When it runs
is the dispatcher's business (dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

import torch

from ..kinds import Cls, Mode, Traffic
from .ranges import Ranges, clip, put, take

__all__ = ["Collective", "Reduction", "CommBucket", "recipe"]


class Collective(StrEnum):
    """What the framework needs done with a bucket (the framework may have done part of it)."""

    ALL_REDUCE = "all_reduce"
    """Every DP rank ends with the reduction of ``flat`` (per class: SYNC over all ranks, LOCAL
    inside the island)."""
    RAIL = "rail"
    """``flat`` is already reduced inside the island (a ZeRO-1/2 partition): only the rail hop, for
    SYNC ranges (LOCAL ranges keep the island value)."""
    SHARD = "shard"
    """Megatron's distributed optimizer: island reduce-scatter of ``flat`` into ``out`` (my island
    shard), then the rail hop of the SYNC ranges of ``out`` (all of it outside `selective`)."""
    SCATTER = "scatter"
    """ZeRO-3: ``flat`` holds the slots of every rank ordered rail by rail; island reduce-scatter,
    then rail reduce-scatter into ``out`` (my slot)."""
    ISLAND = "island"
    """FSDP2 with a 16-bit reduce dtype: island reduce-scatter SUM of ``flat`` (fp32) into ``out`` (my
    island shard) and nothing more; the rail hop follows from FSDP2's all-reduce hook (a RAIL bucket)."""


class Reduction(StrEnum):
    MEAN = "mean"
    """The dispatcher divides: SYNC by the DP size, LOCAL by the island size."""
    SUM = "sum"
    """No division (the framework pre-scaled). LOCAL: the island sum times the number of islands,
    the island's estimate of the DP sum (with 1/DP pre-scaling: the island mean)."""


@dataclass(eq=False)
class CommBucket:
    """One bucket of one class, as the adapter hands it over."""

    key: str
    """Stable across steps and ranks (e.g. ``"sync/3"``): names the error-feedback residual and the
    bucket in errors."""
    flat: torch.Tensor
    """Contiguous 1-D storage of the framework; reduced in place."""
    ranges: Ranges | None = None
    """Element ranges of ``flat`` that belong to the class; None: all of it."""
    reduction: Reduction = Reduction.MEAN
    collective: Collective = Collective.ALL_REDUCE
    out: torch.Tensor | None = None
    """SHARD / SCATTER / ISLAND: where my part of the result goes."""


def recipe(w, b: CommBucket, cls: Cls, *, mode: Mode, sync_dtype: torch.dtype,
           local_dtype: torch.dtype) -> Callable[[], None]:
    """The collectives of one bucket, per (collective, class, mode): wire dtype, residual key,
    levels. Phases in each branch's comment."""
    g = w.groups
    mean = b.reduction is Reduction.MEAN
    col = b.collective
    if col is not Collective.ALL_REDUCE and mode is Mode.FLAT:
        raise ValueError(f"topo_align: a {col} bucket needs a hierarchical plan (mode is 'flat')")

    def on_ranges(fn):
        def job():
            if b.ranges is None:
                fn(b.flat)
            elif b.ranges:
                v = take(b.flat, b.ranges)
                fn(v)
                put(b.flat, b.ranges, v)
        return job

    if col is Collective.ALL_REDUCE:
        if mode is Mode.FLAT:
            # 1. one all-reduce over the DP group.
            return on_ranges(lambda v: w.flat_(v, cls=Traffic.SYNC, average=mean))
        if cls is Cls.SYNC:
            # 1. island reduce-scatter; 2. rail all-reduce in sync.dtype (leaf + spine with three
            #    levels), error feedback under the bucket's key; 3. island all-gather.
            return on_ranges(lambda v: w.hierarchical_(v, key=b.key, wire=sync_dtype, cls=Traffic.SYNC,
                                                       average=mean))

        def local(v):
            # 1. all-reduce inside the island in local.dtype (error feedback); 2. SUM: x K.
            w.intra_(v, key=b.key, wire=local_dtype, cls=Traffic.LOCAL, average=mean)
            if not mean and g.inter_size > 1:
                v.mul_(g.inter_size)
        return on_ranges(local)
    if col is Collective.RAIL:
        if cls is Cls.LOCAL:
            return lambda: None
        # 1. all-reduce over my rail in sync.dtype (the island step was the framework's).
        return on_ranges(lambda v: w.rail_(v, key=b.key, wire=sync_dtype, cls=Traffic.SYNC, average=mean))
    if col is Collective.SHARD:
        return lambda: _shard(w, b, mean, sync_dtype)
    if col is Collective.SCATTER:
        def scatter():
            # 1. island reduce-scatter: member s gets its rail's slots; 2. rail reduce-scatter in
            #    sync.dtype (error feedback) into my slot.
            mid = b.flat.new_empty(b.flat.numel() // g.intra_size)
            w.reduce_scatter_intra_(mid, b.flat)
            w.rail_reduce_scatter_(b.out, mid, key=b.key, wire=sync_dtype)
        return scatter
    if col is Collective.ISLAND:
        # 1. island reduce-scatter SUM (the fp32 sums FSDP2 would form in 16 bits).
        return lambda: w.reduce_scatter_intra_(b.out, b.flat, cls=Traffic.SYNC)
    raise ValueError(f"topo_align: unknown collective {col!r}")


def _shard(w, b: CommBucket, mean: bool, sync_dtype: torch.dtype) -> None:
    """Phases: 1. island reduce-scatter of ``flat`` into ``out`` (/L for MEAN); 2. rail all-reduce
    of ``out`` (its SYNC ranges in `selective`) in sync.dtype; 3. SUM: LOCAL elements x K."""
    g = w.groups
    L, K = g.intra_size, g.inter_size
    out = b.out
    w.reduce_scatter_intra_(out, b.flat, cls=Traffic.SYNC)
    if mean and L > 1:
        out.div_(L)
    if b.ranges is None:
        w.rail_(out, key=b.key, wire=sync_dtype, cls=Traffic.SYNC, average=mean)
        return
    n = out.numel()
    lo = g.intra_rank * n
    sync_r = clip(b.ranges, lo, lo + n)
    vals = take(out, sync_r) if sync_r else None
    if vals is not None:
        w.rail_(vals, key=b.key, wire=sync_dtype, cls=Traffic.SYNC, average=mean)
    if not mean and K > 1:
        out.mul_(K)
    if vals is not None:
        put(out, sync_r, vals)
