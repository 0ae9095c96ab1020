"""`method: auto` at run time: time the compute of the first steps, choose the method with the cost
model (sim/choose.py) on DP position 0, switch every rank at a step boundary; choose again when the
adaptive monitor sees the slow tier move (docs/costmodel.md, section 6).

Every candidate is a setting of mode `selective` (``sync.dtype``, ``sync.top_fraction``,
``local.reconcile_interval``), so a switch is what the engine already does at a class refresh or an
adaptive level: new classes, wire dtype and interval through ``Engine.reconfigure`` at a step
boundary (the adapter's listener rebuilds its buckets). Nothing is lost: leaving a LOCAL class first
reconciles, blocking, parameters and optimizer moments (every replica identical, nothing in flight);
entering one from every tensor SYNC starts from identical replicas. The adaptive controller is
renewed after a switch (regroup.py ``renew_controller``): its levels depend on the method.

Phases of a choice (every rank calls :meth:`MethodAuto.after_step` at the same steps):
  1. steps 2 .. ``TIMED_STEPS + 1``: compute per step = wall time of the step minus the time the
     caller blocked on the engine's collectives (the first step is a warm-up). On CUDA the host runs
     ahead of the device and does not block on a bucket, so the host clock would time the
     enqueueing: the step is timed between timing events on the training stream, less that stream's
     waits for the communication stream (event pairs the dispatcher records meanwhile) and the host's
     blocking waits; the host waits once, for the last event, when the steps are timed;
  2. every rank times the int8 wire's own work on its device at once (:func:`int8_codec_seconds`:
     at once, so that ranks sharing cores time it as the steps run it); DP position 0 predicts every
     candidate (``choose_for_groups``: its plan's groups and slow tier, the gradient, the median
     compute, that codec time) and logs the one line;
  3. it broadcasts ``[candidate, H]`` over the DP group; every rank applies it (the same classes: the
     parameters are identical, so their magnitudes rank alike).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from ...config import LOCAL_CLASS_KEYS
from ...sim import SimError, SimOptions
from ...sim.choose import CANDIDATES, MethodInputs, choose_for_groups, method_config
from ...topology.model import DEFAULT_TIERS
from ..classes.auto_sync import with_keys
from ..classes.importance import Importance
from ..wire.collectives import run
from ..wire.compression import INT8_BLOCK, dequantize_blocks, padded_numel, quantize_blocks, wire_dtype
from .regroup import renew_controller

__all__ = ["MethodAuto", "TIMED_STEPS", "RECHOOSE_FACTOR", "applied_keys", "int8_codec_seconds"]

log = logging.getLogger("topo_align")

TIMED_STEPS = 4
"""Steps whose compute is timed before the choice (steps 2-5: the first is a warm-up)."""
RECHOOSE_FACTOR = 2.0
"""The adaptive monitor's achieved slow-tier bandwidth against its reference, beyond which (either
way) the method is chosen again."""
_GRAD_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def int8_codec_seconds(numel: int, device: torch.device, repeats: int = 3) -> float:
    """Seconds per step of the int8 wire's own work for a rank's ``numel``-element share of the slow
    tier's payload: quantise with error feedback and decode, twice (lossy_wire.py: the all-to-all's
    payload, then the sum's chunk for the all-gather; the chunk is smaller, so this is an upper
    bound), the median of ``repeats`` after a warm-up, on ``device`` (synchronised on CUDA)."""
    n = padded_numel(max(1, int(numel)), INT8_BLOCK)
    # gradient-like values without the generator (a draw here would move the run's random stream)
    v = torch.arange(n, dtype=torch.float32, device=device).mul_(0.37).sin_()
    residual = torch.zeros_like(v)
    cuda = device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(2):
            dequantize_blocks(*quantize_blocks(v, residual))
        if cuda:
            torch.cuda.synchronize(device)
        if i:  # the first is a warm-up (allocations)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class MethodAuto:
    """The engine's part for ``method: auto`` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.method: str | None = None
        """The candidate in effect (None while timing)."""
        self.interval: int | None = None
        self.inputs: MethodInputs | None = None
        """What the latest choice was made on (DP position 0 only)."""
        self.samples: list[float] = []
        self.events: list[dict] = []
        """Every choice: step, method, H and (DP position 0) the log line."""
        self._mark: tuple | None = None
        """The latest step end: (host clock or CUDA timing event, the dispatcher's ``waited_s``)."""
        self._timed: list[tuple] = []
        """CUDA: per timed step (start event, end event, stream waits, host-blocked seconds)."""
        self.local_only = sorted(k for k in engine.cfg.explicit_keys() if k.startswith(LOCAL_CLASS_KEYS))
        """LOCAL-class keys the user set: they mean a LOCAL class (docs/costmodel.md, section 6)."""

    # ------------------------------------------------------------------ timing and the first choice

    def after_step(self) -> None:
        """Time this step; choose once ``TIMED_STEPS`` steps are timed (collective over the DP group)."""
        if self.method is not None:
            return
        if self.engine.dispatcher.cuda:
            self._after_step_cuda(self.engine.dispatcher)
            return
        now, waited = time.perf_counter(), self.engine.dispatcher.waited_s
        if self._mark is not None:
            self.samples.append(max(0.0, (now - self._mark[0]) - (waited - self._mark[1])))
        if len(self.samples) >= TIMED_STEPS:
            first = self.engine.step - TIMED_STEPS + 1
            self._choose(f"timed over steps {first}-{self.engine.step}", None)
        else:
            self._mark = (time.perf_counter(), self.engine.dispatcher.waited_s)

    def _after_step_cuda(self, d) -> None:
        """:meth:`after_step` on CUDA (phase 1 of the module docstring)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(d.device))
        if self._mark is not None:
            self._timed.append((self._mark[0], ev, d.device_waits or [], d.waited_s - self._mark[1]))
        d.device_waits = []
        if len(self._timed) < TIMED_STEPS:
            self._mark = (ev, d.waited_s)
            return
        ev.synchronize()  # once: every timed step's events have landed
        self.samples = [max(0.0, (a.elapsed_time(b) - sum(x.elapsed_time(y) for x, y in waits)) / 1e3 - host)
                        for a, b, waits, host in self._timed]
        self._timed, d.device_waits = [], None
        first = self.engine.step - TIMED_STEPS + 1
        self._choose(f"timed over steps {first}-{self.engine.step}, on the device", None)

    def _inputs(self, compute_from: str, codec_s: float, elements: int) -> MethodInputs:
        e = self.engine
        cfg, plan, pol = e.cfg, e.groups.plan, e.policy
        params = [p for p in pol.params.values() if p is not None]
        dtype = _GRAD_DTYPES.get(params[0].dtype, "fp32") if params else "fp32"
        fixed = pol.fixed_sync_fraction()
        loc = cfg.local
        opt = SimOptions(bucket_mb=float(cfg.communication.bucket_size_mb), overlap=cfg.communication.overlap,
                         last_n_share=fixed, promote_fraction=loc.promote_drift_fraction, local_dtype=loc.dtype,
                         reconcile_dtype=loc.reconcile_dtype, moments_dtype=loc.moments_dtype,
                         moments_interval=loc.moments_interval, async_reconcile=loc.async_reconcile)
        lat = {t: (getattr(plan, f"{t}_latency_us", None) or DEFAULT_TIERS[getattr(plan, f"{t}_tier")].latency_us)
               for t in ("inter", "intra")}
        # The LOCAL candidate as it would run: its keys less the user's, its fixed SYNC share exact.
        lcfg = with_keys(cfg, applied_keys("local", None, self.local_only))
        lopt = replace(opt, last_n_layers=lcfg.sync.last_n_layers, last_n_share=pol.fixed_sync_fraction(lcfg.sync),
                       promote_fraction=lcfg.local.promote_drift_fraction)
        return MethodInputs(e.groups.inter_size, e.groups.intra_size, plan.inter_bandwidth_gbps, lat["inter"],
                            f"{plan.inter_tier}, {plan.inter_origin}", float(elements), dtype,
                            statistics.median(self.samples), compute_from, plan.intra_bandwidth_gbps, lat["intra"],
                            opt, local_only=bool(self.local_only), codec_s=codec_s, local_options=lopt)

    def _choose(self, compute_from: str | None, scale: float | None, why: str = "") -> bool:
        """Position 0 chooses (from timed steps, or the latest inputs with the slow tier ``scale`` x as
        fast), broadcasts ``[candidate, H]``, every rank applies it. Returns whether it changed."""
        e = self.engine
        g = e.groups
        line = None
        msg = [-1.0, 0.0]
        # Every rank at once (phase 2): ranks that share cores time the codec as their steps run it.
        # A rank's share of the slow tier's payload: its island's reduce-scatter leaves it 1/intra.
        elements = sum(e.policy.numels.values())
        codec_s = 0.0
        if scale is None and not self.local_only:
            codec_s = int8_codec_seconds(elements // max(1, g.intra_size), e.device)
        if g.position == 0:
            try:
                if scale is not None and self.inputs is None:
                    raise SimError("no compute timed since the run resumed")
                inp = self._inputs(compute_from, codec_s, elements) if scale is None else self.inputs.scaled(
                    scale, f"{self.inputs.slow_origin}, x{scale:.3g} as measured by the adaptive monitor")
                choice = choose_for_groups(inp)
                self.inputs, line = inp, choice.line()
                msg = [float(CANDIDATES.index(choice.method)), float(choice.reconcile_interval or 0)]
            except SimError as exc:
                line = f"topo_align: method auto: cannot predict ({exc}); keeping {self.method or 'int8'}"
        t = e.wire.tensor(msg, dtype=torch.float64)
        if g.dp_size > 1:
            e.call(lambda: run("broadcast(method choice)", "dp", g.dp_group, g, 16, None,
                               lambda: dist.broadcast(t, src=g.dp_ranks[0], group=g.dp_group), like=t),
                   "broadcast(method choice)")
        idx, h = (int(x) for x in t.cpu().tolist())
        method = CANDIDATES[idx] if idx >= 0 else (self.method or "int8")
        changed = (method, h if method == "local" else None) != (self.method, self.interval)
        self._apply(method, h if method == "local" else None)
        self.events.append({"step": e.step, "method": method, "reconcile_interval": self.interval,
                            "changed": changed, "line": line})
        if line is not None:
            (log.warning if why else log.info)("%s%s", line, why)
        return changed

    # ------------------------------------------------------------------ switching

    def _apply(self, method: str, interval: int | None) -> None:
        """Put the engine on ``method`` at this step boundary (see the module docstring)."""
        e = self.engine
        first = self.method is None
        if (method, interval) == (self.method, self.interval):
            return
        keys = applied_keys(method, interval, self.local_only)
        if e.adaptive is not None:  # back to the configured level first (e.g. out of `flat`)
            e.adaptive.restore_base()
        if e.has_local():  # replicas identical before the classes change (moments too)
            e.reconcile(e.reconciler.source)
        e.dispatcher.drain()
        cfg = with_keys(e.cfg, keys)
        e.cfg = cfg
        e.reconciler.local = cfg.local
        pol = e.policy
        # The candidate's promotion budget too (a lean candidate's `local.promote_drift_fraction` 0
        # would otherwise keep promoting, its reconciliations blocking whenever one may follow).
        dropped = pol.set_config(cfg)
        if dropped:
            log.info("topo_align: method auto: %d promoted tensor(s) back to LOCAL (the candidate's "
                     "local.promote_drift_fraction %g): %s", len(dropped), cfg.local.promote_drift_fraction,
                     ", ".join(dropped))
        scores = None
        if pol.params and all(n in pol.params for n in pol.names):
            # Agreed over the DP group: a replica holds the whole tensor, identical everywhere, but a
            # sharded adapter (FSDP2) holds one shard per rank, whose magnitude is its own.
            mine = Importance.magnitude([pol.params[n] for n in pol.names]).double()
            scores = (e.wire.agree(mine.to(e.device), "sum", host=True) / e.groups.dp_size).tolist()
        e.reconfigure(classes=pol.classify(scores), reconcile_interval=cfg.local.reconcile_interval,
                      sync_dtype=wire_dtype(cfg.sync.dtype))
        pol.last_refresh = e.step
        self.method, self.interval = method, interval
        if e.adaptive is not None:
            renew_controller(e, e.adaptive, {"step": e.step, "from": "method", "to": method,
                                             "reason": "method auto" + (" (first choice)" if first else ""),
                                             "measurement": {}})

    # ------------------------------------------------------------------ the adaptive monitor's trigger

    def rechoose_due(self, inter_gbps: float | None, reference: float | None) -> float | None:
        """The factor the slow tier moved by (achieved / reference), when beyond ``RECHOOSE_FACTOR``
        either way; None otherwise (or while timing). Arguments agreed over the DP group."""
        if self.method is None or not inter_gbps or not reference:
            return None
        f = inter_gbps / reference
        return f if (f >= RECHOOSE_FACTOR or f <= 1.0 / RECHOOSE_FACTOR) else None

    def rechoose(self, factor: float, inter_gbps: float, reference: float) -> bool:
        """Choose again with the slow tier ``factor`` x as fast (collective over the DP group)."""
        why = (f" (re-chosen at step {self.engine.step}: the adaptive monitor measured the slow tier at "
               f"{inter_gbps:.4g} GB/s against its reference {reference:.4g} GB/s, x{factor:.3g})")
        return self._choose(None, factor, why)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"method": self.method, "reconcile_interval": self.interval, "events": [dict(x) for x in self.events]}

    def load_state_dict(self, sd: dict | None) -> None:
        """Back on the saved method without timing again (before the saved classes are restored)."""
        if not sd or sd.get("method") is None:
            return
        self.events = [dict(x) for x in sd.get("events", [])]
        self._apply(sd["method"], sd.get("reconcile_interval"))


def applied_keys(method: str, interval: int | None, user_set) -> dict:
    """The dotted keys a choice puts on the engine's config: the candidate's (``method_config``, less
    the mode), less those the user set (the config refuses the others beside `auto`; a LOCAL-class
    key such as ``local.stream_fragments`` stays the user's)."""
    keys = method_config(method, interval)
    keys.pop("mode")
    return {k: v for k, v in keys.items() if k not in set(user_set)}
