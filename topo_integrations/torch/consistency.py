"""The consistency check of the PyTorch adapters: replicas that must be identical are (invariants 1
and 2 of docs/reducer.md), or :class:`ConsistencyError` names the first that is not."""

from __future__ import annotations

import torch

from ..reducer.classes.classes import SYNC
from ..reducer.wire.replicas import gather_dp

__all__ = ["ConsistencyError", "fingerprint", "verify_replicas"]


class ConsistencyError(RuntimeError):
    """Replicas that must be identical are not (invariants 1 and 2 of docs/reducer.md); the message names the first."""


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A bitwise fingerprint (two int64 sums over the raw bits) of ``t``; equal bits -> equal hash."""
    flat = t.detach().reshape(-1)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
    bits = flat.contiguous().view(ints).to(torch.int64)
    w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1_000_003 + 1
    return torch.stack([(bits * w).sum(), (bits * bits).sum() + bits.numel()])


def verify_replicas(engine, named: list[tuple[str, torch.Tensor]], layout: str) -> None:
    """Check every parameter of ``named`` against the engine's classes, and ``layout`` (the adapter's
    class/bucket layout, a decision that must agree) on every rank.

    Phases: 1. fingerprint every parameter and the layout locally;
            2. all-gather the fingerprints over the DP group (``engine.call``: in the one schedule);
            3. compare: the layout and SYNC parameters on all ranks, LOCAL inside each group (on all
               ranks after a reconciliation).
    Collective over the DP group.
    """
    g = engine.groups
    dev = engine.wire.device
    lay = torch.frombuffer(bytearray(layout.encode()), dtype=torch.uint8).to(torch.int64)
    rows = [fingerprint(lay.to(dev))] + [fingerprint(p) for _, p in named]
    mine = torch.stack(rows).reshape(-1).to(dev)
    H = engine.call(lambda: gather_dp(mine, g), "all_gather(consistency fingerprints)")
    H = H.reshape(g.dp_size, len(rows), 2).cpu()
    gi = [g.plan.group_index(pos) for pos in range(g.dp_size)]
    for pos in range(1, g.dp_size):
        if not torch.equal(H[pos, 0], H[0, 0]):
            raise ConsistencyError(
                f"topo_align: class assignment / bucket layout differs between DP positions 0 and {pos} "
                f"(global ranks {g.dp_ranks[0]} and {g.dp_ranks[pos]})")
    for i, (name, _) in enumerate(named, start=1):
        cls = engine.classes[name]
        everywhere = cls == SYNC or engine.reconciler.all_synced
        for pos in range(g.dp_size):
            ref = 0 if everywhere else gi.index(gi[pos])
            if not torch.equal(H[pos, i], H[ref, i]):
                where = "on all ranks" if everywhere else f"inside group {gi[pos]}"
                raise ConsistencyError(
                    f"topo_align: parameter {name!r} ({cls}) must be identical {where} but differs between "
                    f"DP positions {ref} and {pos} (global ranks {g.dp_ranks[ref]} and {g.dp_ranks[pos]}, "
                    f"groups {gi[ref]} and {gi[pos]}) after {engine.step} optimizer steps")
