"""Topology model, sources and the group planner (pure Python; no torch.distributed needed to plan)."""

from .file_source import load_topology_file, topology_from_dict, topology_to_dict
from .hostlist import compress_hostlist, expand_hostlist
from .hostnames import topology_from_hostnames
from .model import DEFAULT_TIERS, TIER_NAMES, RankPlace, Tier, Topology, TopologyError
from .planner import Plan, PlanError, plan_groups
from .sources import KINDS, load_source, load_sources

__all__ = [
    "DEFAULT_TIERS", "TIER_NAMES", "RankPlace", "Tier", "Topology", "TopologyError",
    "Plan", "PlanError", "plan_groups",
    "load_topology_file", "topology_from_dict", "topology_to_dict",
    "expand_hostlist", "compress_hostlist",
    "KINDS", "load_source", "load_sources", "topology_from_hostnames",
]
