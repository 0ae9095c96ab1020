"""Reconciliation: what adapters hand over to be averaged across groups (`ReconcileItem`, the
reconcile sources), which fragment is due at a step, the average in flight (`PendingAverage`) and
the reconciler part of the engine (`ReconcileMixin`), all in `reconcile.py` (re-exported here, so
``topo_integrations.reducer.reconcile.fragments`` keeps working). It sits on the classes.
"""

from .reconcile import (
    ParamReconcileSource,
    PendingAverage,
    ReconcileItem,
    ReconcileMixin,
    ReconcileSource,
    due_fragment,
    fragments,
    is_second_moment,
)

__all__ = ["ReconcileItem", "ReconcileSource", "ParamReconcileSource", "ReconcileMixin", "PendingAverage",
           "is_second_moment", "fragments", "due_fragment"]
