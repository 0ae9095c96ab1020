"""Global layer index of a Megatron model chunk's parameters, for the engine's `sync.last_n_layers`.

Megatron's ``TransformerLayer.layer_number`` is 1-based and global across pipeline stages, so "the
last N layers" means the last N of the whole model on every stage; `TopoAlignDDP` passes these
indices with ``num_layers = config.num_layers`` to the engine, which classifies
(topo_integrations/reducer/classes/classes.py). With ``sync.layer_pattern`` the indices come from the names
instead (the engine's `layer_indices`).
"""

from __future__ import annotations

import torch

__all__ = ["global_layer_index"]


def global_layer_index(module: torch.nn.Module) -> dict[str, int | None]:
    """Parameter name -> 0-based global layer index (None outside transformer layers), from the
    nearest enclosing module with an integer ``layer_number`` attribute."""
    prefixes: dict[str, int] = {}
    for mname, mod in module.named_modules():
        num = getattr(mod, "layer_number", None)
        if isinstance(num, int) and mname:
            prefixes[mname + "."] = num - 1
    out: dict[str, int | None] = {}
    for n, _ in module.named_parameters():
        best, best_len = None, -1
        for pre, idx in prefixes.items():
            if n.startswith(pre) and len(pre) > best_len:
                best, best_len = idx, len(pre)
        out[n] = best
    return out
