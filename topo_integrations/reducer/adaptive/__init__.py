"""Adaptation: what the engine does when the slow tier degrades. It owns the adaptive levels
(`adaptive.py`: `AdaptiveController`, its policy and measurements; re-exported here, so
``topo_integrations.reducer.adaptive.AdaptiveController`` keeps working) and regrouping
(`regroup.py`: candidate plans, their estimates, rebuilding the groups). It sits on the wire
(probes), the plan (groups) and the classes.
"""

from .adaptive import LEVELS, AdaptiveController, AdaptivePolicy, Measurement

__all__ = ["AdaptiveController", "AdaptivePolicy", "Measurement", "LEVELS"]
