"""The systems `topo-align bench` compares, whether each can run here, and its theoretical bytes.

Every system trains the same GPT (same shape, initial weights from the same seed, same data, same
AdamW schedule, same clipping); they differ only in how gradients (or parameters) cross ranks.

Theoretical bytes (``theory_bytes``) are the payload an algorithm must move per training step when
it runs as designed on the given rank layout, counted per link cut the emulator measures:
``node`` = bytes leaving a node (sum over node uplinks), ``leaf`` = bytes leaving a leaf through the
spine. Collectives are priced as rings over their members in rank order (what gloo runs for large
tensors): an all-reduce of S bytes over m members sends 2(m-1)/m*S on each of the m ring edges, a
reduce-scatter or all-gather (m-1)/m*S; an edge counts toward a cut when its two ends sit on
different nodes (leaves). Scalars (loss, clip norm, overflow flags) are left out; wire headers and
TCP ACKs (1-3% at MTU 9000) are not payload, so measured counters sit slightly above theory.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Sequence

LOCALSGD_PERIOD = 4
"""Post-local SGD's averaging period when --reconcile-interval is not given (the bench's peer setting)."""

__all__ = ["System", "SYSTEMS", "DEFAULT_SYSTEMS", "Layout", "ring_bytes", "theory_bytes", "availability",
           "LOCALSGD_PERIOD", "LOCAL_METHODS", "resolve", "averaging_period", "is_local", "torchft_period",
           "TORCHFT_SYSTEMS", "TOPO_MODES", "topo_block", "plan_layout", "system_layout", "theory_layouts",
           "selective_parts", "TOPO_KEYS", "powersgd_rank", "powersgd_payload"]


@dataclass(frozen=True)
class Layout:
    """Where each rank sits: ``hosts[r]`` and ``leaves[r]``; ``groups`` = topo-align's intra groups
    for this preset and the system's mode (None when the plan is flat; ``system_layout``)."""

    hosts: tuple[str, ...]
    leaves: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] | None
    leaf_rails: tuple[tuple[int, ...], ...] = ()
    """With ``topology.middle_level`` (3 levels): the rails inside each leaf, and the rails across
    leaves (``spine_rails``); empty for the 2-level form."""
    spine_rails: tuple[tuple[int, ...], ...] = ()

    @property
    def world(self) -> int:
        return len(self.hosts)

    @property
    def rails(self) -> tuple[tuple[int, ...], ...]:
        assert self.groups is not None
        return tuple(zip(*self.groups))

    @property
    def ranks_per_node(self) -> int:
        return self.hosts.count(self.hosts[0])


def ring_bytes(layout: Layout, members: Sequence[int], nbytes: float, kind: str) -> dict[str, float]:
    """Bytes crossing the node and leaf cuts for one ring collective of ``nbytes`` over ``members``.
    ``kind``: ``allreduce`` (2(m-1)/m per edge) or ``scatter``/``gather`` ((m-1)/m per edge)."""
    m = len(members)
    out = {"node": 0.0, "leaf": 0.0}
    if m < 2:
        return out
    per_edge = (2.0 if kind == "allreduce" else 1.0) * (m - 1) / m * nbytes
    for i, a in enumerate(members):
        b = members[(i + 1) % m]
        if layout.hosts[a] != layout.hosts[b]:
            out["node"] += per_edge
        if layout.leaves[a] != layout.leaves[b]:
            out["leaf"] += per_edge
    return out


def _add(*parts: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    return {k: scale * sum(p[k] for p in parts) for k in ("node", "leaf")}


def flat_ring(layout: Layout, nbytes: float) -> dict[str, float]:
    return ring_bytes(layout, range(layout.world), nbytes, "allreduce")


def hierarchical(layout: Layout, nbytes: float, inter_bytes: float | None = None) -> dict[str, float]:
    """Intra reduce-scatter + rail all-reduce of the 1/k shard + intra all-gather; with three levels
    the rail step is a leaf-rail reduce-scatter of the 1/k shard, a spine-rail all-reduce of the
    1/(k*m) piece and the leaf-rail all-gather (m = islands per leaf). ``inter_bytes``: the gradient
    re-expressed in the cross-group wire's dtype (``communication.inter_dtype``; default ``nbytes``)."""
    if layout.groups is None:
        return flat_ring(layout, nbytes)
    k = len(layout.groups[0])
    ib = nbytes if inter_bytes is None else inter_bytes
    parts = [ring_bytes(layout, g, nbytes, kind) for g in layout.groups for kind in ("scatter", "gather")]
    if layout.spine_rails:
        m = len(layout.leaf_rails[0])
        parts += [ring_bytes(layout, r, ib / k, kind) for r in layout.leaf_rails for kind in ("scatter", "gather")]
        parts += [ring_bytes(layout, r, ib / (k * m), "allreduce") for r in layout.spine_rails]
    else:
        parts += [ring_bytes(layout, r, ib / k, "allreduce") for r in layout.rails]
    return _add(*parts)


def in_group(layout: Layout, nbytes: float) -> dict[str, float]:
    """An all-reduce inside each intra group only (LOCAL class, post-local-SGD's subgroup)."""
    if layout.groups is None:
        return {"node": 0.0, "leaf": 0.0}
    return _add(*[ring_bytes(layout, g, nbytes, "allreduce") for g in layout.groups])


def theory_bytes(key: str, layout: Layout, params: int, info: dict) -> dict[str, float] | None:
    """Payload bytes per training step across the node and leaf cuts for system ``key`` (fp32
    gradients of ``params`` elements), averaged over the run's ``info['steps']`` steps. ``info`` is
    what the worker reported (steps, sync_fraction, reconcile_interval, warmup...)."""
    S = 4.0 * params
    steps = max(1, int(info.get("steps", 1)))
    if key in ("ds-zero0", "ddp", "megatron-ddp", "topo-flat"):
        return flat_ring(layout, S)
    if key == "ds-zero2":
        # Gradient reduce-scatter + fp32 parameter all-gather: the bytes of one all-reduce.
        return flat_ring(layout, S)
    if key == "ddp-fp16":
        return flat_ring(layout, S / 2)
    if key.startswith("ddp-powersgd"):
        # PowerSGD (one DDP bucket): plain all-reduces until its start step, then per step three
        # all-reduces over the world (the tensors it leaves uncompressed, the P and the Q factors).
        w = min(steps, int(info.get("powersgd_start", 0)))
        small = 4.0 * float(info.get("powersgd_payload", params))
        return {k: (w * v + (steps - w) * small / S * v) / steps for k, v in flat_ring(layout, S).items()}
    if key == "megatron-distopt":
        # Instances = nodes: reduce-scatter inside the instance, all-reduce of the shard across
        # instances, parameter all-gather inside the instance: the hierarchical pattern by node.
        return hierarchical(Layout(layout.hosts, layout.leaves, _node_groups(layout)), S)  # 2 levels
    if key in ("topo-hier", "ds-topo-hier", "fsdp2-hsdp", "fsdp2-topo-hier"):
        # FSDP2 HSDP: reduce-scatter and parameter all-gathers inside the island, the fp32 shard
        # all-reduced across islands: the slow-tier bytes of the hierarchical all-reduce.
        return hierarchical(layout, S)
    if key == "topo-hier-bf16":  # the slow-tier bytes of FSDP2 HSDP with bf16 reduction
        return hierarchical(layout, S, S / 2)
    if key in ("topo-selective", "ds-topo-selective", "ds-topo-selective-z1", "topo-auto", "fsdp2-topo-selective"):
        if layout.groups is None:  # the plan is flat: selective falls back to one all-reduce
            return flat_ring(layout, S)
        parts = selective_parts(layout, params, info)
        return None if parts is None else _add(parts["sync"], parts["reconcile"])
    if averaging_period(key) is not None:
        w = min(steps, int(info.get("localsgd_warmup", 0)))
        H = int(info.get("averaging_period", 4))
        n_avg = int(info.get("averages", max(0, (steps - w)) // H))
        glob = flat_ring(layout, S)
        sub = in_group(layout, S)
        # Warm-up: DDP all-reduce over the world; then all-reduce inside the subgroup every step and
        # a world all-reduce of the parameters every H steps (HierarchicalModelAverager, one level).
        tot = {k: w * glob[k] + (steps - w) * sub[k] + n_avg * glob[k] for k in glob}
        return {k: v / steps for k, v in tot.items()}
    if torchft_period(key) is not None:
        # DDP inside the replica group (the topology group) every step; every H steps each group
        # rank all-reduces the whole fp32 model (DiLoCo: the pseudo-gradient; LocalSGD: the
        # parameters) with the same group rank of the other replica groups (its rail). The
        # lighthouse's quorum and heartbeat RPCs are not payload.
        n_sync = int(info.get("syncs", steps // max(1, int(info.get("sync_every", 4)))))
        if layout.groups is None:
            return {k: v * n_sync / steps for k, v in flat_ring(layout, S).items()}
        rails = _add(*[ring_bytes(layout, r, S, "allreduce") for r in layout.rails])
        sub = in_group(layout, S)
        return {k: sub[k] + rails[k] * n_sync / steps for k in sub}
    return None


WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1 + 4 / 256}  # int8: one fp32 scale per 256


def powersgd_rank(key: str) -> int:
    """The approximation rank a ``ddp-powersgd-rN`` key names."""
    return int(key.rsplit("-r", 1)[1])


def powersgd_payload(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD's hook all-reduces per compressed step for gradients of ``shapes`` (torch's
    powerSGD_hook: each tensor viewed as ``shape[0] x rest``; compressed to P (n x r') and Q (m x r'),
    r' = min(n, m, rank), when ``(n + m) r' min_compression_rate < n m``, else sent as it is)."""
    out = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        n = int(shape[0]) if len(shape) else 1
        m = numel // max(1, n)
        r = min(n, m, rank)
        out += (n + m) * r if (n + m) * r * min_compression_rate < n * m else numel
    return out


def selective_parts(layout: Layout, params: int, info: dict) -> dict[str, dict[str, float]] | None:
    """Selective's bytes per step across the node and leaf cuts, by what crosses them, on a
    two- or three-level ``layout`` (its plan for mode ``selective``; ``system_layout``):

    - ``sync``: the SYNC fraction (``info['sync_fraction']``) of the gradients on the ``sync.dtype``
      wire, every step, as the hierarchical pattern (intra reduce-scatter, rail all-reduce of the
      shard, intra all-gather); with groups of one rank (islands of one, issue 31) that is one
      all-reduce over the rail of every rank;
    - ``reconcile``: the LOCAL parameters (and Adam moments, ``reconcile_payload``) averaged the
      same way every ``reconcile_interval`` steps, averaged over ``info['steps']``. ZeRO-1 shards the
      moments inside the group; each shard is averaged over the rail, which crosses the node cut
      with the same bytes as the hierarchical rail step.

    LOCAL gradients are all-reduced inside each intra group only (``in_group``) and are not counted:
    that crosses no cut where the groups sit inside a node, and groups of one rank do not reduce
    LOCAL at all; with ``group_by`` leaf (the 2leaf preset) the groups span node uplinks and that
    traffic is left out, as it always was. None when the worker did not report ``sync_fraction``.
    """
    f = info.get("sync_fraction")
    if f is None or layout.groups is None:
        return None
    steps = max(1, int(info.get("steps", 1)))
    H = int(info.get("reconcile_interval", 4))
    n_rec = int(info.get("reconciles", steps // H))
    rec = hierarchical(layout, reconcile_payload(params * (1 - f), n_rec, info))
    sync = hierarchical(layout, f * params * WIRE_BYTES[info.get("sync_dtype", "fp32")])
    return {"sync": sync, "reconcile": {k: v / steps for k, v in rec.items()}}


def reconcile_payload(local_elements: float, n_rec: int, info: dict) -> float:
    """Bytes handed to the cross-group average by ``n_rec`` reconciliations of ``local_elements``
    LOCAL parameters trained with Adam (reducer/reconcile/reconcile.py):

    - values: fp32 means, or, with a 16- or 8-bit ``reconcile_dtype`` (or an outer optimizer), the deltas
      on that wire after a first exact fp32 average that sets the anchor;
    - moments (exp_avg, exp_avg_sq) at every ``moments_interval``-th reconciliation: fp32 means, or
      with a 16-bit ``moments_dtype`` their change on that wire after a first exact average.
    """
    if n_rec <= 0:
        return 0.0

    def averages(n: int, wire: float, delta: bool) -> float:
        """Bytes per element of ``n`` averages: all fp32, or the first fp32 (it sets the anchor) and
        the rest as deltas on ``wire``."""
        return 4 + (n - 1) * wire if n and delta else 4 * n

    wire = WIRE_BYTES[info.get("reconcile_dtype", "fp32")]
    values = averages(n_rec, wire, wire != 4 or bool(info.get("outer_optimizer", False)))
    mwire = WIRE_BYTES[info.get("moments_dtype", "fp32")]
    moments = 2 * averages(n_rec // max(1, int(info.get("moments_interval", 1))), mwire, mwire != 4)
    return local_elements * (values + moments)


TOPO_MODES: dict[str, str] = {
    "topo-flat": "flat", "topo-hier": "hierarchical", "topo-selective": "selective",
    "ds-topo-hier": "hierarchical", "ds-topo-selective": "selective", "ds-topo-selective-z1": "selective",
    "topo-hier-bf16": "hierarchical", "topo-auto": "selective",
    "fsdp2-topo-hier": "hierarchical", "fsdp2-topo-selective": "selective",
}
"""The ``topo_align.mode`` each topo-align system runs (trainers.build)."""
TOPO_KEYS: dict[str, dict] = {"topo-hier-bf16": {"communication": {"inter_dtype": "bf16"}},
                              "topo-auto": {"method": "auto", "topology": {"source": "auto", "probe": True}}}
"""Keys of a system's block beside its mode: hierarchical on a bf16 wire (the slow-tier bytes of
FSDP2 HSDP with bf16 reduction); `method: auto` (docs/costmodel.md, section 6) on the tiers it
measures, as a user without declared link rates runs it: host names and the probe, not the preset's
topology file (whose rates the bench's shaping may not match, e.g. with --uplink-mbit)."""


def topo_block(spec: dict, mode: str, *, async_reconcile: bool) -> dict:
    """The ``topo_align`` block a topo-align system runs with (trainers; ``system_layout`` plans
    from the same block): the worker spec's topology, the system's own keys (``TOPO_KEYS``),
    ``--sync-last-n-layers``, ``--reconcile-interval`` and ``--topo-set`` keys."""
    import copy

    from ..config import local_class_defaults

    block = {
        "enabled": True, "mode": mode,
        "topology": {"source": "file", "file": spec["topology_file"], "group_by": spec["group_by"],
                     "middle_level": bool(spec.get("middle_level", False))},
    }
    for section, value in copy.deepcopy(TOPO_KEYS.get(spec.get("system", ""), {})).items():
        if isinstance(value, dict):
            block.setdefault(section, {}).update(value)
        else:
            block[section] = value
    if block["topology"]["source"] != "file":
        block["topology"].pop("file")
    ours = {"sync.last_n_layers": spec["sync_last_n_layers"], "local.async_reconcile": async_reconcile}
    if spec.get("reconcile_interval"):  # --reconcile-interval; else topo-align's own default
        ours["local.reconcile_interval"] = spec["reconcile_interval"]
    # The bench's own LOCAL-class settings only where a LOCAL class can exist (a --topo-set
    # sync.top_fraction below 1): with every tensor SYNC (`auto`) the engine would refuse them;
    # --reconcile-interval then sets post-local SGD's period alone. --topo-set wins.
    topo_set = spec.get("topo_set", {})
    for dotted, value in {**local_class_defaults(ours, topo_set.get("sync.top_fraction", "auto")),
                          **topo_set}.items():  # --topo-set checked by BenchSpec.check
        *parents, leaf = dotted.split(".")
        node = block
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return block


def plan_layout(topo, plan) -> Layout:
    """The ``Layout`` of ``plan`` (topology.planner.Plan) on ``topo``: groups None when it is flat."""
    three = plan.hierarchical and plan.middle_level
    return Layout(tuple(r.host for r in topo.ranks), tuple(r.leaf for r in topo.ranks),
                  tuple(tuple(g) for g in plan.intra_groups) if plan.hierarchical else None,
                  leaf_rails=plan.leaf_rails if three else (), spine_rails=plan.spine_rails if three else ())


def system_layout(key: str, topo, *, topology_file: str, group_by: str, middle_level: bool = False,
                  topo_set: dict | None = None, sync_last_n_layers: int = 1,
                  reconcile_interval: int | None = None) -> Layout:
    """The layout the theory prices system ``key`` on. A topo-align system: the plan the plugin
    makes for it, ``reducer.plan.planning.plan_for`` on the config the system runs with (``topo_block``:
    its mode, group_by, middle_level, ``--topo-set`` keys such as ``topology.min_tier_ratio``), so
    ``selective`` keeps two levels on islands of one rank where the planner does (issue 31). Every
    other system: the mode-less plan of ``group_by`` (the groups post-local SGD, torchft and the
    report follow). Raises ``ValueError`` (``PlanError``) where the plugin would refuse the plan."""
    from ..topology.planner import plan_groups

    mode = TOPO_MODES.get(key)
    if mode is None:
        return plan_layout(topo, plan_groups(topo, group_by=group_by, middle_level=middle_level))
    from ..config import TopoAlignConfig
    from ..reducer.plan.planning import plan_for

    spec = {"system": key, "topology_file": topology_file, "group_by": group_by, "middle_level": middle_level,
            "sync_last_n_layers": sync_last_n_layers, "reconcile_interval": reconcile_interval,
            "topo_set": dict(topo_set or {})}
    cfg = TopoAlignConfig.model_validate(topo_block(spec, mode, async_reconcile=False))
    return plan_layout(topo, plan_for(cfg, topo))


def theory_layouts(keys: Sequence[str], topo, *, log: Callable[[str], None] = print, **plan) -> dict:
    """Per system of ``keys``: the layout its theoretical bytes are priced on (``system_layout`` with
    ``plan``'s keywords); None where the plugin would refuse the plan (the system fails at start-up
    and has no theory)."""
    out: dict = {}
    for key in dict.fromkeys(keys):
        try:
            out[key] = system_layout(key, topo, **plan)
        except ValueError as exc:
            out[key] = None
            log(f"bench: {key}: no theoretical bytes (plan refused: {str(exc).splitlines()[0]})")
    return out


def _node_groups(layout: Layout) -> tuple[tuple[int, ...], ...] | None:
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(layout.hosts):
        by_host.setdefault(h, []).append(r)
    groups = tuple(tuple(v) for v in by_host.values())
    return groups if len(groups[0]) > 1 else None


@dataclass(frozen=True)
class System:
    key: str
    label: str
    framework: str
    needs: tuple[str, ...]
    """``module`` or ``module:attribute`` that must import for the system to run."""
    note: str = ""
    install: str = ""
    """How to install what ``needs`` names when it is an optional extra (said when it does not import)."""
    default: bool = True
    """Run when ``--systems`` is not given (False: optional peers, named explicitly)."""


SYSTEMS: dict[str, System] = {s.key: s for s in [
    System("ds-zero0", "DeepSpeed ZeRO-0 (stock)", "deepspeed", ("deepspeed",)),
    System("ds-zero2", "DeepSpeed ZeRO-2 (stock)", "deepspeed", ("deepspeed",)),
    System("megatron-ddp", "Megatron-core DDP (stock)", "megatron",
           ("megatron.core.distributed:DistributedDataParallel", "topo_integrations.megatron.cpu_compat:apply"),
           "megatron-core needs CUDA; run through topo-align's CPU compatibility layer"),
    System("megatron-distopt", "Megatron-core DistOpt, instances = nodes (stock)", "megatron",
           ("megatron.core.distributed:DistributedDataParallel", "topo_integrations.megatron.cpu_compat:apply"),
           "megatron-core needs CUDA; run through topo-align's CPU compatibility layer"),
    System("ddp", "PyTorch DDP", "torch", ("torch.nn.parallel:DistributedDataParallel",)),
    System("ddp-fp16", "PyTorch DDP + fp16_compress_hook", "torch",
           ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook",)),
    System("ddp-powersgd-r1", "PyTorch DDP + PowerSGD hook (rank 1)", "torch",
           ("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook",),
           "error feedback and warm start on; one DDP bucket (gloo matches its chained all-reduces by order)",
           default=False),
    System("ddp-powersgd-r4", "PyTorch DDP + PowerSGD hook (rank 4)", "torch",
           ("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook",),
           "error feedback and warm start on; one DDP bucket (gloo matches its chained all-reduces by order)",
           default=False),
    System("post-local-sgd", "PyTorch post-local SGD + HierarchicalModelAverager", "torch",
           ("torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook:post_localSGD_hook",
            "torch.distributed.algorithms.model_averaging.hierarchical_model_averager:HierarchicalModelAverager")),
    System("topo-flat", "topo-align flat (GroupedReducer)", "topo-align",
           ("topo_integrations.torch:GroupedReducer",)),
    System("topo-hier", "topo-align hierarchical (GroupedReducer)", "topo-align",
           ("topo_integrations.torch:GroupedReducer",)),
    System("topo-selective", "topo-align selective (GroupedReducer)", "topo-align",
           ("topo_integrations.torch:GroupedReducer",)),
    System("topo-hier-bf16", "topo-align hierarchical, bf16 wire (GroupedReducer)", "topo-align",
           ("topo_integrations.torch:GroupedReducer",),
           "communication.inter_dtype bf16: the slow-tier bytes of FSDP2 HSDP with bf16 reduction", default=False),
    System("topo-auto", "topo-align method auto (GroupedReducer)", "topo-align",
           ("topo_integrations.torch:GroupedReducer",),
           "method auto: the engine times 4 steps and chooses the method (docs/costmodel.md, section 6)",
           default=False),
    System("fsdp2-hsdp", "PyTorch FSDP2 HSDP (stock), shard = node", "torch",
           ("torch.distributed.fsdp:fully_shard",),
           "fully_shard on a 2-D mesh (replicate = nodes, shard = a node's ranks); fp32 reduction", default=False),
    System("fsdp2-topo-hier", "topo-align hierarchical under FSDP2", "topo-align",
           ("torch.distributed.fsdp:fully_shard", "topo_integrations.fsdp:apply"),
           "fully_shard inside the node, the cross-node all-reduce of each shard by the engine", default=False),
    System("fsdp2-topo-selective", "topo-align selective under FSDP2", "topo-align",
           ("torch.distributed.fsdp:fully_shard", "topo_integrations.fsdp:apply"),
           "fully_shard inside the node, the shards on the engine's selective wire", default=False),
    System("ds-topo-hier", "topo-align hierarchical in DeepSpeed ZeRO-0", "topo-align",
           ("deepspeed", "topo_integrations.deepspeed:initialize")),
    System("ds-topo-selective", "topo-align selective in DeepSpeed ZeRO-0", "topo-align",
           ("deepspeed", "topo_integrations.deepspeed:initialize")),
    System("ds-topo-selective-z1", "topo-align selective in DeepSpeed ZeRO-1", "topo-align",
           ("deepspeed", "topo_integrations.deepspeed:initialize"),
           "no theoretical bytes: ZeRO-1's parameter all-gather follows DeepSpeed's partitioning"),
    System("torchft-diloco", "torchft DiLoCo (outer Nesterov SGD), replica group = node", "torchft",
           ("torchft.local_sgd:DiLoCo", "torchft.manager:Manager", "torchft._torchft:LighthouseServer"),
           "optional peer: torchft's own outer loop, lighthouse in rank 0's process",
           install="pip install -c constraints.txt -e '.[torchft]'", default=False),
    System("torchft-localsgd", "torchft LocalSGD, replica group = node", "torchft",
           ("torchft.local_sgd:LocalSGD", "torchft.manager:Manager", "torchft._torchft:LighthouseServer"),
           "optional peer: torchft's own outer loop, lighthouse in rank 0's process",
           install="pip install -c constraints.txt -e '.[torchft]'", default=False),
]}

DEFAULT_SYSTEMS: tuple[str, ...] = tuple(k for k, s in SYSTEMS.items() if s.default)
"""What runs without ``--systems`` (and without a preset's own list): every system but the optional peers."""

TORCHFT_SYSTEMS = ("torchft-diloco", "torchft-localsgd")
"""torchft's DiLoCo and LocalSGD (pip extra ``torchft``): one replica group per topology group,
DDP inside it, torchft's Manager and outer loop across groups every H steps (trainers._TorchFT)."""

LOCAL_METHODS = ("post-local-sgd", "topo-selective", "ds-topo-selective", "ds-topo-selective-z1", "topo-auto",
                 "fsdp2-topo-selective")
"""Systems whose replicas differ between groups between averagings (post-local SGD and its
``-hN`` variants, selective): validation along the run evaluates the mean of the replicas."""



def _period(key: str, base: str) -> int | None:
    """The period a ``<base>-hN`` key fixes (N >= 1); 0 for ``base`` itself; None otherwise."""
    if key == base:
        return 0
    tail = key[len(base) + 2:] if key.startswith(base + "-h") else ""
    return int(tail) if tail.isdigit() and int(tail) >= 1 else None


def torchft_period(key: str) -> int | None:
    """The sync period a torchft key fixes: ``torchft-diloco-h16`` -> 16; 0 for the plain keys (the
    bench's default period, as post-local SGD's); None for any other system."""
    return next((h for base in TORCHFT_SYSTEMS if (h := _period(key, base)) is not None), None)


def averaging_period(key: str) -> int | None:
    """Post-local SGD's averaging period a key fixes: ``post-local-sgd-h8`` -> 8; 0 for plain
    ``post-local-sgd`` (the bench's default period); None for any other system."""
    return _period(key, "post-local-sgd")


def resolve(key: str) -> System | None:
    """The system a ``--systems`` key names: one of SYSTEMS, or ``<system>-hN`` for post-local SGD
    and the torchft peers (syncing every N steps, for the sweep of the period); None when unknown."""
    if key in SYSTEMS:
        return SYSTEMS[key]
    h = torchft_period(key) or averaging_period(key)
    if not h:
        return None
    base = SYSTEMS[key.rsplit("-h", 1)[0]]
    return System(key, f"{base.label} (H={h})", base.framework, base.needs, base.note, base.install, False)


def is_local(key: str) -> bool:
    return key in LOCAL_METHODS or averaging_period(key) is not None or torchft_period(key) is not None


def availability(system: System, importer: Callable[[str], object] = importlib.import_module) -> str | None:
    """None when every requirement imports, else the reason the system cannot run here."""
    for need in system.needs:
        mod, _, attr = need.partition(":")
        try:
            m = importer(mod)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
            why = f"{mod} does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            return f"{why}; optional: {system.install}" if system.install else why
        if attr and not hasattr(m, attr):
            return f"{mod} has no {attr} (adapter not built yet)"
    return None
