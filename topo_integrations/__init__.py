"""topo-align: topology-aware gradient reduction for DeepSpeed and Megatron.

The framework-free API (docs/reducer.md; the contracts: docs/design.md)::

    from topo_integrations import TopoAlignConfig, Topology, plan_groups, GroupedReducer
"""

from .config import ConfigError, TopoAlignConfig
from .topology import Plan, PlanError, Topology, TopologyError, plan_groups

__version__ = "0.1.0"

__all__ = [
    "__version__", "ConfigError", "TopoAlignConfig", "Topology", "TopologyError",
    "Plan", "PlanError", "plan_groups", "GroupedReducer",
]


def __getattr__(name: str):
    # The adapters import torch; keep `import topo_integrations` (and the CLI) light.
    if name == "GroupedReducer":
        from .torch import GroupedReducer

        return GroupedReducer
    raise AttributeError(f"module 'topo_integrations' has no attribute {name!r}")
