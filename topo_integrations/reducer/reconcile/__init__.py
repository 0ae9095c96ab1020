"""Reconciliation: what adapters hand over to be averaged across groups (`ReconcileItem`, the
reconcile sources), which fragment is due at a step and the average in flight (`PendingAverage`),
in `reconcile.py`; and the engine's reconciler part (`reconciler.py`: `Reconciler`, which owns the
anchors, the average in flight and the reconciliation counters, and their state). Re-exported here,
so ``topo_integrations.reducer.reconcile.fragments`` keeps working. It sits on the classes and the wire.
"""

from .reconcile import (
    ParamReconcileSource,
    PendingAverage,
    ReconcileItem,
    ReconcileSource,
    due_fragment,
    fragments,
    is_second_moment,
)
from .reconciler import Reconciler

__all__ = ["ReconcileItem", "ReconcileSource", "ParamReconcileSource", "PendingAverage", "Reconciler",
           "is_second_moment", "fragments", "due_fragment"]
