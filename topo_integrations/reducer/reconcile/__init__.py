"""Reconciliation: how the LOCAL tensors of the groups' replicas are averaged every few steps. What
adapters hand over (`ReconcileItem`, the reconcile sources), which fragment is due at a step and the
average in flight (`PendingAverage`) are in `reconcile.py`; the engine's reconciler part
(`reconciler.py`: `Reconciler`) owns the anchors, the average in flight and the reconciliation
counters, and their state. Re-exported here, so ``topo_integrations.reducer.reconcile.fragments``
keeps working. It sits on the classes and the wire.
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
