"""Megatron layout flags topo-align derives from the topology when the user left them unset.

With the distributed optimizer, `TopoAlignDDP` needs Megatron's optimizer instances to be the
topology groups (ddp.py), i.e. ``--num-distributed-optimizer-instances`` = the number of groups.
The plugin knows that number once the topology is discovered, so a user who did not set the flag
gets it derived; an explicit value is never changed (a conflicting one is refused by `TopoAlignDDP`,
`instances_refusal`). It is the only layout flag derivable this way: the others (tensor, pipeline,
context and expert parallel sizes) are model choices the topology does not decide.

Phases:
  1. parse time (flags.py): `mark_derivable` gives the flag a sentinel default, `resolve_unset`
     turns the sentinel back into Megatron's default (1) and records the flag as unset on the
     namespace (``args.topo_align_unset_layout``), so nothing downstream ever sees the sentinel;
  2. after ``init_process_group``, before ``initialize_model_parallel`` builds the instance groups
     (megatron_lm.py wraps Megatron-LM's ``_initialize_distributed``; pretrain_megatron.py calls it
     itself): `derive_layout` discovers the topology (collective over the world) and sets
     ``args.num_distributed_optimizer_instances`` (`choose_instances`), logged once on rank 0.

Only where the data-parallel group is the whole world (tensor x pipeline x context parallel = 1):
otherwise the groups depend on how the model-parallel ranks sit in the nodes, and the flag keeps
Megatron's default (logged with the reason; `TopoAlignDDP` then names the value to launch with).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..config import Mode, TopoAlignConfig

__all__ = ["INSTANCES", "UNSET_ATTR", "mark_derivable", "resolve_unset", "choose_instances", "instances_refusal",
           "derive_layout", "wants_instances"]

log = logging.getLogger("topo_align")

INSTANCES = "num_distributed_optimizer_instances"
UNSET_ATTR = "topo_align_unset_layout"
"""Namespace attribute: the derivable flags (argparse dests) the user did not set."""

DERIVABLE: dict[str, int] = {INSTANCES: 1}
"""Derivable flag (argparse dest) -> Megatron's own default, which an unset flag keeps when nothing is derived."""


class _Unset:
    """Sentinel default of a derivable flag: tells "not given" from "given as 1" (argparse passes
    a non-string default through unchanged, so ``type=int`` never sees it)."""

    def __repr__(self) -> str:  # shown by ArgumentDefaultsHelpFormatter
        return "derived from the topology with --topo-align --use-distributed-optimizer, else 1"


UNSET = _Unset()


def mark_derivable(parser: argparse.ArgumentParser) -> None:
    """Give the derivable flags this parser already has the sentinel default (idempotent)."""
    for action in parser._actions:
        if action.dest in DERIVABLE and action.default in (DERIVABLE[action.dest], None):
            action.default = UNSET


def resolve_unset(ns: argparse.Namespace) -> None:
    """Replace sentinels in ``ns`` by Megatron's defaults and record which flags were unset."""
    unset = tuple(dest for dest in DERIVABLE if getattr(ns, dest, None) is UNSET)
    for dest in unset:
        setattr(ns, dest, DERIVABLE[dest])
    setattr(ns, UNSET_ATTR, unset)


def wants_instances(cfg: TopoAlignConfig | None, use_distributed_optimizer: bool) -> bool:
    """Whether `TopoAlignDDP` will shard the distributed optimizer by topology group."""
    return cfg is not None and cfg.enabled and cfg.mode != Mode.FLAT and bool(use_distributed_optimizer)


def choose_instances(explicit: int | None, plan: Any) -> tuple[int, str | None]:
    """The instance count to use and the log line saying why (None: nothing derived).

    ``explicit``: the user's value, None when unset. An explicit value is kept as given (a
    conflicting one is refused later, `instances_refusal`). Unset: the number of topology groups
    when the plan is hierarchical; otherwise Megatron's default 1 (the adapter falls back to
    Megatron's own reduction, which needs no particular instance count).
    """
    if explicit is not None:
        return explicit, None
    if not plan.hierarchical:
        return DERIVABLE[INSTANCES], None
    n = plan.num_groups
    return n, (f"topo_align: --num-distributed-optimizer-instances not set: using {n}, the number of topology "
               f"groups ({n} groups of {plan.group_size} ranks), so that the distributed optimizer shards inside "
               f"each group and only the shard crosses the slow tier ({plan.reason})")


def instances_refusal(instances: int, plan: Any) -> str:
    """The refusal when the instance count differs from the number of topology groups."""
    return (f"topo_align: with the distributed optimizer, num_distributed_optimizer_instances must equal the "
            f"number of topology groups: it is {instances}, the topology has {plan.num_groups} groups of "
            f"{plan.group_size} ranks; launch with --num-distributed-optimizer-instances {plan.num_groups}")


def derive_layout(args: Any, cfg: TopoAlignConfig | None, *, model_parallel_size: int) -> None:
    """Set the derivable flags of ``args`` the user left unset (call after ``init_process_group``,
    before ``initialize_model_parallel``; collective over the world when it discovers).

    ``model_parallel_size``: tensor x pipeline x context parallel size. Does nothing when no flag
    is pending or the plugin will not shard the optimizer by group; a flag it handled is removed
    from ``args.topo_align_unset_layout``, so a second call neither discovers nor logs again.
    """
    pending = tuple(getattr(args, UNSET_ATTR, ()))
    if INSTANCES not in pending or not wants_instances(cfg, getattr(args, "use_distributed_optimizer", False)):
        return
    import torch.distributed as dist

    setattr(args, UNSET_ATTR, tuple(d for d in pending if d != INSTANCES))
    if model_parallel_size != 1:
        if dist.get_rank() == 0:
            log.info("topo_align: --num-distributed-optimizer-instances not set and not derived: with model "
                     "parallelism (tensor x pipeline x context = %d) the data-parallel groups are not the whole "
                     "world; keeping %d (set it to the number of topology groups one data-parallel group spans)",
                     model_parallel_size, getattr(args, INSTANCES))
        return
    from ..reducer.plan.discover import discover_plan

    # The same plan TopoAlignDDP makes later for a data-parallel group that is the whole world.
    value, line = choose_instances(None, discover_plan(cfg))
    setattr(args, INSTANCES, value)
    if line and dist.get_rank() == 0:
        log.info("%s", line)
