"""Topology-aware gradient reduction (DESIGN.md 4 and 5.4); framework-free, explicit process groups.

Layers, bottom up:
  groups.py       process groups from a plan (+ discover_plan: topology -> plan on rank 0 -> broadcast)
  collectives.py  flat / hierarchical / intra / reconcile collectives on flat tensors
  compression.py  wire dtypes, FP16 integer grid, error feedback
  classes.py      SYNC / LOCAL classes (last N layers, always_sync, importance top fraction)
  importance.py   fisher / magnitude / hutchinson scores
  buckets.py      flat gradient buckets in reverse registration order
  reconcile.py    (a)synchronous averaging of LOCAL parameters and optimizer state across groups
  stats.py        bytes and seconds per tier and class
  reducer.py      GroupedReducer
"""

from .collectives import (CollectiveError, agree_scalar, flat_all_reduce, hierarchical_all_reduce,
                          intra_all_reduce, reconcile_average)
from .groups import ReducerGroups, broadcast_plan, build_groups, discover_plan
from .reducer import ConsistencyError, GroupedReducer

__all__ = [
    "GroupedReducer", "ConsistencyError",
    "ReducerGroups", "build_groups", "broadcast_plan", "discover_plan",
    "CollectiveError", "flat_all_reduce", "hierarchical_all_reduce", "intra_all_reduce",
    "reconcile_average", "agree_scalar",
]
