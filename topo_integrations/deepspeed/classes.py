"""SYNC / LOCAL classes for the DeepSpeed `selective` route (DESIGN.md 4).

The rules are the reducer's (``topo_integrations.reducer.classes``), so DeepSpeed and Megatron
classify a model the same way: SYNC = the last ``sync.last_n_layers`` layers + ``sync.always_sync``
name patterns + the highest-scoring other tensors up to ``sync.top_fraction`` of all elements.
This wrapper adapts them to the adapter's data (name -> numel, agreed scores by name) and returns
name -> True for SYNC.
"""

from __future__ import annotations

from torch import nn

from ..reducer.classes import SYNC, layer_indices
from ..reducer.classes import classify as _classify

__all__ = ["classify"]


def classify(named_numel: list[tuple[str, int]], sync_cfg, scores: dict[str, float] | None = None,
             *, model: nn.Module | None = None) -> dict[str, bool]:
    """Name -> True (SYNC) / False (LOCAL); deterministic for the same inputs on every rank.

    ``scores`` are the agreed per-tensor importances (None before the first refresh: ties, broken by
    name). ``model`` lets layer detection fall back to the model's largest Sequential/ModuleList.
    """
    names = [n for n, _ in named_numel]
    numels = [k for _, k in named_numel]
    layers = layer_indices(names, model=model, layer_pattern=sync_cfg.layer_pattern)
    sc = [scores.get(n, 0.0) for n in names] if scores is not None else None
    out = _classify(names, numels, last_n_layers=sync_cfg.last_n_layers, always_sync=list(sync_cfg.always_sync),
                    top_fraction=sync_cfg.top_fraction, scores=sc, layers=layers)
    return {n: out[n] == SYNC for n in names}
