"""The classes: which tensors are SYNC (reduced every step) and which LOCAL (reconciled every few
steps). It owns the class rules (`classes.py`: last N layers, ``always_sync``, importance top
fraction; re-exported here, so ``topo_integrations.reducer.classes.SYNC`` keeps working), the
importance scores (`importance.py`), the drift of LOCAL replicas and promotion to SYNC (`drift.py`),
the `ClassPolicy` that combines them (`policy.py`), what an adapter tells the engine of its tensors
and traits (`adapter_spec.py`) and what ``auto`` resolves to (`auto_sync.py`).
It imports only the config: no communication.
"""

from .classes import KNOWN_LAYER_PATTERNS, LOCAL, SYNC, classify, layer_indices, matches_any

__all__ = ["SYNC", "LOCAL", "KNOWN_LAYER_PATTERNS", "layer_indices", "matches_any", "classify"]
