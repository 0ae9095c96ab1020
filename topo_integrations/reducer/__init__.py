"""Topology-aware gradient reduction (docs/reducer.md); framework-free, explicit process groups.

Rooms by concern (docs/design.md), bottom up; a room imports only the rooms below it
(tests/test_architecture.py holds the order):
  kinds.py    the vocabulary: Mode, Cls, Traffic, Level, Method enums
  watch/      what a failure is (CollectiveError), bounded blocking calls, completion and the timeout watch
  plan/       process groups from a plan, planning and its broadcast, runtime discovery (discover_plan)
  wire/       what crosses a link: wire formats, lossy hops, the collectives (`run`), Wire, replicas, health
  schedule/   element ranges, recipes, collective order, the schedule and the Dispatcher
  classes/    SYNC / LOCAL: class rules, importance, drift, ClassPolicy, `auto`; EngineTensors, AdapterTraits
  reconcile/  what adapters hand over for reconciliation, and the Reconciler that averages it
  adaptive/   adaptive levels and regrouping when the slow tier degrades
  engine/     Engine: composes the policy, the schedule, the wire and the reconciler; the step, state, stats

The adapters sit above: torch/ (GroupedReducer, the DDP comm hook), deepspeed/, megatron/.

Module paths from before the split that users import stay importable: ``reducer.engine``,
``reducer.classes``, ``reducer.reconcile`` and ``reducer.adaptive`` are the sub-packages of those
names (each re-exports what its module exported); ``reducer.groups`` is ``reducer.plan`` (its
``__init__`` re-exports the groups, planning and discovery names) and ``reducer.collectives`` is
``reducer.wire.collectives``, both registered below under their old names.
"""

import sys as _sys

from . import plan as _plan
from .engine.engine import Engine, ParamReconcileSource, ReconcileItem
from .plan.discover import discover_plan
from .plan.groups import ReducerGroups, build_groups
from .plan.planning import broadcast_plan
from .watch.errors import CollectiveError
from .wire import collectives as _collectives
from .wire.collectives import (
                          agree_scalar,
                          flat_all_reduce,
                          hierarchical_all_reduce,
                          intra_all_reduce,
                          reconcile_average,
)

__all__ = [
    "Engine", "ReconcileItem", "ParamReconcileSource",
    "ReducerGroups", "build_groups", "broadcast_plan", "discover_plan",
    "CollectiveError", "flat_all_reduce", "hierarchical_all_reduce", "intra_all_reduce",
    "reconcile_average", "agree_scalar",
]

# The old module paths ``topo_integrations.reducer.groups`` and ``.collectives`` (module docstring):
# registered as the modules they became, so an import, an attribute and a test's spy on
# ``collectives.run`` all reach the one module object.
_sys.modules[f"{__name__}.groups"] = groups = _plan
_sys.modules[f"{__name__}.collectives"] = collectives = _collectives
