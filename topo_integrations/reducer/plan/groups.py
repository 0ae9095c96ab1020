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
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ...topology import Plan
from ..watch.completion import backstop_timeout_s, completion_kind

__all__ = ["ReducerGroups", "SYNC_KINDS", "group_options", "build_groups"]

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
    """With ``monitor.check_collectives``: the schedule's :class:`~topo_integrations.reducer.schedule.order.Trace`
    (every collective on these groups leaves its fingerprint there)."""
    schedule: Any = None
    """The process's :class:`~topo_integrations.reducer.schedule.Schedule` issuing on these groups
    (attached by the first engine; every engine on these groups shares it)."""
    watch: Any = None
    """The schedule's :class:`~topo_integrations.reducer.watch.completion.Watch` (deadlines of collectives
    in flight)."""

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
