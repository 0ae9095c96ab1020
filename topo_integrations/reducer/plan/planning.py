"""Plans from topologies, and their delivery to every rank of a data-parallel group.

The first data-parallel rank turns the configured topology (``topology.source``: a file, a source,
the gathered hostnames) into a `Plan` (`plan_for`, which refuses a middle level that cannot be
honoured); `broadcast_plan` hands it (or the planning error) to every rank. Below discover.py
(`topology.source: auto`), which plans with `plan_for` and delivers with `broadcast_plan` too.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

import torch.distributed as dist

from ...config import TopoAlignConfig
from ...topology import Plan, PlanError, Topology, TopologyError, plan_groups
from ...topology.machine import HOSTNAME_ENV
from ...topology.model import DEFAULT_TIERS, RankPlace
from ..watch.bounded import bounded
from ..watch.thread_device import object_device

__all__ = ["broadcast_plan", "unwrap_plan", "local_hostname", "gather_hostnames_topology",
           "load_configured_topology", "require_middle_level", "plan_for", "HOSTNAME_ENV"]

log = logging.getLogger("topo_align")


def broadcast_plan(plan: Plan | None, group=None, *, src: int | None = None,
                   timeout_s: float | None = None) -> Plan:
    """Rank ``src`` (default: the group's first rank) sends its plan; every rank returns it.

    A planning failure on the source rank travels as an error, so the other ranks raise the same
    :class:`PlanError` instead of waiting forever in the broadcast.
    Communication: one `broadcast_object_list` over ``group``, bounded by ``timeout_s``
    (``fallback.timeout_s``: the group may be the default one, whose timeout is not ours), its bytes
    on this rank's device (`object_device`: on NCCL the caller's GPU, named explicitly because the
    bounded call runs in a helper thread).
    """
    if src is None:
        src = 0 if group is None else dist.get_global_rank(group, 0)
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload[0] = ("ok", plan.dumps()) if isinstance(plan, Plan) else ("error", "PlanError", str(plan))
    device = object_device(group)
    bounded("broadcast_object_list(plan) over the data-parallel group", timeout_s,
            lambda: dist.broadcast_object_list(payload, src=src, group=group, device=device))
    return unwrap_plan(payload[0])


def unwrap_plan(msg) -> Plan:
    if msg[0] == "ok":
        return Plan.from_json(json.loads(msg[1]))
    kind, text = msg[1], msg[2]
    if kind == "TopologyError":
        raise TopologyError(text)
    if kind == "PlanError":
        raise PlanError(text)
    raise ValueError(text)


def local_hostname() -> str:
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


def load_configured_topology(cfg: TopoAlignConfig, hosts: list[str] | None, dp_size: int) -> Topology:
    kind = cfg.topology.source
    if kind == "hostnames":
        return gather_hostnames_topology(hosts or [])
    if kind == "file":
        from ...topology import load_topology_file

        topo = load_topology_file(cfg.topology.file)
    else:
        try:
            from ...topology.sources import load_source  # written by the topology-sources engineer
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
