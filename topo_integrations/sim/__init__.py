"""Cost model (alpha-beta over a `Topology`) for clusters larger than any test machine.

    from topo_integrations.sim import simulate, Workload, SimOptions
    res = simulate(topo, Workload(175e9, "bf16", tp=8, pp=8, compute_s=30.0), SimOptions(rank_order="leaf"))

Equations and assumptions: docs/costmodel.md. Everything here is *simulated*.
"""

from .algorithms import ALGORITHMS, CommCost, SelectiveSpec, Stream
from .model import DTYPE_BYTES, GRADIENT_DTYPES, RANK_ORDERS, Fabric, Phase, SimError, apply_rank_order, ring_phase
from .overlap import BucketTimeline, QueuedStream, bucket_timeline, serial_timeline
from .scenario import Row, SimOptions, SimResult, simulate
from .workload import Workload, dp_groups

__all__ = [
    "ALGORITHMS", "CommCost", "SelectiveSpec", "Stream", "DTYPE_BYTES", "GRADIENT_DTYPES", "RANK_ORDERS", "Fabric",
    "Phase",
    "SimError", "apply_rank_order", "ring_phase", "BucketTimeline", "bucket_timeline", "QueuedStream",
    "serial_timeline", "Row", "SimOptions",
    "SimResult", "simulate", "Workload", "dp_groups",
]
