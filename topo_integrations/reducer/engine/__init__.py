"""The engine: the one policy behind every adapter, composed of named parts. `engine.py`'s `Engine`
joins the class policy (`classes/policy.py`), the schedule (`schedule/dispatch.py`), the wire
(`wire/wire.py`) and the reconciler (`reconcile/reconciler.py`), plus the adaptive controller, and
owns the step and its state for checkpoints; `stats.py` counts bytes and seconds per tier and class.
`Engine`, what an adapter describes to it (`EngineTensors`, `AdapterTraits`) and what
``topo_integrations.reducer.engine`` exported before the split are re-exported here.
"""

from .engine import (
    ENGINE_STATE_FORMAT,
    AdapterTraits,
    Engine,
    EngineTensors,
    ParamReconcileSource,
    ReconcileItem,
    ReconcileSource,
)

__all__ = ["Engine", "EngineTensors", "AdapterTraits", "ReconcileItem", "ReconcileSource", "ParamReconcileSource",
           "ENGINE_STATE_FORMAT"]
