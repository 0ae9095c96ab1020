"""The plan: which ranks talk to which. It owns the process groups built from a broadcast `Plan`
(`groups.py`: `ReducerGroups`, `build_groups`, the per-class communicators and their NCCL options),
turning the configured topology into a plan and delivering it to every rank (`planning.py`:
`plan_for`, `broadcast_plan`, the gathered-hostnames topology), and discovery at run time
(`discover.py`: `topology.source: auto`, node facts, the optional tier probe, and `discover_plan`,
the entry point for every source). It sits on the watch (bounded broadcasts, completion kinds).
"""

from .discover import discover_auto, discover_plan
from .groups import SYNC_KINDS, ReducerGroups, build_groups, group_options
from .planning import HOSTNAME_ENV, broadcast_plan, gather_hostnames_topology, plan_for, require_middle_level

__all__ = ["ReducerGroups", "SYNC_KINDS", "group_options", "build_groups", "broadcast_plan", "discover_plan",
           "discover_auto", "gather_hostnames_topology", "plan_for", "require_middle_level", "HOSTNAME_ENV"]
