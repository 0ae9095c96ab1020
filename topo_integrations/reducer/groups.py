"""Process groups for the reducer, built identically on every rank from a broadcast `Plan`.

`torch.distributed.new_group` is a collective over the *default* group: every rank of the job must
call it for every group, in the same order, even for groups it is not a member of. So
:func:`build_groups` walks every data-parallel group of the job (with tensor/pipeline parallelism
there are several), and for each one creates the same kinds of groups in a fixed order; each rank
keeps the handles of the groups that contain it.

The plan indexes *positions* 0..dp_size-1 inside one data-parallel group; `dp_ranks` maps a
position to its global rank. Every data-parallel group uses the same layout.

Each class of traffic gets its own communicators (``intra``/``inter`` for SYNC, ``intra_low``/
``inter_low`` for LOCAL and reconciliation; likewise the leaf and spine rails of a 3-level plan):
the two classes then progress concurrently and a collective of one class never queues behind the
other. On NCCL the SYNC communicators use high-priority streams (`group_options`). The ordering
rule that keeps this deadlock-free is in docs/reducer.md ("One schedule").
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..config import TopoAlignConfig
from ..topology import Plan, PlanError, Topology, TopologyError, plan_groups
from ..topology.machine import HOSTNAME_ENV
from ..topology.model import DEFAULT_TIERS, RankPlace
from .collectives import bounded
from .completion import backstop_timeout_s, completion_kind

__all__ = ["ReducerGroups", "SYNC_KINDS", "group_options",
           "build_groups", "broadcast_plan", "discover_plan", "gather_hostnames_topology",
           "HOSTNAME_ENV"]

log = logging.getLogger("topo_align")



@dataclass
class ReducerGroups:
    """This rank's view of the reducer's process groups (see module docstring)."""

    plan: Plan
    dp_ranks: tuple[int, ...]
    """Global rank of each data-parallel position (the plan indexes positions)."""
    dp_group: Any
    """The whole data-parallel group (None = the default world group)."""
    position: int
    """My index in `dp_ranks`."""
    intra: Any
    """My intra group (island); the DP group when the plan has one tier."""
    inter: Any
    """My rail; None when the plan has one tier (inter_size is then 1 and no collective uses it)."""
    intra_low: Any
    inter_low: Any
    leaf_rail: Any = None
    """With ``topology.middle_level``: my rail inside my leaf (position i of every island of the leaf)."""
    spine_rail: Any = None
    """With ``topology.middle_level``: the ranks holding my leaf-rail chunk in every leaf (the spine hop)."""
    leaf_rail_low: Any = None
    spine_rail_low: Any = None
    leaf_rail_size: int = 1
    """Members of my leaf rail; 1 unless three levels are in use (see :attr:`three_level`)."""
    spine_rail_size: int = 1
    intra_size: int = 1
    inter_size: int = 1
    group_index: int = 0
    """Which intra group this rank is in (the replica id in `selective`)."""
    intra_rank: int = 0
    """My rank inside my intra group (= the shard a reduce-scatter hands me)."""
    inter_rank: int = 0
    """My rank inside my inter group (rail)."""
    intra_ranks: tuple[int, ...] = ()
    """Global ranks of my intra group, ascending (the group's rank order)."""
    inter_ranks: tuple[int, ...] = ()
    """Global ranks of my rail, ascending: the i-th smallest rank of every island, i = intra_rank."""
    timeout_s: float | None = None
    names: dict = field(default_factory=dict)
    """id(group) -> human-readable description, for error messages."""
    device: Any = None
    """The communication device: every tensor handed to a collective on these groups lives there
    (set by the engine: the CUDA device with NCCL, the CPU with gloo)."""
    trace: Any = None
    """With ``monitor.check_collectives``: the schedule's :class:`~topo_integrations.reducer.order.Trace`
    (every collective on these groups leaves its fingerprint there)."""
    schedule: Any = None
    """The process's :class:`~topo_integrations.reducer.schedule.Schedule` issuing on these groups
    (attached by the first engine; every engine on these groups shares it)."""
    watch: Any = None
    """The schedule's :class:`~topo_integrations.reducer.completion.Watch` (deadlines of collectives in flight)."""

    def ranks_of(self, group: Any) -> tuple[int, ...]:
        """Global ranks of a group handle of this object (the DP group for None)."""
        if group is None:
            return tuple(sorted(self.dp_ranks))
        try:
            return tuple(sorted(dist.get_process_group_ranks(group)))
        except (RuntimeError, ValueError):
            return ()

    @property
    def hierarchical(self) -> bool:
        return self.plan.hierarchical

    @property
    def three_level(self) -> bool:
        """Reduce across groups in two hops (leaf rail, then spine rail) instead of one rail hop."""
        return self.leaf_rail is not None and self.leaf_rail_size > 1 and self.spine_rail_size > 1

    @property
    def dp_size(self) -> int:
        return len(self.dp_ranks)

    def describe(self, group: Any) -> str:
        """'intra group (global ranks 0, 1)' for a group handle of this object."""
        if group is None:
            return f"data-parallel group (global ranks {_short(self.dp_ranks)})"
        return self.names.get(id(group), "process group")


def _short(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    return ", ".join(map(str, ranks[:4])) + f", ... ({len(ranks)} ranks)"


SYNC_KINDS = ("intra", "inter", "leaf_rail", "spine_rail")
"""Group kinds that carry SYNC traffic (gradients every step): high-priority streams on NCCL. The
``*_low`` kinds carry LOCAL gradients and reconciliation and keep the default priority."""


def group_options(kind: str, backend: str):
    """``pg_options`` for a group of ``kind``: on NCCL the SYNC kinds get
    ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``, so their kernels are scheduled ahead
    of LOCAL work on the GPU; None otherwise (gloo has no stream priority)."""
    if backend != "nccl" or kind not in SYNC_KINDS:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return opts


def _new_group(ranks: list[int], timeout: datetime.timedelta | None, options=None):
    # Singleton groups still go through new_group: every rank must make the same calls.
    kw = {"timeout": timeout} if timeout is not None else {}
    if options is not None:
        kw["pg_options"] = options
    return dist.new_group(ranks=sorted(ranks), **kw)


def build_groups(plan: Plan, *, dp_ranks_all: list[list[int]] | None = None,
                 timeout_s: float | None = None) -> ReducerGroups:
    """Create the reducer's groups on every rank (collective over the default group).

    Phases (every rank runs all of them, in this order):
      1. one data-parallel group per entry of `dp_ranks_all` (skipped when it is the whole world);
      2. for each kind in (intra, intra_low, inter, inter_low, leaf_rail, spine_rail) and each
         data-parallel group, one `new_group` per group of the plan, mapped to global ranks.
    Returns this rank's view. `timeout_s` bounds every collective on these groups.
    """
    if not dist.is_initialized():
        raise RuntimeError("topo_align: build_groups needs torch.distributed to be initialised "
                           "(call torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    me = dist.get_rank()
    if dp_ranks_all is None:
        dp_ranks_all = [list(range(world))]
    dp_ranks_all = [list(map(int, g)) for g in dp_ranks_all]
    sizes = {len(g) for g in dp_ranks_all}
    if len(sizes) != 1:
        raise ValueError(f"topo_align: data-parallel groups have different sizes {sorted(sizes)}; "
                         "every data-parallel group must have the same size")
    dp_size = sizes.pop()
    if dp_size != plan.world_size:
        raise ValueError(f"topo_align: the plan covers {plan.world_size} ranks but the data-parallel group "
                         f"has {dp_size}; plan the topology of one data-parallel group")
    flat = [r for g in dp_ranks_all for r in g]
    if len(set(flat)) != len(flat) or any(not 0 <= r < world for r in flat):
        raise ValueError(f"topo_align: dp_ranks_all = {dp_ranks_all!r} must list distinct global ranks "
                         f"in [0, {world})")
    mine = [g for g in dp_ranks_all if me in g]
    if not mine:
        raise ValueError(f"topo_align: global rank {me} is in no data-parallel group of {dp_ranks_all!r}")
    my_dp = mine[0]
    position = my_dp.index(me)
    # gloo blocks and raises at the group's timeout; NCCL's watchdog would kill the process there,
    # so its groups get a later backstop and the schedule's watch names and aborts first.
    backend_kind = "event" if dist.get_backend() == "nccl" else completion_kind("cpu")
    group_timeout_s = backstop_timeout_s(timeout_s, backend_kind)
    timeout = datetime.timedelta(seconds=group_timeout_s) if group_timeout_s is not None else None
    names: dict[int, str] = {}

    # Phase 1: data-parallel groups.
    dp_group = None
    if not (len(dp_ranks_all) == 1 and sorted(my_dp) == list(range(world)) and timeout is None):
        for g in dp_ranks_all:
            pg = _new_group(g, timeout)
            if me in g:
                dp_group = pg
                names[id(pg)] = f"data-parallel group (global ranks {_short(g)})"

    # Phase 2: the plan's groups, per kind, per data-parallel group. A reduce-scatter hands chunk i
    # to the member with the i-th smallest global rank, so the rails are built from the intra groups
    # in global-rank order: rail i = the i-th smallest rank of every island. Then the members of a
    # rail always hold the same shard, whatever the position -> global rank mapping.
    def intra_of(dp):
        return [sorted(dp[p] for p in g) for g in plan.intra_groups]

    def rails_of(dp):
        isl = intra_of(dp)
        return [[g[i] for g in isl] for i in range(len(isl[0]))]

    kinds = [("intra", intra_of), ("intra_low", intra_of), ("inter", rails_of), ("inter_low", rails_of)]
    three = plan.middle_level and plan.hierarchical and _chunks_line_up(plan, dp_ranks_all)
    if plan.middle_level and plan.hierarchical and not three:
        log.warning("topo_align: middle_level: the global rank order does not give the members of a spine rail "
                    "the same chunk in their island and leaf rail; reducing over 2 levels (write the ranks in "
                    "the order of `topo-align hostfile`)")
    if three:
        def leaf_rails(dp):
            return [[dp[p] for p in g] for g in plan.leaf_rails]

        def spine_rails(dp):
            return [[dp[p] for p in g] for g in plan.spine_rails]

        kinds += [("leaf_rail", leaf_rails), ("leaf_rail_low", leaf_rails),
                  ("spine_rail", spine_rails), ("spine_rail_low", spine_rails)]
    handles: dict[str, Any] = {}
    members: dict[str, tuple[int, ...]] = {}
    if not plan.hierarchical:
        # One tier: the reducer runs `flat` on the DP group. No rails (they would be dp_size
        # singleton groups, thousands of new_group calls on a large job): intra = the DP group,
        # inter = None with inter_size 1 (every collective skips a hop over one member).
        kinds = []
        handles.update(intra=dp_group, intra_low=dp_group, inter=None, inter_low=None)
        members.update(intra=tuple(sorted(my_dp)), inter=(me,))
    backend = dist.get_backend()
    for kind, make in kinds:
        options = group_options(kind, backend)
        for dp in dp_ranks_all:
            for ranks in make(dp):
                pg = _new_group(ranks, timeout, options)
                if me in ranks:
                    handles[kind] = pg
                    members[kind] = tuple(sorted(ranks))
                    names[id(pg)] = f"{kind} group (global ranks {_short(sorted(ranks))})"

    return ReducerGroups(
        plan=plan,
        dp_ranks=tuple(my_dp),
        dp_group=dp_group,
        position=position,
        intra=handles["intra"],
        inter=handles["inter"],
        intra_low=handles["intra_low"],
        inter_low=handles["inter_low"],
        leaf_rail=handles.get("leaf_rail"),
        spine_rail=handles.get("spine_rail"),
        leaf_rail_low=handles.get("leaf_rail_low"),
        spine_rail_low=handles.get("spine_rail_low"),
        leaf_rail_size=len(members.get("leaf_rail", (me,))),
        spine_rail_size=len(members.get("spine_rail", (me,))),
        intra_size=len(members["intra"]),
        inter_size=len(members["inter"]),
        group_index=plan.group_index(position),
        intra_rank=members["intra"].index(me),
        inter_rank=members["inter"].index(me),
        intra_ranks=members["intra"],
        inter_ranks=members["inter"],
        timeout_s=timeout_s,
        names=names,
    )


def _chunks_line_up(plan: Plan, dp_ranks_all: list[list[int]]) -> bool:
    """Whether every spine rail joins ranks that hold the same chunk after the island reduce-scatter
    and the leaf-rail reduce-scatter (a reduce-scatter hands chunk i to the i-th smallest global rank
    of the group), in every data-parallel group. Pure function of the plan: the same on every rank."""
    for dp in dp_ranks_all:
        where: dict[int, tuple[int, int]] = {}
        for g in plan.intra_groups:
            for i, r in enumerate(sorted(dp[p] for p in g)):
                where[r] = (i, -1)
        for g in plan.leaf_rails:
            for j, r in enumerate(sorted(dp[p] for p in g)):
                where[r] = (where[r][0], j)
        for g in plan.spine_rails:
            if len({where[dp[p]] for p in g}) != 1:
                return False
    return True


def broadcast_plan(plan: Plan | None, group=None, *, src: int | None = None,
                   timeout_s: float | None = None) -> Plan:
    """Rank ``src`` (default: the group's first rank) sends its plan; every rank returns it.

    A planning failure on the source rank travels as an error, so the other ranks raise the same
    :class:`PlanError` instead of waiting forever in the broadcast.
    Communication: one `broadcast_object_list` over ``group``, bounded by ``timeout_s``
    (``fallback.timeout_s``: the group may be the default one, whose timeout is not ours).
    """
    if src is None:
        src = 0 if group is None else dist.get_global_rank(group, 0)
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload[0] = ("ok", plan.dumps()) if isinstance(plan, Plan) else ("error", "PlanError", str(plan))
    bounded("broadcast_object_list(plan) over the data-parallel group", timeout_s,
            lambda: dist.broadcast_object_list(payload, src=src, group=group))
    return _unwrap(payload[0])


def _unwrap(msg) -> Plan:
    import json

    if msg[0] == "ok":
        return Plan.from_json(json.loads(msg[1]))
    kind, text = msg[1], msg[2]
    if kind == "TopologyError":
        raise TopologyError(text)
    if kind == "PlanError":
        raise PlanError(text)
    raise ValueError(text)


def _hostname() -> str:
    return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def gather_hostnames_topology(hosts: list[str], *, name: str = "gathered-hostnames") -> Topology:
    """Topology of ranks whose hostnames are ``hosts`` (index = DP position); islands = hosts.

    Ranks of one host need not be consecutive: the groups are whatever the hostnames say.
    """
    places = []
    seen: dict[str, int] = {}
    for r, h in enumerate(hosts):
        lr = seen.get(h, 0)
        seen[h] = lr + 1
        places.append(RankPlace(r, h, lr, h, "leaf0"))
    return Topology(tuple(places), dict(DEFAULT_TIERS), name=name, source="hostnames")


def _load_topology(cfg: TopoAlignConfig, hosts: list[str] | None, dp_size: int) -> Topology:
    kind = cfg.topology.source
    if kind == "hostnames":
        return gather_hostnames_topology(hosts or [])
    if kind == "file":
        from ..topology import load_topology_file

        topo = load_topology_file(cfg.topology.file)
    else:
        try:
            from ..topology.sources import load_source  # written by the topology-sources engineer
        except ImportError:
            raise TopologyError(
                f"topology.source = {kind!r}: this build has no loader for it "
                "(topo_integrations.topology.sources is missing); use 'file', 'auto' or 'hostnames'"
            ) from None
        topo = load_source(kind, cfg.topology.file)
    if topo.world_size != dp_size:
        raise TopologyError(
            f"{topo.source}: the topology has {topo.world_size} ranks but the data-parallel group has "
            f"{dp_size}; describe exactly the ranks of one data-parallel group"
        )
    return topo


def require_middle_level(cfg: TopoAlignConfig, plan: Plan) -> None:
    """Asked for three levels (``topology.middle_level``) and the topology cannot give them: refuse
    rather than run two (ValueError naming the key and the source)."""
    if cfg.topology.middle_level and plan.hierarchical and not plan.middle_level:
        why = "; ".join(n.split(": using 2 levels")[0] for n in plan.notes if "middle_level" in n) \
            or "no leaf tier"
        raise ValueError(
            f"topology.middle_level = true cannot be honoured with topology.source = "
            f"{cfg.topology.source!r} ({why}); give a topology with leaf switches (e.g. source 'file' "
            "or 'slurm') or remove the key")


def plan_for(cfg: TopoAlignConfig, topo: Topology) -> Plan:
    """The plan of ``topo`` for this config (group_by, min_tier_ratio, middle_level, mode), with a
    middle level that cannot be honoured refused (`require_middle_level`). Logged once (INFO): a
    `selective` plan on groups of one rank (LOCAL tensors cross no link between reconciliations)."""
    plan = plan_groups(topo, group_by=cfg.topology.group_by, min_tier_ratio=cfg.topology.min_tier_ratio,
                       middle_level=cfg.topology.middle_level, mode=cfg.mode)
    require_middle_level(cfg, plan)
    if plan.hierarchical and plan.group_size == 1:
        for note in plan.notes:
            log.info("topo_align: %s", note)
    return plan


def discover_plan(cfg: TopoAlignConfig, *, dp_ranks: list[int] | None = None, dp_group=None) -> Plan:
    """Topology per ``cfg.topology``, planned on the first DP rank and broadcast to the group.

    Phases:
      0. `auto`: reducer/discover.py gathers every rank's node facts (bounded by fallback.timeout_s),
         probes the tiers when `topology.probe`, plans on the first DP rank; then phase 3;
      1. (`hostnames` only) `all_gather_object` of each rank's hostname over the DP group
         (``$TOPO_ALIGN_HOSTNAME`` overrides it);
      2. the first DP rank loads the topology (file / source) and plans it; any error is caught;
      3. `broadcast_object_list` of the plan (or the error) over the DP group; every rank returns
         the same plan or raises the same error.
    ``dp_group`` must be given when ``dp_ranks`` is not the whole world.
    """
    if not dist.is_initialized():
        raise RuntimeError("topo_align: discover_plan needs torch.distributed to be initialised")
    world = dist.get_world_size()
    dp_ranks = list(dp_ranks) if dp_ranks is not None else list(range(world))
    if dp_group is None and dp_ranks != list(range(world)):
        raise ValueError(f"topo_align: dp_ranks = {dp_ranks!r} is not the whole world; pass dp_group too")
    if cfg.topology.source == "auto":  # reducer/discover.py: node facts, optional probe, plan
        from .discover import discover_auto

        result, src = discover_auto(cfg, dp_ranks, dp_group)
        if isinstance(result, tuple):
            payload = [result]
            dist.broadcast_object_list(payload, src=src, group=dp_group)
            return _unwrap(payload[0])
        return broadcast_plan(result, dp_group, src=src)
    hosts = None
    if cfg.topology.source == "hostnames":
        gathered = [None] * len(dp_ranks)
        dist.all_gather_object(gathered, _hostname(), group=dp_group)
        # all_gather orders by group rank (ascending global rank); the plan indexes DP positions
        by_rank = dict(zip(sorted(dp_ranks), gathered))
        hosts = [by_rank[r] for r in dp_ranks]
    src = dp_ranks[0]
    result: Any = None
    if dist.get_rank() == src:
        try:
            topo = _load_topology(cfg, hosts, len(dp_ranks))
            result = plan_for(cfg, topo)
        except (TopologyError, ValueError) as exc:
            kind = type(exc).__name__ if isinstance(exc, (PlanError, TopologyError)) else "ValueError"
            payload = [("error", kind, str(exc))]
            dist.broadcast_object_list(payload, src=src, group=dp_group)
            return _unwrap(payload[0])
    return broadcast_plan(result, dp_group, src=src, timeout_s=cfg.fallback.timeout_s)
