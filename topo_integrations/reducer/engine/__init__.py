"""The engine: the one policy behind every adapter, composing the parts below. It owns the step
(`engine.py`: `Engine`, which joins the class policy, the dispatcher, the wire, reconciliation and
the adaptive controller, and its state for checkpoints) and the byte and second counts per tier and
class (`stats.py`). `Engine` and what ``topo_integrations.reducer.engine`` exported before the
split are re-exported here.
"""

from .engine import ENGINE_STATE_FORMAT, Engine, ParamReconcileSource, ReconcileItem, ReconcileSource

__all__ = ["Engine", "ReconcileItem", "ReconcileSource", "ParamReconcileSource", "ENGINE_STATE_FORMAT"]
