"""Degradation: adapt the reducer to a slow inter-group tier, in steps every rank agrees on.

Every ``adaptive.check_interval`` optimizer steps the controller measures (from the reducer's own
stats) the bytes and seconds of the inter tier since the last check, plus the wall time per step,
and decides whether the slow tier is *degraded*: its achieved bandwidth is ``slowdown_factor``
times below the reference. The reference is ``planned_inter_gbps`` when given, else the median
bandwidth achieved during the first ``window`` checks (calibration): the planner's GB/s figures are
nominal, and the wall time of a collective includes waiting for peers, so only a measured number is
comparable with a measured number.

Levels, escalated one at a time after ``window`` consecutive degraded checks (skipping those that
do not apply to the mode):

  0 ``normal``     as configured;
  1 ``reconcile``  `selective` only: reconcile every ``reconcile_factor`` x ``local.reconcile_interval``
                   steps (less LOCAL traffic on the slow tier; staleness bound grows with it);
  2 ``fp16``       the inter-group wire (``sync.dtype`` / ``communication.inter_dtype``) becomes FP16
                   with error feedback (half the bytes on the slow tier); only when that wire is fp32;
  3 ``flat``       one all-reduce over the data-parallel group, kept only where it is *measured*
                   faster: the controller runs flat for one check interval and keeps it when the wall
                   time per step is lower than at the level before, else goes back and does not try
                   flat again until the link recovers.

In `flat` the inter tier carries no reducer traffic, so the link is watched with a small probe
(an all-reduce of ``probe_bytes`` over the rail) compared with the probe's own calibration value.
After ``window`` consecutive *recovered* checks (bandwidth within ``sqrt(slowdown_factor)`` of the
reference: a hysteresis band, so a link at the threshold does not flap) the controller returns to
``normal``. Every change is logged (logger ``topo_align``, on DP position 0) with the numbers that
caused it, and recorded in :attr:`AdaptiveController.events`.

Agreement (each check): 1. every rank builds its measurement vector; 2. one SUM all-reduce over the
DP group (every rank then holds the same means); 3. every rank runs the same deterministic policy;
4. DP position 0 broadcasts the chosen level, which every rank applies (the broadcast makes the
decision authoritative even if floating-point results ever differed). Changes happen right after
an optimizer step, when no bucket is in flight; entering `flat` from `selective` first reconciles
(blocking), so every replica is identical before one all-reduce keeps them so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...config import AdaptiveConfig
from ..classes.classes import SYNC
from ..kinds import Level, Mode
from ..wire.collectives import run
from .regroup import choose_plan, regroup, renew_controller

__all__ = ["AdaptiveController", "AdaptivePolicy", "Measurement", "LEVELS"]

log = logging.getLogger("topo_align")

LEVELS: tuple[Level, ...] = tuple(Level)


@dataclass(frozen=True)
class Measurement:
    """What one check saw, averaged over the DP group."""

    inter_gbps: float | None
    """Achieved inter-tier bandwidth (payload GB/s per rank) since the last check; None when the
    inter tier carried no reducer traffic (e.g. in `flat`)."""
    probe_gbps: float | None
    """Bandwidth of the rail probe, when one ran."""
    step_s: float
    """Wall time per optimizer step since the last check."""
    steps: int


@dataclass
class AdaptivePolicy:
    """The deterministic decision rule (no communication; unit-testable). See the module docstring."""

    cfg: AdaptiveConfig
    available: tuple[str, ...]
    """Levels that apply to this reducer, in order; always starts with ``normal``."""
    planned_inter_gbps: float | None = None
    level: int = 0
    reference: float | None = None
    probe_reference: float | None = None
    calibration: list = field(default_factory=list)
    degraded_run: int = 0
    recovered_run: int = 0
    flat_trial_from: int | None = None
    """Level we left to try flat (flat is kept only when faster)."""
    flat_rejected: bool = False
    last_step_s: dict = field(default_factory=dict)
    """Wall time per step last measured at each level."""

    def __post_init__(self) -> None:
        if self.planned_inter_gbps is not None:
            self.reference = float(self.planned_inter_gbps)

    @property
    def name(self) -> str:
        return self.available[self.level]

    @property
    def calibrating(self) -> bool:
        return self.reference is None or self.probe_reference is None

    def wants_probe(self) -> bool:
        return self.probe_reference is None or self.name == Level.FLAT

    def decide(self, m: Measurement) -> tuple[int, str]:
        """New level index and the reason (empty when unchanged)."""
        self.last_step_s[self.level] = m.step_s
        if self.calibrating:
            self.calibration.append(m)
            if len(self.calibration) >= self.cfg.window:
                if self.reference is None:
                    vals = [c.inter_gbps for c in self.calibration if c.inter_gbps]
                    self.reference = statistics.median(vals) if vals else None
                probes = [c.probe_gbps for c in self.calibration if c.probe_gbps]
                self.probe_reference = statistics.median(probes) if probes else None
                if self.reference is None or self.probe_reference is None:
                    self.calibration.clear()  # nothing measured yet (e.g. no inter traffic): keep calibrating
            return self.level, ""
        # The flat trial: keep flat only when it is faster than the level we came from.
        if self.flat_trial_from is not None:
            before = self.last_step_s.get(self.flat_trial_from)
            prev = self.flat_trial_from
            self.flat_trial_from = None
            if before is not None and m.step_s >= before:
                self.flat_rejected = True
                self.degraded_run = 0
                return prev, (f"flat is not faster: {m.step_s * 1e3:.1f} ms per step in flat vs "
                              f"{before * 1e3:.1f} ms at level {self.available[prev]!r}; going back")
        if self.name == Level.FLAT:
            bw, ref, what = m.probe_gbps, self.probe_reference, "rail probe"
        else:
            bw, ref, what = m.inter_gbps, self.reference, "inter tier"
        if not bw or not ref:
            return self.level, ""
        ratio = ref / bw
        numbers = (f"{what} {bw:.4g} GB/s vs reference {ref:.4g} GB/s ({ratio:.2f}x slower), "
                   f"{m.step_s * 1e3:.1f} ms per step")
        f = self.cfg.slowdown_factor
        if ratio >= f:
            self.degraded_run += 1
            self.recovered_run = 0
        elif ratio < math.sqrt(f):
            self.recovered_run += 1
            self.degraded_run = 0
        else:
            self.degraded_run = self.recovered_run = 0
        if self.recovered_run >= self.cfg.window and self.level > 0:
            self.recovered_run = 0
            self.flat_rejected = False
            return 0, f"link recovered over {self.cfg.window} checks: {numbers}"
        if self.degraded_run >= self.cfg.window:
            self.degraded_run = 0
            nxt = self.level + 1
            if nxt < len(self.available) and self.available[nxt] == Level.FLAT:
                if self.flat_rejected:
                    return self.level, ""
                self.flat_trial_from = self.level
            if nxt < len(self.available):
                return nxt, f"inter tier degraded over {self.cfg.window} checks: {numbers}"
        return self.level, ""


class AdaptiveController:
    """Watches an :class:`~topo_integrations.reducer.engine.Engine` and changes its level (see module
    docstring). The engine calls :meth:`after_step` at the end of every optimizer step. ``levels`` are
    the levels the adapter can apply (the DeepSpeed and Megatron adapters cannot switch to `flat`:
    their framework owns the data-parallel layout)."""

    def __init__(self, engine, cfg: AdaptiveConfig | None = None, *, planned_inter_gbps: float | None = None,
                 reconcile_factor: int = 4, probe_bytes: int = 256 * 1024,
                 levels: tuple[str, ...] = LEVELS):
        engine = getattr(engine, "engine", engine)  # a GroupedReducer passes its engine
        self.engine = engine
        self.cfg = cfg or engine.cfg.adaptive
        self.reconcile_factor = int(reconcile_factor)
        self.probe_numel = max(1, int(probe_bytes) // 4)
        self.base_mode = engine.mode
        self.base_H = engine.reconciler.interval
        self.base_inter_dtype = engine.sync_dtype
        self.allowed = tuple(levels)
        g = engine.groups
        # Plain strings (a StrEnum member equals its value): the names go into saved states and logs.
        avail = [str(Level.NORMAL)]
        if g.inter is not None and g.inter_size > 1 and self.base_mode is not Mode.FLAT:
            if self.base_mode is Mode.SELECTIVE and engine.has_local() and Level.RECONCILE in levels:
                avail.append(str(Level.RECONCILE))
            # only a 4-byte wire gains from FP16 (a BF16 one, selective's default, would not shrink)
            if self.base_inter_dtype == torch.float32 and Level.FP16 in levels:
                avail.append(str(Level.FP16))
            if Level.FLAT in levels:
                avail.append(str(Level.FLAT))
        self.active = len(avail) > 1
        self.policy = AdaptivePolicy(self.cfg, tuple(avail), planned_inter_gbps=planned_inter_gbps)
        self.saved_classes: dict = {}
        self.events: list[dict] = []
        """Every change: step, from, to, reason, and the measurement."""
        self.checks: list[dict] = []
        """Every check: step, level, measurement (for tests and plots)."""
        self._last_total = self._inter_totals()
        self._last_t = time.perf_counter()
        self._last_step = engine.step
        # Adaptive regrouping (see _maybe_regroup): a plan must be this much faster (estimated) to be
        # adopted, so measurement noise does not rebuild the groups back and forth.
        self.regroup_margin = 0.2
        self.regroup_source = None
        """Test seam / extension point: ``fn(controller) -> (candidates, measured)`` replacing the probe
        (candidates: name -> Plan, must include ``"current"``; measured: name -> (intra, inter) GB/s)."""
        self.regroup_decisions: list[dict] = []
        """Every regroup evaluation: step, estimates (seconds), best, chosen (None when kept)."""
        if not self.active:
            log.info("topo_align: adaptive: nothing to adapt (mode %r, %d groups)", self.base_mode, g.inter_size)

    @property
    def level(self) -> str:
        return self.policy.name

    def _inter_totals(self) -> tuple[float, float]:
        tot = self.engine.stats_.as_dict()["total"]
        b = sum(tot["bytes"]["inter"][c] for c in ("sync", "local", "reconcile"))
        s = sum(tot["seconds"]["inter"][c] for c in ("sync", "local", "reconcile"))
        return float(b), float(s)

    def _probe(self) -> float:
        """Seconds of one all-reduce of ``probe_numel`` fp32 over my rail (timed, error-wrapped; on
        CUDA the device is synchronised so the time is the transfer's)."""
        e = self.engine
        g = e.groups
        t = torch.ones(self.probe_numel, device=e.device)
        # Wait for an average in flight (so it is not timed), then probe in the schedule; the time
        # is taken after completion (on CUDA after synchronising the stream that ran it).
        e.drain()

        def probe():
            t0 = time.perf_counter()
            run("all_reduce(probe)", "inter", g.inter_low, g, t.numel() * 4, None,
                lambda: dist.all_reduce(t, group=g.inter_low), like=t)
            if e.cuda:
                torch.cuda.current_stream(e.device).synchronize()
            return time.perf_counter() - t0

        return e.call(probe, "adaptive probe")

    def after_step(self, optimizer=None) -> None:
        """Measure and decide every ``check_interval`` steps (collective over the DP group then)."""
        e = self.engine
        if e.step % self.cfg.check_interval != 0:
            return
        if not self.active:
            self._maybe_regroup(optimizer)
            return
        now = time.perf_counter()
        b, s = self._inter_totals()
        db, ds = b - self._last_total[0], s - self._last_total[1]
        steps = max(1, e.step - self._last_step)
        step_s = (now - self._last_t) / steps
        probe_s = self._probe() if self.policy.wants_probe() else 0.0
        # Phase 1-2: one SUM all-reduce of [bytes, seconds, step seconds, probe seconds].
        vec = e.wire.tensor([db, ds, step_s, probe_s])
        tot = e.wire.agree(vec, "sum", host=True).tolist()  # the level is decided on the host
        n = e.groups.dp_size
        m = Measurement(
            inter_gbps=(tot[0] / tot[1] / 1e9) if tot[0] > 0 and tot[1] > 0 else None,
            probe_gbps=(self.probe_numel * 4 * n / tot[3] / 1e9) if tot[3] > 0 else None,
            step_s=tot[2] / n, steps=steps)
        old = self.policy.level
        # `method: auto`: a slow tier that moved by RECHOOSE_FACTOR is a new network: choose the method
        # again (m and the reference agree on every rank); the renewed controller re-calibrates.
        moved = e.method.rechoose_due(m.inter_gbps, self.policy.reference) if e.method is not None else None
        if moved is not None and not self.policy.calibrating:
            self.checks.append({"step": e.step, "level": self.level, "measurement": m.__dict__})
            e.method.rechoose(moved, m.inter_gbps, self.policy.reference)
            if e.adaptive is self:
                renew_controller(e, self, {"step": e.step, "from": "method", "to": e.method.method,
                                           "reason": "method auto kept after the slow tier moved", "measurement": {}})
            return
        # Phase 3: the policy; phase 4: position 0's choice is broadcast.
        new, reason = self.policy.decide(m)
        choice = e.wire.tensor([new], dtype=torch.int64)
        if n > 1:
            g = e.groups
            e.call(lambda: run("broadcast(adaptive level)", "dp", g.dp_group, g, 8, None,
                               lambda: dist.broadcast(choice, src=g.dp_ranks[0], group=g.dp_group), like=choice),
                   "broadcast(adaptive level)")
        new = int(choice.item())
        self.policy.level = new
        self.checks.append({"step": e.step, "level": self.policy.available[new], "measurement": m.__dict__})
        if new != old:
            self._apply(old, new, optimizer)
            ev = {"step": e.step, "from": self.policy.available[old], "to": self.policy.available[new],
                  "reason": reason, "measurement": dict(m.__dict__)}
            self.events.append(ev)
            if e.groups.position == 0:
                log.warning("topo_align: adaptive: step %d: %s -> %s: %s", e.step, ev["from"], ev["to"], reason)
        # Regrouping only from the configured level: a level change and a regroup in one check would
        # be two adaptations to one measurement (regroup returns the new controller to `normal`).
        if new == 0 and self._maybe_regroup(optimizer):
            return  # the engine now has a fresh controller (re-calibrating on the new groups)
        # Measure the next window from here (after the probe and any reconciliation made by _apply).
        self.reset_window()

    # ------------------------------------------------------------------ applying a level

    def _apply(self, old: int, new: int, optimizer, *, reconcile: bool = True) -> None:
        """Put the engine at level ``new``. ``reconcile=False`` (restoring a checkpoint) skips the
        blocking reconciliation before `flat`: the checkpoint was taken in flat, replicas identical."""
        av = self.policy.available
        want = set(av[1:new + 1])  # every level up to `new` is in effect (they accumulate)
        e = self.engine
        if Level.FLAT in want and e.mode is not Mode.FLAT:
            if e.mode is Mode.SELECTIVE and reconcile:
                e.reconcile(e.reconciler.source)  # blocking: replicas identical before one all-reduce keeps them so
            self.saved_classes = dict(e.classes)
            e.reconfigure(mode=Mode.FLAT, classes={n: SYNC for n in e.classes})
        elif Level.FLAT not in want and e.mode != self.base_mode:
            classes, self.saved_classes = self.saved_classes, {}
            e.reconfigure(mode=self.base_mode, classes=classes)
        H = self.base_H * self.reconcile_factor if Level.RECONCILE in want else self.base_H
        e.reconfigure(reconcile_interval=H,
                      sync_dtype=torch.float16 if Level.FP16 in want else self.base_inter_dtype)

    def restore_base(self) -> None:
        """Back to the configured level (before a checkpoint's level is applied)."""
        if self.policy.level != 0:
            self._apply(self.policy.level, 0, None, reconcile=False)
            self.policy.level = 0

    def state_dict(self) -> dict:
        """Everything needed to continue: the level, references, calibration and run counters, the
        flat trial, and the event log (plain Python values, picklable)."""
        p = self.policy
        return {"available": list(p.available), "level": p.level, "reference": p.reference,
                "probe_reference": p.probe_reference, "calibration": [dict(c.__dict__) for c in p.calibration],
                "degraded_run": p.degraded_run, "recovered_run": p.recovered_run,
                "flat_trial_from": p.flat_trial_from, "flat_rejected": p.flat_rejected,
                "last_step_s": dict(p.last_step_s), "events": [dict(e) for e in self.events]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` and put the reducer at the saved level (no communication).

        The reducer calls it while loading its own state, after restoring the configured classes and
        before checking the bucket layout (which depends on the level). Keys missing from older
        states keep their fresh values."""
        p = self.policy
        av = tuple(sd.get("available", p.available))
        if av != p.available:
            raise ValueError(f"adaptive state was saved with levels {list(av)}; this reducer has "
                             f"{list(p.available)} (mode or wire settings changed)")
        level = int(sd.get("level", 0))
        if not 0 <= level < len(p.available):
            raise ValueError(f"adaptive state has level {level}; accepted 0..{len(p.available) - 1}")
        old = p.level
        p.reference = sd.get("reference", p.reference)
        p.probe_reference = sd.get("probe_reference", p.probe_reference)
        p.calibration = [Measurement(**c) for c in sd.get("calibration", [])]
        p.degraded_run = int(sd.get("degraded_run", 0))
        p.recovered_run = int(sd.get("recovered_run", 0))
        p.flat_trial_from = sd.get("flat_trial_from")
        p.flat_rejected = bool(sd.get("flat_rejected", False))
        p.last_step_s = {int(k): float(v) for k, v in sd.get("last_step_s", {}).items()}
        self.events = [dict(e) for e in sd.get("events", [])]
        p.level = level
        if level != old:
            self._apply(old, level, None, reconcile=False)

    def reset_window(self) -> None:
        """Start the next measurement window now (after loading a checkpoint: its stats and step)."""
        self._last_total = self._inter_totals()
        self._last_t = time.perf_counter()
        self._last_step = self.engine.step

    # ------------------------------------------------------------------ regrouping trigger

    def _default_regroup_source(self) -> tuple[dict, dict]:
        """Probe my groups (health.probe_groups, collective over the DP group) and compare the current
        plan with `flat` (a ring at the slowest tier's bandwidth) and `transposed` (the rails become
        the groups and the groups the rails: wins when the intra tier is the congested one, e.g. a
        degraded island link). Both are measured by the same probe, no other groups are built."""
        from ...topology import plan_groups
        from ..plan.planning import gather_hostnames_topology
        from ..wire.health import probe_groups, tier_gbps

        r = self.engine
        r.drain()
        intra, inter = tier_gbps(r.call(lambda: probe_groups(r.groups, nbytes=self.probe_numel * 4, iters=2,
                                                              device=r.device), "probe of the groups"))
        cands, measured = {"current": r.groups.plan}, {}
        if intra and inter:
            measured["current"] = (intra, inter)
            n = r.groups.plan.world_size
            cands["flat"] = plan_groups(gather_hostnames_topology([f"rank{i}" for i in range(n)]))
            measured["flat"] = (min(intra, inter), min(intra, inter))
            p = r.groups.plan
            if len(p.inter_groups) > 1 and len(p.inter_groups[0]) > 1:
                cands["transposed"] = dataclasses.replace(
                    p, intra_groups=tuple(tuple(x) for x in p.inter_groups),
                    inter_groups=tuple(tuple(x) for x in p.intra_groups), intra_tier=p.inter_tier,
                    inter_tier=p.intra_tier, intra_bandwidth_gbps=p.inter_bandwidth_gbps,
                    inter_bandwidth_gbps=p.intra_bandwidth_gbps, leaf_groups=(), leaf_rails=(), spine_rails=(),
                    middle_level=False, reason="adaptive regrouping: rails and groups swapped (probe)")
                measured["transposed"] = (inter, intra)
        else:
            measured["current"] = (intra or inter or 1.0, inter or intra or 1.0)
        return cands, measured

    def _maybe_regroup(self, optimizer) -> bool:
        """At a check: estimate each candidate grouping from probe measurements and regroup when one is
        clearly faster than the current plan. Returns whether the groups were rebuilt.

        Collective over the DP group (every rank calls it at the same step):
          1. measure: the probe (``_default_regroup_source``) or the ``regroup_source`` seam;
          2. :func:`choose_plan` on every rank; a candidate other than ``current`` is chosen only when
             its estimate is at least ``regroup_margin`` below the current plan's;
          3. DP position 0 broadcasts its choice (index into the sorted candidate names, -1 = keep),
             so every rank takes the same branch even if its own numbers differed;
          4. when chosen, :func:`regroup` (which broadcasts position 0's plan and rebuilds the groups).
        """
        r = self.engine
        if not r.traits.can_regroup:
            return False  # the framework owns the data-parallel layout (DeepSpeed, Megatron adapters)
        g = r.groups
        if len(g.dp_ranks) != dist.get_world_size():
            return False  # regroup() only handles a DP group spanning the world
        if self.regroup_source is None and not g.plan.hierarchical:
            return False  # nothing to compare without a second tier to probe
        cands, measured = (self.regroup_source or type(self)._default_regroup_source)(self)
        names = sorted(cands)
        best, est = choose_plan(cands, r.cfg.communication.bucket_size_mb * 1024 * 1024, measured)
        cur = est["current"]
        pick = best if best != "current" and est[best] <= (1.0 - self.regroup_margin) * cur else None
        choice = r.wire.tensor([names.index(pick) if pick else -1], dtype=torch.int64)
        if g.dp_size > 1:
            r.call(lambda: run("broadcast(regroup choice)", "dp", g.dp_group, g, 8, None,
                               lambda: dist.broadcast(choice, src=g.dp_ranks[0], group=g.dp_group), like=choice),
                   "broadcast(regroup choice)")
        idx = int(choice.item())
        pick = names[idx] if 0 <= idx < len(names) else None
        numbers = ", ".join(f"{k} {est[k] * 1e3:.3g} ms" for k in sorted(est))
        self.regroup_decisions.append({"step": r.step, "estimates": dict(est), "best": best, "chosen": pick})
        if pick is None:
            log.debug("topo_align: adaptive: step %d: keeping the groups (estimated comm per bucket: %s)",
                      r.step, numbers)
            return False
        reason = (f"plan {pick!r} estimated {est[pick] * 1e3:.3g} ms vs current {cur * 1e3:.3g} ms per bucket "
                  f"(>= {self.regroup_margin:.0%} faster; {numbers}; measured GB/s (intra, inter): "
                  f"{ {k: tuple(round(x, 4) for x in v) for k, v in sorted(measured.items())} })")
        regroup(r, cands[pick], optimizer, reason=reason)
        return True
