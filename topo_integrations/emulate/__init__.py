"""Multi-node cluster emulation on one Linux host: network namespaces as nodes, veth pairs and
bridges as links and switches, `tc` as link speeds, real TCP (gloo) traffic. See docs/emulation.md.

Uses the topology only (no torch import)."""

from .cluster import EmulatedCluster
from .counters import CounterSnapshot, LinkCounters
from .layout import Layout, NodeSpec, SpineSpec, plan_layout
from .netns import EmulationError, EmulationUnavailable, cleanup_leftovers, unavailable_reason
from .shaping import DelayUnsupported, LinkShape

__all__ = [
    "EmulatedCluster", "CounterSnapshot", "LinkCounters", "Layout", "NodeSpec", "SpineSpec", "plan_layout",
    "EmulationError", "EmulationUnavailable", "DelayUnsupported", "LinkShape", "cleanup_leftovers",
    "unavailable_reason",
]
