"""Averaging LOCAL parameters (and their optimizer state) across groups, blocking or asynchronous.

What is averaged: every LOCAL parameter and, when the optimizer is given, every floating tensor of
its optimizer state with the parameter's shape (Adam's exp_avg / exp_avg_sq, momentum buffers).
Averaging parameters alone does not stick for checkpoints: the moments differ between groups and a
resumed run would diverge (research/megatron-selective.md Q3; DESIGN invariant 4).

The tensors are concatenated in a fixed order (parameter order, then state keys sorted) into one fp32
vector, averaged in chunks of the bucket size with `reconcile_average` (1/L of it crosses the slow
tier per rank).

Asynchronous: at a reconciliation step the vector is *snapshotted* and its average is computed in
the background (LOCAL worker); at the next optimizer step the correction ``x += avg(snapshot) -
snapshot`` is applied. Replicas then differ only by what they learnt since the snapshot, so the
staleness is one step, well within the bound of one interval.
"""

from __future__ import annotations

import torch

from .collectives import reconcile_average

__all__ = ["ReconcileKeys", "keys_for", "resolve", "nonnegative", "gather_flat", "scatter_flat", "average_flat"]

ReconcileKeys = list[tuple]
"""("param", name) or ("state", name, key): what a flat vector holds, in order."""


def keys_for(names: list[str], params: dict[str, torch.Tensor], optimizer=None) -> ReconcileKeys:
    keys: ReconcileKeys = [("param", n) for n in names]
    if optimizer is not None:
        for n in names:
            st = optimizer.state.get(params[n], {})
            for k in sorted(st):
                v = st[k]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == params[n].shape:
                    keys.append(("state", n, k))
    return keys


def resolve(keys: ReconcileKeys, params: dict[str, torch.Tensor], optimizer=None) -> list[torch.Tensor]:
    out = []
    for key in keys:
        if key[0] == "param":
            out.append(params[key[1]].data)
        else:
            if optimizer is None:
                raise ValueError(f"reconciliation state includes optimizer state of {key[1]!r}: pass the optimizer")
            out.append(optimizer.state[params[key[1]]][key[2]])
    return out


def gather_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def nonnegative(keys: ReconcileKeys) -> list[bool]:
    """Which entries are second moments (exp_avg_sq, max_exp_avg_sq, square_avg, Adagrad's sum)."""
    return [k[0] == "state" and ("sq" in k[2] or k[2] in ("sum", "square_avg")) for k in keys]


def scatter_flat(flat: torch.Tensor, tensors: list[torch.Tensor], *, delta_from: torch.Tensor | None = None,
                 nonneg: list[bool] | None = None) -> None:
    """Write ``flat`` into ``tensors`` (or add ``flat - delta_from`` when given: the async correction).

    Second moments (``nonneg``) are clamped at 0 after a correction: ``x + avg - snapshot`` can be
    negative when x decayed since the snapshot, and a negative second moment would give NaN.
    """
    off = 0
    with torch.no_grad():
        for i, t in enumerate(tensors):
            n = t.numel()
            seg = flat[off:off + n].view(t.shape)
            if delta_from is None:
                t.copy_(seg)
            else:
                snap = delta_from[off:off + n].view(t.shape)
                t.add_((seg - snap).to(t.dtype))
                if nonneg is not None and nonneg[i]:
                    t.clamp_(min=0)
            off += n


def average_flat(flat: torch.Tensor, groups, *, chunk_numel: int, record=None) -> torch.Tensor:
    """`reconcile_average` of ``flat`` in chunks of at most ``chunk_numel`` elements (in place)."""
    n = flat.numel()
    for start in range(0, n, max(1, chunk_numel)):
        reconcile_average(flat[start:start + chunk_numel], groups, low_priority=True, record=record)
    return flat
