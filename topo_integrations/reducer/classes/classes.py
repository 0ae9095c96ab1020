"""SYNC / LOCAL classes for `selective`: last N layers, `always_sync` patterns, importance top fraction.

Layer detection, in order:
  1. ``sync.layer_pattern``: a regular expression with one group capturing the layer index;
  2. the known names: Megatron ``decoder.layers.N``, Hugging Face ``h.N`` / ``layers.N``, ``blocks.N``
     (the leftmost match in a name wins, so ``layers.3.experts.h.1`` is layer 3);
  3. otherwise the largest ``nn.Sequential`` / ``nn.ModuleList`` of the model (the one with the most
     children that hold parameters): its children are the layers (covers a plain ``nn.Sequential``).
Only indices that occur count, so ``Sequential(Linear, Tanh, Linear)`` has layers 0 and 2.

Everything here is a pure function of names, sizes and (agreed) scores, so every rank computes the
same classes. With pipeline parallelism the indices are local to the stage: pass names with global
indices (``param_names``) if "last N" must mean the last N of the whole model.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable

import torch.nn as nn

__all__ = ["SYNC", "LOCAL", "KNOWN_LAYER_PATTERNS", "layer_indices", "matches_any", "classify"]

SYNC = "SYNC"
LOCAL = "LOCAL"

KNOWN_LAYER_PATTERNS = (
    r"(?:^|\.)decoder\.layers\.(\d+)(?:\.|$)",
    r"(?:^|\.)h\.(\d+)(?:\.|$)",
    r"(?:^|\.)layers\.(\d+)(?:\.|$)",
    r"(?:^|\.)blocks\.(\d+)(?:\.|$)",
)


def _container_layers(model: nn.Module | None, names: list[str]) -> dict[str, int]:
    if model is None:
        return {}
    best, best_n = None, 0
    for prefix, mod in model.named_modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList)):
            holders = [k for k, c in mod.named_children() if any(True for _ in c.parameters())]
            if len(holders) > best_n:
                best, best_n = prefix, len(holders)
    if best is None:
        return {}
    pre = f"{best}." if best else ""
    out = {}
    for n in names:
        if n.startswith(pre):
            head = n[len(pre):].split(".", 1)[0]
            if head.isdigit():
                out[n] = int(head)
    return out


def layer_indices(names: list[str], *, model: nn.Module | None = None,
                  layer_pattern: str | None = None) -> dict[str, int | None]:
    """Layer index of every parameter name (None when it belongs to no layer)."""
    if layer_pattern is not None:
        try:
            rx = re.compile(layer_pattern)
        except re.error as exc:
            raise ValueError(f"sync.layer_pattern = {layer_pattern!r} is not a valid regular expression: "
                             f"{exc}") from None
        if rx.groups != 1:
            raise ValueError(f"sync.layer_pattern = {layer_pattern!r} has {rx.groups} groups; "
                             "expected exactly one group capturing the layer index")
        out: dict[str, int | None] = {}
        for n in names:
            m = rx.search(n)
            out[n] = int(m.group(1)) if m and m.group(1) is not None and m.group(1).isdigit() else None
        return out
    rxs = [re.compile(p) for p in KNOWN_LAYER_PATTERNS]
    out = {}
    found = False
    for n in names:
        hits = [m for m in (rx.search(n) for rx in rxs) if m]
        if hits:
            out[n] = int(min(hits, key=lambda m: m.start(1)).group(1))
            found = True
        else:
            out[n] = None
    if not found:
        cont = _container_layers(model, names)
        out = {n: cont.get(n) for n in names}
    return out


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """fnmatch pattern or plain substring."""
    return any(fnmatch.fnmatchcase(name, p) or p in name for p in patterns)


def classify(names: list[str], numels: list[int], *, last_n_layers: int, always_sync: list[str],
             top_fraction: float, scores: list[float] | None, layers: dict[str, int | None],
             num_layers: int | None = None, exact_names: Iterable[str] = ()) -> dict[str, str]:
    """name -> SYNC | LOCAL.

    SYNC = parameters of the last ``last_n_layers`` layer indices (of ``num_layers`` when given, else of
    the indices present) + names matching ``always_sync`` + ``exact_names``
    + the highest-scoring other tensors, greedily (highest score first, ties by name; a tensor that
    does not fit is skipped) while their elements stay within ``top_fraction`` of all elements.
    """
    idx = sorted({i for i in layers.values() if i is not None})
    if num_layers is not None:
        # Global indices (pipeline parallelism): the last N of the whole model, not of this stage.
        last = set(range(num_layers - last_n_layers, num_layers)) if last_n_layers > 0 else set()
    else:
        last = set(idx[-last_n_layers:]) if last_n_layers > 0 else set()
    exact = set(exact_names)
    out = {}
    for n in names:
        li = layers.get(n)
        out[n] = SYNC if (li is not None and li in last) or n in exact or matches_any(n, always_sync) else LOCAL
    total = sum(numels)
    budget = top_fraction * total
    if top_fraction >= 1.0:
        return {n: SYNC for n in names}
    if budget <= 0:
        return out
    sc = scores if scores is not None else [0.0] * len(names)
    order = sorted((i for i, n in enumerate(names) if out[n] == LOCAL), key=lambda i: (-sc[i], names[i]))
    used = 0
    for i in order:
        if used + numels[i] <= budget:
            out[names[i]] = SYNC
            used += numels[i]
    return out
