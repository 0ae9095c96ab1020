"""Topology-aware gradient reduction (docs/reducer.md); framework-free, explicit process groups.

Layers, bottom up:
  kinds.py        Mode, Cls, Traffic, Level, Method enums;  ranges.py  flat <-> element-range copies
  groups.py       process groups from a plan (+ discover_plan: topology -> plan on rank 0 -> broadcast)
  discover.py     `topology.source: auto` at run time: node facts gathered, optional tier probe
  collectives.py  flat / hierarchical / intra / reconcile collectives on flat tensors (each one
                  completion-timed, error-named, fingerprinted with monitor.check_collectives)
  order.py        collective fingerprints and their cross-rank comparison (CollectiveOrderError)
  compression.py  wire dtypes, the FP16 scale, error feedback
  lossy_wire.py   lossy hops: all-to-all, fp32 sum by the chunk's owner, all-gather (no 16/8-bit sums)
  classes.py      SYNC / LOCAL classes (last N layers, always_sync, importance top fraction)
  importance.py   fisher / magnitude / hutchinson scores
  drift.py        drift of LOCAL replicas at reconciliation, promotion to SYNC
  stats.py        bytes and seconds per tier and class
  wire.py         Wire: the engine's collectives, error-feedback residuals by key, comm device
  recipes.py      CommBucket -> its collectives (wire dtype, residual, levels), decided once
  dispatch.py     Dispatcher: the one ordered schedule (release points, one issuing thread, futures,
                  bounded waits); every collective of an engine goes through it
  policy.py       ClassPolicy: which tensors are SYNC / LOCAL (importance, drift, classes)
  reconcile.py    what adapters hand over for reconciliation (PendingAverage: an average in flight)
  reconciler.py   Reconciler: the engine's part that averages LOCAL tensors, and its state
  adapter_spec.py EngineTensors, AdapterTraits: what an adapter tells the engine it builds
  health.py       probes and the start-of-run check of every communicator
  engine.py       Engine: composes policy, dispatcher, wire, reconciler; the step, adaptive levels, state, stats
  adaptive.py     adaptive levels when the slow tier degrades
  regroup.py      adaptive regrouping (candidate plans, estimates, rebuilding the groups)
  replicas.py     the adapters' other collectives: start-up broadcast, fingerprint gather, DP layouts

The adapters sit above: torch/ (GroupedReducer, the DDP comm hook), deepspeed/, megatron/.
"""

from .collectives import (
                          CollectiveError,
                          agree_scalar,
                          flat_all_reduce,
                          hierarchical_all_reduce,
                          intra_all_reduce,
                          reconcile_average,
)
from .engine import Engine, ParamReconcileSource, ReconcileItem
from .groups import ReducerGroups, broadcast_plan, build_groups, discover_plan

__all__ = [
    "Engine", "ReconcileItem", "ParamReconcileSource",
    "ReducerGroups", "build_groups", "broadcast_plan", "discover_plan",
    "CollectiveError", "flat_all_reduce", "hierarchical_all_reduce", "intra_all_reduce",
    "reconcile_average", "agree_scalar",
]
