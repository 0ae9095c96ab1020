"""Put it together: topology + workload + options -> per-algorithm step time, bytes and seconds per tier."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ..config import BUCKET_MB_MIN, CommunicationConfig, LocalConfig, SyncConfig, resolve_bucket_mb, resolve_sync
from ..topology.model import Topology
from .algorithms import (
    ALGORITHMS,
    CommCost,
    NotApplicable,
    SelectiveSpec,
    double_binary_tree,
    flat_ring,
    hierarchical_2level,
    hierarchical_3level,
    selective,
    split_groups,
)
from .model import DTYPE_BYTES, RANK_ORDERS, SIM_TIERS, Fabric, SimError, apply_rank_order, dtype_bytes
from .overlap import QueuedStream, serial_timeline
from .peers import diloco, local_sgd, powersgd
from .workload import Workload, dp_groups

__all__ = ["SimOptions", "Row", "SimResult", "simulate", "options_from_block"]

MIB = 1024 * 1024
PEERS = ("localsgd", "diloco", "powersgd")
"""Other systems' algorithms (sim/peers.py), priced only when asked for."""


def _default(section, name: str):
    """The plugin's default of a config key: the cost model prices what a user gets."""
    return section.model_fields[name].default


@dataclass(frozen=True)
class SimOptions:
    algorithms: tuple[str, ...] = tuple(k for k in ALGORITHMS if k not in PEERS)
    """Priced algorithms; the peers (``localsgd``, ``diloco``, ``powersgd``: sim/peers.py) only when asked for."""
    rank_order: str = "leaf"
    seed: int = 0
    bucket_mb: float | str = _default(CommunicationConfig, "bucket_size_mb")
    """Bucket size in MiB of gradient (in the gradient dtype). ``auto``: the plugin's algorithms
    (PLUGIN_KEYS) take it at the group count as the engine does (config.resolve_bucket_mb), the
    references keep DDP's 25 MiB; a number: every algorithm."""
    overlap: bool = True
    inter_dtype: str | None = None
    """Wire dtype of the plugin's cross-group phases (hier2-b2b, hier3*); None = gradient dtype.
    The NCCL-style baseline ``hier2`` always uses the gradient dtype."""
    group_by: str = "island"
    top_fraction: float | str = _default(SyncConfig, "top_fraction")
    """selective's SYNC share by importance; ``auto``: from the group count (config.resolve_sync)."""
    last_n_layers: int = _default(SyncConfig, "last_n_layers")
    last_n_share: float | None = None
    """Share of the gradient in the last N layers; None = last_n_layers / layers per pipeline stage."""
    promote_fraction: float = _default(LocalConfig, "promote_drift_fraction")
    """SYNC share added by drift promotion (the budget; spent early in the runs measured)."""
    sync_dtype: str = _default(SyncConfig, "dtype")
    """``auto``: from the group count (config.resolve_sync)."""
    local_dtype: str = _default(LocalConfig, "dtype")
    reconcile_dtype: str = _default(LocalConfig, "reconcile_dtype")
    reconcile_interval: int = _default(LocalConfig, "reconcile_interval")
    stream_fragments: int = _default(LocalConfig, "stream_fragments")
    moments_interval: int = _default(LocalConfig, "moments_interval")
    """Adam's two moments of LOCAL tensors are averaged at every this many-th reconciliation."""
    moments_dtype: str = _default(LocalConfig, "moments_dtype")
    """Wire of the moment average (a lossy one sends the change since the last average)."""
    async_reconcile: bool = _default(LocalConfig, "async_reconcile")
    localsgd_period: int = 4
    """Post-local SGD (``localsgd``): parameters averaged over all ranks every this many steps."""
    diloco_period: int = 16
    """DiLoCo (``diloco``): the fp32 pseudo-gradient all-reduced across islands every this many steps (H)."""
    powersgd_rank: int = 4
    """PowerSGD (``powersgd``): the rank r of its low-rank approximation (PyTorch's
    ``matrix_approximation_rank``)."""

    def validate(self) -> None:
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad or not self.algorithms:
            raise SimError(f"algorithm {bad[0] if bad else ''!r}; expected a comma list of {list(ALGORITHMS)}")
        if self.rank_order not in RANK_ORDERS:
            raise SimError(f"rank order = {self.rank_order!r}; expected one of {list(RANK_ORDERS)}")
        if self.group_by not in ("island", "leaf"):
            raise SimError(f"group_by = {self.group_by!r}; expected 'island' or 'leaf'")
        if self.bucket_mb != "auto" and not (isinstance(self.bucket_mb, (int, float))
                                              and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise SimError(f"bucket size = {self.bucket_mb!r} MiB; expected a positive number")
        for what in ("sync_dtype", "local_dtype", "reconcile_dtype", "moments_dtype"):
            if not (what == "sync_dtype" and self.sync_dtype == "auto"):
                dtype_bytes(getattr(self, what), what)
        if self.inter_dtype is not None:
            dtype_bytes(self.inter_dtype, "inter_dtype")
        if isinstance(self.last_n_layers, bool) or not isinstance(self.last_n_layers, int) or self.last_n_layers < 0:
            raise SimError(f"last_n_layers = {self.last_n_layers!r}; expected an integer >= 0")
        for what in ("moments_interval", "localsgd_period", "diloco_period", "powersgd_rank"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimError(f"{what} = {v!r}; expected an integer >= 1")
        if not (isinstance(self.promote_fraction, (int, float)) and 0.0 <= self.promote_fraction <= 1.0):
            raise SimError(f"promote_fraction = {self.promote_fraction!r}; expected a number in [0, 1]")


def options_from_block(block, base: SimOptions) -> SimOptions:
    """Take the selective/communication settings of a validated TopoAlignConfig."""
    if block is None:
        return base
    return replace(
        base,
        bucket_mb=block.communication.bucket_size_mb, overlap=block.communication.overlap,
        inter_dtype=block.communication.inter_dtype, group_by=block.topology.group_by,
        top_fraction=block.sync.top_fraction, last_n_layers=block.sync.last_n_layers,
        sync_dtype=block.sync.dtype, local_dtype=block.local.dtype, reconcile_dtype=block.local.reconcile_dtype,
        reconcile_interval=block.local.reconcile_interval, async_reconcile=block.local.async_reconcile,
        stream_fragments=block.local.stream_fragments,
        moments_interval=block.local.moments_interval, promote_fraction=block.local.promote_drift_fraction,
        moments_dtype=block.local.moments_dtype,
    )


@dataclass
class Row:
    key: str
    label: str
    comm_s: float
    """One collective over the whole gradient, no buckets, no overlap."""
    latency_s: float
    bucket_latency_s: float
    n_buckets: int
    busy_s: float
    """Link time of the busiest stream with buckets (sum of bucket times)."""
    exposed_s: float
    """Communication not hidden behind backward compute (incl. blocking reconciliation)."""
    step_s: float
    tier_bytes_per_gpu: dict[str, float]
    tier_seconds: dict[str, float]
    tier_share: dict[str, float]
    bottleneck: str
    background_s: float = 0.0
    speedup_vs_ring: float = math.nan
    speedup_vs_hier2: float = math.nan
    comm_speedup_vs_ring: float = math.nan

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SimResult:
    topology: dict
    workload: dict
    options: dict
    compute_s: float
    backward_s: float
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    method: dict | None = None
    """What `method: auto` would choose here (sim/choose.py ``MethodChoice.to_json``), when asked for."""

    def row(self, key: str) -> Row:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(key)

    def to_json(self) -> dict:
        return {
            "format": "topo-align/simulate/v1",
            "topology": self.topology, "workload": self.workload, "options": self.options,
            "compute_s": self.compute_s, "backward_s": self.backward_s,
            "rows": [r.to_json() for r in self.rows], "notes": self.notes, "elapsed_s": self.elapsed_s,
            "method_choice": self.method,
        }


def _cost(key: str, fab: Fabric, groups, wl: Workload, opt: SimOptions, spec: SelectiveSpec) -> CommCost:
    g_bytes = wl.grad_bytes
    inter = wl.grad_elements * DTYPE_BYTES[opt.inter_dtype] if opt.inter_dtype else g_bytes
    if key == "ring":
        return flat_ring(fab, groups, g_bytes)
    if key == "tree":
        return double_binary_tree(fab, groups, g_bytes)
    if key == "hier2":
        return hierarchical_2level(fab, groups, g_bytes, pipelined=True, group_by=opt.group_by)
    if key == "hier2-b2b":
        return hierarchical_2level(fab, groups, g_bytes, pipelined=False, inter_bytes=inter, group_by=opt.group_by)
    if key == "hier3":
        return hierarchical_3level(fab, groups, g_bytes, pipelined=True, inter_bytes=inter)
    if key == "hier3-b2b":
        return hierarchical_3level(fab, groups, g_bytes, pipelined=False, inter_bytes=inter)
    if key == "selective":
        return selective(fab, groups, wl.grad_elements, spec, group_by=opt.group_by)
    if key == "localsgd":
        return local_sgd(fab, groups, wl.grad_elements, DTYPE_BYTES[wl.grad_dtype], DTYPE_BYTES["fp32"],
                         opt.localsgd_period, group_by=opt.group_by)
    if key == "diloco":
        return diloco(fab, groups, wl.grad_elements, DTYPE_BYTES[wl.grad_dtype], opt.diloco_period,
                      group_by=opt.group_by)
    if key == "powersgd":
        return powersgd(fab, groups, wl.grad_elements, wl.params, wl.num_layers, opt.powersgd_rank)
    raise SimError(f"algorithm {key!r}; expected one of {list(ALGORITHMS)}")


def _row(cost: CommCost, fab: Fabric, wl: Workload, opt: SimOptions, compute_s: float, backward_s: float,
         bucket_mb: float) -> Row:
    bucket_bytes = bucket_mb * MIB
    # The streams share the engine's one issuing queue (overlap.serial_timeline).
    tl = serial_timeline([QueuedStream(s.grad_fraction * wl.grad_bytes, s.bandwidth_s, s.latency_s, s.held_until)
                          for s in cost.streams], bucket_bytes, backward_s, opt.overlap)
    exposed, busy, nb = tl.exposed_s, tl.busy_s, tl.n_buckets
    blat = max((s.latency_s for s in cost.streams), default=0.0)
    bg = cost.background_s()
    if cost.background and cost.background_blocking:
        exposed += bg
    elif cost.background:
        # An asynchronous reconciliation's correction is applied after the next optimizer step
        # (reconcile/reconciler.py), so each launch must land within one step, in the time the queue
        # is idle in that step; what does not fit stalls the step, once per launch.
        idle = max(0.0, compute_s + exposed - busy)
        per = bg / cost.launch_rate
        exposed += cost.launch_rate * sum(w * max(0.0, k * per - idle) for w, k in cost.launch_scales)
    world = fab.world_size
    tb = {t: v / world for t, v in cost.tier_bytes().items()}
    ts = cost.tier_seconds()
    tot = sum(ts.values())
    share = {t: (v / tot if tot > 0 else 0.0) for t, v in ts.items()}
    return Row(
        key=cost.key, label=cost.label, comm_s=cost.comm_s(),
        latency_s=max((s.latency_s for s in cost.streams), default=0.0),
        bucket_latency_s=blat, n_buckets=nb, busy_s=busy, exposed_s=exposed, step_s=compute_s + exposed,
        tier_bytes_per_gpu=tb, tier_seconds=ts, tier_share=share,
        bottleneck=max(SIM_TIERS, key=lambda t: ts[t]) if tot > 0 else "-", background_s=bg,
    )


# The algorithms the plugin runs (its engine resolves `auto` buckets); the rest are references
# (stock DDP / NCCL: 25 MiB buckets) and the peers (PEERS, DDP's 25 MiB too).
PLUGIN_KEYS = ("hier2-b2b", "hier3-b2b", "selective")


def _n_groups(fab: Fabric, groups, opt: SimOptions) -> int:
    """How many groups (replicas of the LOCAL tensors, members of a rail) the plan makes here."""
    try:
        return int(split_groups(fab, groups, opt.group_by)[1].shape[1])
    except ValueError:  # unequal groups: selective is not applicable, its row says so
        return 1


def _bucket_mb(key: str, n_groups: int, opt: SimOptions) -> float:
    """The bucket size an algorithm runs with (``auto``: the engine's, for the plugin's algorithms)."""
    if opt.bucket_mb != "auto":
        return float(opt.bucket_mb)
    return resolve_bucket_mb("auto", n_groups) if key in PLUGIN_KEYS else BUCKET_MB_MIN


def _resolved_sync(fab: Fabric, groups, opt: SimOptions, notes: list[str]) -> tuple[str, float]:
    """selective's ``sync.dtype`` / ``sync.top_fraction``, each ``auto`` taken at the number of
    groups the plan makes here (topo_integrations/config.resolve_sync, as the engine does)."""
    if opt.sync_dtype != "auto" and opt.top_fraction != "auto":
        return opt.sync_dtype, float(opt.top_fraction)
    n_groups = _n_groups(fab, groups, opt)
    dtype, frac = resolve_sync(opt.sync_dtype, opt.top_fraction, n_groups)
    if "selective" in opt.algorithms:
        notes.append(f"selective: sync.dtype / sync.top_fraction auto at {n_groups} groups: {dtype}, {frac:g}")
    return dtype, frac


def simulate(topo: Topology, wl: Workload, opt: SimOptions = SimOptions()) -> SimResult:
    """Price every algorithm of ``opt.algorithms`` (plus the ring and NCCL-style 2-level references)."""
    t0 = time.perf_counter()
    opt.validate()
    world = topo.world_size
    wl.validate(world)
    notes: list[str] = []
    if wl.assumed and wl.compute_s is None:
        notes.append("compute per step assumed: " + "; ".join(wl.assumed))
    topo = apply_rank_order(topo, opt.rank_order, seed=opt.seed)
    fab = Fabric.from_topology(topo)
    groups = dp_groups(world, wl.tp, wl.pp)
    if opt.last_n_share is not None:
        last_share = opt.last_n_share
    elif wl.num_layers:
        per_stage = wl.num_layers / wl.pp
        last_share = min(1.0, opt.last_n_layers / per_stage)
        if wl.pp > 1:
            notes.append(f"selective: the last pipeline stage holds the last {opt.last_n_layers} layers "
                         f"({last_share:.0%} of its gradient); it sets the step time, so its share is used")
    else:
        last_share = 0.0
        if "selective" in opt.algorithms:
            notes.append("selective: layer count unknown (no --num-layers), last-N share taken as 0")
    sync_dtype, top_fraction = _resolved_sync(fab, groups, opt, notes)
    n_groups = _n_groups(fab, groups, opt)
    if opt.bucket_mb == "auto" and resolve_bucket_mb("auto", n_groups) != BUCKET_MB_MIN:
        notes.append(f"buckets auto at {n_groups} groups: {resolve_bucket_mb('auto', n_groups):g} MiB for the "
                     f"plugin's algorithms ({', '.join(PLUGIN_KEYS)}), {BUCKET_MB_MIN:g} MiB for the rest")
    spec = SelectiveSpec(
        top_fraction=top_fraction, last_n_share=min(1.0, last_share + opt.promote_fraction),
        sync_bytes=DTYPE_BYTES[sync_dtype], grad_bytes=DTYPE_BYTES[wl.grad_dtype],
        local_bytes=DTYPE_BYTES[opt.local_dtype], reconcile_bytes=DTYPE_BYTES[opt.reconcile_dtype],
        moments_bytes=2.0 * DTYPE_BYTES[opt.moments_dtype] / opt.moments_interval,
        moments_interval=opt.moments_interval,
        reconcile_interval=opt.reconcile_interval, async_reconcile=opt.async_reconcile,
        stream_fragments=min(opt.stream_fragments, opt.reconcile_interval),
    )
    spec.validate()
    compute_s = wl.compute_seconds(world)
    backward_s = compute_s * wl.backward_share
    keys = list(dict.fromkeys(["ring", "hier2", *opt.algorithms]))
    if "nccl" in keys and "tree" not in keys:
        keys.insert(keys.index("nccl"), "tree")
    rows: dict[str, Row] = {}
    for k in keys:
        if k == "nccl":
            continue
        try:
            cost = _cost(k, fab, groups, wl, opt, spec)
        except NotApplicable as exc:
            if k == "ring":
                raise
            notes.append(f"{k}: not applicable: {exc}")
            continue
        rows[k] = _row(cost, fab, wl, opt, compute_s, backward_s, _bucket_mb(k, n_groups, opt))
    if "nccl" in keys and "tree" in rows:
        # NCCL's tuner picks the algorithm per message size; every bucket has the same size, so the
        # faster of the two per bucket (here: per step) is what NCCL would run.
        best = min((rows["ring"], rows["tree"]), key=lambda r: (r.step_s, r.comm_s))
        rows["nccl"] = replace(best, key="nccl", label=f"{ALGORITHMS['nccl']}: {best.key}")
    if "ring" not in rows:
        raise SimError("the flat ring could not be priced")
    ring = rows["ring"]
    h2 = rows.get("hier2")
    for r in rows.values():
        r.speedup_vs_ring = ring.step_s / r.step_s if r.step_s > 0 else math.nan
        r.speedup_vs_hier2 = h2.step_s / r.step_s if (h2 and r.step_s > 0) else math.nan
        r.comm_speedup_vs_ring = ring.comm_s / r.comm_s if r.comm_s > 0 else math.nan
    out_rows = [rows[k] for k in keys if k in rows and (k in opt.algorithms or k in ("ring", "hier2"))]
    out_rows.sort(key=lambda r: list(ALGORITHMS).index(r.key))
    summ = topo.summary()
    summ.pop("tiers_present", None)
    wl_info = {
        "params": wl.params, "grad_dtype": wl.grad_dtype, "tp": wl.tp, "pp": wl.pp, "dp": wl.dp(world),
        "grad_elements_per_gpu": wl.grad_elements, "grad_bytes_per_gpu": wl.grad_bytes,
        "num_layers": wl.num_layers, "source": wl.source, "selective_sync_fraction": spec.sync_fraction,
        "mfu": wl.mfu, "peak_tflops": wl.peak_tflops, "tokens_per_step": wl.tokens_per_step,
        "assumed": list(wl.assumed),
    }
    opts = dict(opt.__dict__)
    opts["algorithms"] = list(opt.algorithms)
    return SimResult(summ, wl_info, opts, compute_s, backward_s, out_rows, notes, time.perf_counter() - t0)
