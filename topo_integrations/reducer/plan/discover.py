"""`topology.source: auto` at run time: gather every rank's node facts, build the topology on the
first data-parallel rank, optionally measure the tiers (`topology.probe`), plan, broadcast the plan.

The pure parts (facts -> `Topology`, probe groups, the table) are in topology/; this module only
communicates. Every step is bounded: a rank that does not answer within ``fallback.timeout_s`` ends
discovery on every other rank with a `TopologyTimeout` naming it, and a rank whose facts cannot be
read sends its error instead, so every rank raises the same `TopologyError` (never a hang).
"""

from __future__ import annotations

import datetime
import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ...config import TopoAlignConfig
from ...topology import Plan, PlanError, TopologyError
from ...topology.discovered import probe_groups, topology_from_facts, with_measured
from ...topology.facts import NodeFacts, collect_node_facts
from ...topology.model import Topology, TopologyTimeout
from ...topology.report import format_topology
from ..watch.thread_device import object_device
from .planning import broadcast_plan, load_configured_topology, local_hostname, plan_for, unwrap_plan

__all__ = ["discover_auto", "discover_plan", "gather_facts", "probe_tiers", "PROBE_BYTES", "PROBE_ITERS"]

log = logging.getLogger("topo_align")

PROBE_BYTES = {"gloo": 4 << 20, "nccl": 64 << 20}
"""Bytes of the timed all-reduce per backend (others use the gloo size): large enough that the
time is set by bandwidth, not latency, on the tier it measures."""
PROBE_ITERS = 5


def _short(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else ", ".join(map(str, ranks[:4])) + f", ... ({len(ranks)})"


def _wait_for_peers(dp_ranks: list[int], timeout_s: float) -> None:
    """Bounded arrival check before the gather: every rank bumps its own counter in the job's store,
    then waits until every member of the group has reached the same count (the n-th discovery of
    this process). Raises `TopologyTimeout` naming the ranks that did not arrive."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:  # a torch without it: the gather is then bounded by the group's own timeout
        return
    store = get_store()
    me = dist.get_rank()
    mine = store.add(f"topo_align/discover/{me}", 1)
    deadline = time.monotonic() + timeout_s
    waiting = [r for r in dp_ranks if r != me]
    while waiting:
        waiting = [r for r in waiting if store.add(f"topo_align/discover/{r}", 0) < mine]
        if waiting and time.monotonic() > deadline:
            raise TopologyTimeout(
                f"topo_align: discovery: global rank(s) {_short(waiting)} did not answer within "
                f"{timeout_s:g} s (fallback.timeout_s) while gathering node facts over the data-parallel group "
                f"(global ranks {_short(dp_ranks)}); this is global rank {me}")
        if waiting:
            time.sleep(0.05)


def gather_facts(dp_ranks: list[int], dp_group, timeout_s: float) -> list[NodeFacts]:
    """Every DP rank's node facts, by DP position, on every rank.

    Phases: 1. read this node (errors are kept, not raised, so the others do not wait);
    2. the bounded arrival check; 3. one `all_gather_object` over the DP group; 4. the first error,
    if any, is raised on every rank naming its rank and host.
    """
    try:
        lr = os.environ.get("LOCAL_RANK")
        mine: Any = ("ok", collect_node_facts(local_rank=int(lr) if lr and lr.isdigit() else None).to_json())
    except TopologyError as exc:
        mine = ("error", str(exc))
    _wait_for_peers(dp_ranks, timeout_s)
    gathered: list[Any] = [None] * len(dp_ranks)
    dist.all_gather_object(gathered, mine, group=dp_group)
    by_rank = dict(zip(sorted(dp_ranks), gathered))  # all_gather orders by ascending global rank
    out = []
    for r in dp_ranks:
        kind, body = by_rank[r]
        if kind == "error":
            raise TopologyError(f"topo_align: discovery: global rank {r} could not read its node: {body}")
        out.append(NodeFacts.from_json(body, who=f"facts of global rank {r}"))
    return out


def _timed(t: torch.Tensor, group, cuda: bool) -> float:
    """Seconds of one all-reduce, completion-timed: after `wait()` and, on CUDA, a synchronize of the
    stream it ran on (wait() makes the current stream wait for the collective's stream)."""
    t0 = time.perf_counter()
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    if cuda:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def probe_tiers(groups_by_tier: dict[str, list[list[int]]], timeout_s: float,
                backend: str) -> dict[str, tuple[float, float]]:
    """Per tier, in my group of it: median seconds of PROBE_ITERS all-reduces of PROBE_BYTES, and the
    fastest of PROBE_ITERS 1-element all-reduces (the latency).

    Phases: 1. every rank of the job creates every probe group, tier by tier, in the given order
    (`new_group` is collective over the world), and per tier of several groups a fence group of all
    their members; 2. per tier, the members of each group time a warm-up and PROBE_ITERS rounds of:
    a 1-element all-reduce over the tier's fence group, so that every group of the tier starts the
    round together (they share NICs as in training: a group that ran alone while another was late
    would get the whole link, and measure up to twice its share), a timed 1-element all-reduce, a
    timed PROBE_BYTES one; 3. groups destroyed.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    me = dist.get_rank()
    mine: dict[str, tuple[Any, list[int]]] = {}
    fences: dict[str, Any] = {}
    made = []
    for tier, groups in groups_by_tier.items():
        for ranks in groups:
            pg = dist.new_group(ranks=ranks, timeout=timeout)
            made.append(pg)
            if me in ranks:
                mine[tier] = (pg, ranks)
        if len(groups) > 1:
            members = sorted({r for ranks in groups for r in ranks})
            fence_pg = dist.new_group(ranks=members, timeout=timeout)
            made.append(fence_pg)
            if me in members:
                fences[tier] = fence_pg
    cuda = backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    numel = PROBE_BYTES.get(backend, PROBE_BYTES["gloo"]) // 4
    out: dict[str, float] = {}
    try:
        for tier, (pg, ranks) in mine.items():
            t0 = time.perf_counter()
            try:
                buf, fence = torch.zeros(numel, device=device), torch.zeros(1, device=device)
                _timed(buf, pg, cuda)
                times, small = [], []
                for _ in range(PROBE_ITERS):
                    _timed(fence, fences.get(tier, pg), cuda)
                    small.append(_timed(fence, pg, cuda))  # the members left the fence together
                    times.append(_timed(buf, pg, cuda))
            except Exception as exc:  # noqa: BLE001 - named, with the group and the time waited
                raise TopologyError(
                    f"topo_align: topology.probe: all_reduce on the {tier} tier group (global ranks {_short(ranks)}) "
                    f"failed after {time.perf_counter() - t0:.1f} s (timeout {timeout_s:g} s; this is global rank "
                    f"{me}): {type(exc).__name__}: {exc}") from exc
            # latency: the fastest round (a floor: scheduling and queueing only add to it)
            out[tier] = (statistics.median(times), min(small))
    finally:
        for pg in made:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - a group this rank is not in, or already gone
                pass
    return out


def _measured(groups_by_tier: dict[str, list[list[int]]], seconds: dict[int, dict[str, tuple[float, float]]],
              nbytes: int) -> dict[str, tuple[float, str, float]]:
    """Per tier, of its slowest group (a group is as slow as its slowest member): the bus bandwidth
    (as nccl-tests: 2(n-1)/n x bytes / time) and the latency of one step of a ring all-reduce (the
    1-element all-reduce's time over its 2(n-1) steps, as the cost model prices a ring: sim/model.py),
    the latter bandwidth-free (8 bytes), so it holds the fabric's and the library's per-message cost."""
    out = {}
    for tier, groups in groups_by_tier.items():
        best: tuple[float, list[int], float] | None = None
        for ranks in groups:
            t = max(seconds[r][tier][0] for r in ranks)
            small = max(seconds[r][tier][1] for r in ranks)
            n = len(ranks)
            bw = 2 * (n - 1) / n * nbytes / t / 1e9
            if best is None or bw < best[0]:
                best = (bw, ranks, small / (2 * (n - 1)) * 1e6)
        if best is not None:
            out[tier] = (best[0], f"median of {PROBE_ITERS} all-reduces of {nbytes / 2**20:g} MiB (latency: fastest "
                                  f"of {PROBE_ITERS} 1-element ones), slowest of {len(groups)} group(s): global ranks "
                                  f"{_short(best[1])}", best[2])
    return out


def _probe(topo: Topology | None, cfg: TopoAlignConfig, dp_ranks: list[int], dp_group, src: int) -> Topology | None:
    """Phases: 1. the first DP rank sends its probe groups (DP positions -> global ranks) over the DP
    group; 2. when there are several DP groups, every rank gathers every group's probe groups over the
    world (each group creates its own; `new_group` needs every rank); 3. `probe_tiers`; 4. the
    timings gathered to every DP rank; the first applies them."""
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload[0] = {t: [[dp_ranks[p] for p in g] for g in gs] for t, gs in probe_groups(topo).items()}
    dist.broadcast_object_list(payload, src=src, group=dp_group, device=object_device(dp_group))
    mine = payload[0]
    every = {t: sorted(gs) for t, gs in mine.items()}
    if dp_group is not None and len(dp_ranks) != dist.get_world_size():
        all_lists: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_lists, mine)
        tiers = sorted({t for d in all_lists for t in d})
        every = {t: sorted({tuple(g) for d in all_lists for g in d.get(t, [])}) for t in tiers}
        every = {t: [list(g) for g in gs] for t, gs in every.items()}
    backend = dist.get_backend(dp_group)
    secs = probe_tiers(every, cfg.fallback.timeout_s, backend)
    gathered: list[Any] = [None] * len(dp_ranks)
    dist.all_gather_object(gathered, secs, group=dp_group)
    if dist.get_rank() != src:
        return None
    seconds = dict(zip(sorted(dp_ranks), gathered))
    nbytes = PROBE_BYTES.get(backend, PROBE_BYTES["gloo"]) // 4 * 4
    return with_measured(topo, _measured(mine, seconds, nbytes))


def _error(exc: Exception) -> tuple[str, str, str]:
    kind = type(exc).__name__ if isinstance(exc, (PlanError, TopologyError)) else "ValueError"
    return ("error", "TopologyError" if kind == "TopologyTimeout" else kind, str(exc))


def discover_auto(cfg: TopoAlignConfig, dp_ranks: list[int], dp_group) -> tuple[Any, int]:
    """The `auto` discovery (module docstring) up to the plan: returns ``(plan or error payload, src)``
    for `planning.broadcast_plan`-style delivery; only the first DP rank holds a plan."""
    src = dp_ranks[0]
    facts = gather_facts(dp_ranks, dp_group, cfg.fallback.timeout_s)
    topo: Topology | None = None
    failure: Any = None
    if dist.get_rank() == src:
        try:
            topo = topology_from_facts(facts, source="auto")
        except TopologyError as exc:
            failure = _error(exc)
    if cfg.topology.probe:
        flag: list[Any] = [failure]
        dist.broadcast_object_list(flag, src=src, group=dp_group, device=object_device(dp_group))
        if flag[0] is not None:
            return flag[0], src
        topo = _probe(topo, cfg, dp_ranks, dp_group, src)
    if dist.get_rank() != src:
        return None, src
    if failure is not None:
        return failure, src
    for w in topo.warnings:
        log.warning("topo_align: %s", w)
    log.info("topo_align: discovered topology\n%s", format_topology(topo))
    try:
        plan: Any = plan_for(cfg, topo)
    except (TopologyError, ValueError) as exc:
        return _error(exc), src
    log.info("topo_align: plan: %s -- %s", "hierarchical" if plan.hierarchical else "one flat all-reduce",
             plan.reason)
    return plan, src


def discover_plan(cfg: TopoAlignConfig, *, dp_ranks: list[int] | None = None, dp_group=None) -> Plan:
    """Topology per ``cfg.topology``, planned on the first DP rank and broadcast to the group.

    Phases:
      0. `auto`: reducer/plan/discover.py gathers every rank's node facts (bounded by fallback.timeout_s),
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
    if cfg.topology.source == "auto":  # reducer/plan/discover.py: node facts, optional probe, plan
        result, src = discover_auto(cfg, dp_ranks, dp_group)
        if isinstance(result, tuple):
            payload = [result]
            dist.broadcast_object_list(payload, src=src, group=dp_group, device=object_device(dp_group))
            return unwrap_plan(payload[0])
        return broadcast_plan(result, dp_group, src=src)
    hosts = None
    if cfg.topology.source == "hostnames":
        gathered = [None] * len(dp_ranks)
        dist.all_gather_object(gathered, local_hostname(), group=dp_group)
        # all_gather orders by group rank (ascending global rank); the plan indexes DP positions
        by_rank = dict(zip(sorted(dp_ranks), gathered))
        hosts = [by_rank[r] for r in dp_ranks]
    src = dp_ranks[0]
    result: Any = None
    if dist.get_rank() == src:
        try:
            topo = load_configured_topology(cfg, hosts, len(dp_ranks))
            result = plan_for(cfg, topo)
        except (TopologyError, ValueError) as exc:
            kind = type(exc).__name__ if isinstance(exc, (PlanError, TopologyError)) else "ValueError"
            payload = [("error", kind, str(exc))]
            dist.broadcast_object_list(payload, src=src, group=dp_group, device=object_device(dp_group))
            return unwrap_plan(payload[0])
    return broadcast_plan(result, dp_group, src=src, timeout_s=cfg.fallback.timeout_s)
