"""SYNC / LOCAL classes of a Megatron model chunk's parameters (DESIGN.md 4, `selective`).

SYNC = parameters of the last ``sync.last_n_layers`` transformer layers (counted over the whole
model, also under pipeline parallelism: Megatron's ``layer_number`` is global), parameters whose
name matches ``sync.always_sync``, the word embedding when it doubles as the output head
(``shared_embedding``: both pipeline stages must treat the tied copies alike), and the most
important tensors up to ``sync.top_fraction`` of all elements. LOCAL = the rest.

Importance is per tensor and agreed across ranks before ranking (the caller all-reduces the
scores), and ties are broken by name, so every rank computes the same classes.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable

import torch

__all__ = ["global_layer_index", "classify"]


def global_layer_index(module: torch.nn.Module, pattern: str | None = None) -> dict[str, int | None]:
    """Parameter name -> 0-based global layer index (None outside transformer layers).

    With ``pattern`` (a regex with one group) the index comes from the name. Otherwise from the
    nearest enclosing module with a ``layer_number`` attribute (Megatron's TransformerLayer,
    1-based and global across pipeline stages).
    """
    names = [n for n, _ in module.named_parameters()]
    if pattern:
        rx = re.compile(pattern)
        out: dict[str, int | None] = {}
        for n in names:
            m = rx.search(n)
            out[n] = int(m.group(1)) if m else None
        return out
    prefixes: dict[str, int] = {}
    for mname, mod in module.named_modules():
        num = getattr(mod, "layer_number", None)
        if isinstance(num, int) and mname:
            prefixes[mname + "."] = num - 1
    out = {}
    for n in names:
        best = None
        best_len = -1
        for pre, idx in prefixes.items():
            if n.startswith(pre) and len(pre) > best_len:
                best, best_len = idx, len(pre)
        out[n] = best
    return out


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or p in name for p in patterns)


def classify(
    named: list[tuple[str, int]],
    layer_of: dict[str, int | None],
    num_layers: int,
    sync_cfg,
    *,
    forced_sync: set[str] = frozenset(),
    scores: dict[str, float] | None = None,
) -> dict[str, bool]:
    """Name -> True (SYNC) / False (LOCAL); deterministic for the same inputs on every rank.

    ``named``: (name, numel) of the chunk's trainable parameters; ``layer_of``: global layer
    index per name; ``num_layers``: layers of the whole model; ``scores``: agreed importance
    (None before the first refresh: then only structure decides). ``top_fraction`` budgets the
    tensors added by importance (beyond the structural SYNC set); ``top_fraction = 1`` makes every
    tensor SYNC, so `selective` equals `hierarchical`.
    """
    if sync_cfg.top_fraction >= 1.0:
        return {n: True for n, _ in named}
    n_last = sync_cfg.last_n_layers
    first_sync_layer = num_layers - n_last if n_last > 0 else None
    sync = {}
    for n, _ in named:
        idx = layer_of.get(n)
        in_last = first_sync_layer is not None and idx is not None and idx >= first_sync_layer
        sync[n] = in_last or n in forced_sync or _matches(n, sync_cfg.always_sync)
    if scores and sync_cfg.top_fraction > 0:
        total = sum(k for _, k in named)
        budget = sync_cfg.top_fraction * total
        used = 0
        for n, k in sorted(named, key=lambda nk: (-scores.get(nk[0], 0.0), nk[0])):
            if sync[n] or used + k > budget:
                continue
            sync[n] = True
            used += k
    return sync
