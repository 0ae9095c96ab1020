"""Adaptive regrouping: estimate candidate groupings from measured tier bandwidths and rebuild the
engine's groups when one is clearly faster (the adaptive controller decides when; docs/reliability.md).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..classes.classes import SYNC
from ..kinds import Mode
from ..wire.compression import wire_dtype

__all__ = ["estimate_step_comm_s", "choose_plan", "regroup", "renew_controller"]

log = logging.getLogger("topo_align")


def estimate_step_comm_s(plan, nbytes: float, intra_gbps: float, inter_gbps: float) -> float:
    """Alpha-free estimate of one hierarchical all-reduce of ``nbytes`` under ``plan`` with measured
    per-rank bus bandwidths: intra reduce-scatter + all-gather (2(L-1)/L of the bytes) plus the rail
    all-reduce of the 1/L shard (2(K-1)/K of it). A flat plan: one ring over all ranks at the
    slower bandwidth."""
    if not plan.hierarchical:
        n = plan.world_size
        return 2 * (n - 1) / n * nbytes / (min(intra_gbps, inter_gbps) * 1e9)
    L, K = len(plan.intra_groups[0]), len(plan.inter_groups)
    return (2 * (L - 1) / L * nbytes / (intra_gbps * 1e9)
            + 2 * (K - 1) / K * nbytes / L / (inter_gbps * 1e9))


def choose_plan(candidates: dict, nbytes: float, measured: dict) -> tuple[str, dict]:
    """The candidate (name -> Plan) with the lowest estimated time; ``measured`` maps name ->
    ``(intra_gbps, inter_gbps)`` as probed (or derated) for that grouping. Returns the name and every
    estimate (deterministic: ties go to the first name in sorted order)."""
    est = {k: estimate_step_comm_s(p, nbytes, *measured[k]) for k, p in candidates.items()}
    best = min(sorted(est), key=lambda k: est[k])
    return best, est


def regroup(engine, plan, optimizer=None, *, reason: str = "") -> None:
    """Rebuild the engine's groups from ``plan`` at a reconciliation boundary; every rank agrees.

    Collective over the default group (every rank of the job calls it, at the same step):
      1. blocking reconciliation (`selective`): every replica identical, nothing in flight;
      2. DP position 0's plan is broadcast over the DP group (the one every rank uses);
      3. ``build_groups`` on every rank, in one fixed order (same timeout as before);
      4. ``engine.reconfigure``: new groups, mode (flat when the new plan has one tier), configured
         classes, interval and wire; the adapter's listener rebuilds its buckets; the adaptive
         controller re-calibrates.
    The old groups are not destroyed (a live communicator may still be referenced by a framework).
    Only an engine whose data-parallel group is the whole world can be regrouped here.
    ``engine`` may be a GroupedReducer (its engine is used).
    """
    from ..plan.groups import build_groups
    from ..plan.planning import broadcast_plan

    engine = getattr(engine, "engine", engine)
    g = engine.groups
    if len(g.dp_ranks) != dist.get_world_size():
        raise ValueError("topo_align: regroup needs the data-parallel group to be the whole world "
                         f"({len(g.dp_ranks)} of {dist.get_world_size()} ranks)")
    if engine.mode is Mode.SELECTIVE:
        engine.reconcile(engine.reconciler.source)
    engine.dispatcher.drain()
    plan = engine.call(lambda: broadcast_plan(plan if g.position == 0 else None, g.dp_group, src=g.dp_ranks[0],
                                              timeout_s=engine.cfg.fallback.timeout_s), "broadcast(regroup plan)")
    new = build_groups(plan, timeout_s=engine.cfg.fallback.timeout_s)
    new.device = engine.device
    old_desc = [list(x) for x in g.plan.intra_groups]
    cfg = engine.cfg
    ctrl = engine.adaptive
    classes = dict(ctrl.saved_classes) if ctrl is not None and ctrl.saved_classes else dict(engine.classes)
    mode = Mode(cfg.mode) if plan.hierarchical else Mode.FLAT
    if mode is not Mode.SELECTIVE:
        classes = {n: SYNC for n in classes}
    wire = cfg.sync.dtype if mode is Mode.SELECTIVE else cfg.communication.inter_dtype
    engine.reconfigure(groups=new, mode=mode, classes=classes, reconcile_interval=cfg.local.reconcile_interval,
                       sync_dtype=wire_dtype(wire))
    if ctrl is not None:
        renew_controller(engine, ctrl, {"step": engine.step, "from": "groups", "to": "regrouped",
                                        "reason": reason, "measurement": {}})
    if new.position == 0:
        log.warning("topo_align: adaptive: step %d: regrouped from intra groups %s to %s%s", engine.step,
                    old_desc, [list(x) for x in plan.intra_groups], f": {reason}" if reason else "")


def renew_controller(engine, ctrl, event: dict) -> None:
    """A fresh adaptive controller for ``engine`` after its groups or its method changed (the levels
    that apply, the base interval and wire follow the new setting; it re-calibrates), keeping the
    record (checks, events plus ``event``, regroup decisions) and the regrouping seams."""
    # The controller's own class (adaptive.py, which imports this module): no import back.
    fresh = type(ctrl)(engine, ctrl.cfg, levels=ctrl.allowed)
    fresh.regroup_margin = ctrl.regroup_margin
    fresh.regroup_source = ctrl.regroup_source
    fresh.regroup_decisions = list(ctrl.regroup_decisions)
    fresh.checks = list(ctrl.checks)  # the record continues across the rebuild
    fresh.events = ctrl.events + [event]
    engine.adaptive = fresh
