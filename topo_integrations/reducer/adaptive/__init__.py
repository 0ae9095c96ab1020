"""Adaptation: what the engine does when the slow tier degrades. It owns the adaptive levels
(`adaptive.py`: `AdaptiveController`, its policy and measurements; re-exported here, so
``topo_integrations.reducer.adaptive.AdaptiveController`` keeps working) and regrouping
(`regroup.py`: candidate plans, their estimates, rebuilding the groups) and `method: auto`
(`method.py`: timing the compute, choosing the method with the cost model of sim/choose.py,
switching at a step boundary, choosing again when the slow tier moves). It sits on the wire
(probes), the plan (groups), the classes and the cost model (`sim`, the one `topo-align simulate` runs).
"""

from .adaptive import LEVELS, AdaptiveController, AdaptivePolicy, Measurement

__all__ = ["AdaptiveController", "AdaptivePolicy", "Measurement", "LEVELS"]
