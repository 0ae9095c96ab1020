"""The selective engine: one policy and one wire behind GroupedReducer, DeepSpeed and Megatron.

An adapter owns the framework's buffers (GroupedReducer: its buckets; DeepSpeed: the engine's flat
buckets or the ZeRO partition; Megatron: the bucket groups and the optimizer's main shards) and
asks the engine everything else. The engine is built from named parts, each owning its state:

* **the policy** (``engine.policy``, :class:`~topo_integrations.reducer.classes.policy.ClassPolicy`) --
  which tensors are SYNC and which LOCAL (``engine.classes``): importance scores the adapter feeds
  with :meth:`Engine.observe` (fisher) or that are computed at refresh (magnitude; hutchinson from a
  loss closure), drift promotions, the class version and the latest refresh; recomputed from agreed
  importance every ``importance.refresh_interval`` steps, right after a blocking reconciliation;
  adapters rebuild their layout in a listener (:meth:`Engine.on_reconfigure`);
* **the schedule** (``engine.dispatcher``, dispatch.py) -- every collective (``engine.reduce(bucket,
  cls)`` -> Future) in one ordered schedule, with the current mode and wire dtypes
  (``engine.mode``, ``engine.sync_dtype`` read them);
* **the wire** (``engine.wire``, wire.py) -- the groups, the one error-feedback scheme and the
  comm device; the dispatcher holds it (a regrouping replaces it there);
* **the reconciler** (``engine.reconciler``, reconciler.py) -- every ``local.reconcile_interval``
  optimizer steps the LOCAL tensors the adapter lists (:class:`ReconcileItem`) are averaged across
  groups, blocking or asynchronously (snapshot now, correction ``x += avg(snapshot) - snapshot`` one
  step later); owns the anchors, the average in flight and the counters.

The engine itself keeps the optimizer step, the listeners, the **adaptive** controller, and composes
**state** (``state_dict``: the parts' keys in one ``topo-align/engine/v1`` dict) and **stats**.
What the adapter reduces and what it can do come as two small records (adapter_spec.py):
``Engine(cfg, groups, EngineTensors(...), device=..., traits=AdapterTraits(...))``.

Ordering rule (docs/reducer.md, "One schedule"): every collective of the engine goes through its
:class:`~topo_integrations.reducer.schedule.dispatch.Dispatcher`, released at positions fixed by the program
(SYNC buckets, then LOCAL ones, then reconciliation chunks; control at its place) and issued from one
thread, so every rank issues the same sequence on every communicator; ``monitor.check_collectives``
checks it at every step.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ...config import TopoAlignConfig
from ..classes.adapter_spec import AdapterTraits, EngineTensors
from ..classes.auto_sync import resolved_config
from ..classes.classes import LOCAL, SYNC
from ..classes.drift import DriftMonitor
from ..classes.importance import Importance
from ..classes.policy import ClassPolicy
from ..kinds import Cls, Mode, Traffic
from ..reconcile.reconcile import ParamReconcileSource, ReconcileItem, ReconcileSource
from ..reconcile.reconciler import Reconciler
from ..schedule.dispatch import CommBucket, Dispatcher
from ..schedule.order import check_requested
from ..wire.compression import wire_dtype
from ..wire.wire import Wire
from .stats import Stats

__all__ = ["Engine", "EngineTensors", "AdapterTraits", "ReconcileItem", "ReconcileSource", "ParamReconcileSource",
           "ENGINE_STATE_FORMAT"]

log = logging.getLogger("topo_align")

ENGINE_STATE_FORMAT = "topo-align/engine/v1"


class Engine:
    """Policy, schedule, wire and reconciler of one reducer (see the module docstring).

    ``tensors``: what the adapter reduces (names, sizes, layers, parameters, forced SYNC names, loss
    closure); ``traits``: what it can do (a worker thread, the adaptive levels, regrouping).
    """

    def __init__(self, cfg: TopoAlignConfig, groups, tensors: EngineTensors, *, device,
                 traits: AdapterTraits | None = None):
        # `auto` SYNC wire and share, from the planned group count (config.resolve_sync); regrouping
        # keeps what was resolved here.
        cfg, note = resolved_config(cfg, groups.inter_size if groups.hierarchical else 1)
        if note and groups.position == 0:
            log.info(note)
        self.cfg = cfg
        self.traits = traits or AdapterTraits()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # `enabled: false` keeps the framework's reduction: for the adapters that own the reduction
        # (GroupedReducer, the DDP hook) that is one flat all-reduce, as DDP does.
        mode = Mode(cfg.mode) if groups.hierarchical and cfg.enabled else Mode.FLAT
        if not cfg.enabled and groups.position == 0:
            log.info("topo_align: enabled = false: gradients go through one flat all-reduce over the "
                     "data-parallel group (the framework's own reduction)")
        self.policy = ClassPolicy(cfg, tensors, device=self.device, selective=mode is Mode.SELECTIVE)
        """The policy: which tensors are SYNC / LOCAL (policy.py): names, sizes, importance, drift, classes."""
        self.stats_ = Stats()
        wire = Wire(groups, device=self.device, error_feedback=cfg.communication.error_feedback, stats=self.stats_)
        # The schedule: every collective of this engine goes through the dispatcher (dispatch.py: one
        # ordered schedule). A thread of its own (CPU) when work should overlap the caller's.
        self.dispatcher = Dispatcher(wire, threaded=self.traits.workers or (mode is Mode.SELECTIVE and
                                                                           cfg.local.async_reconcile),
                                     timeout_s=cfg.fallback.timeout_s,
                                     check=check_requested(cfg.monitor.check_collectives))
        wire.dispatch = self.dispatcher
        sync = cfg.sync.dtype if cfg.mode == Mode.SELECTIVE else cfg.communication.inter_dtype
        self.dispatcher.configure(mode=mode, sync_dtype=wire_dtype(sync), local_dtype=wire_dtype(cfg.local.dtype))
        self.reconciler = Reconciler(cfg, self.policy, self.dispatcher, device=self.device)
        """The reconciler: anchors, the average in flight, reconciliation counters (reconciler.py)."""
        self.step = 0
        self._listeners: list[Callable[[Engine], None]] = []
        self.adaptive = None
        self.method = None
        """`method: auto` (reducer/adaptive/method.py): times the first steps, then chooses the method."""
        if cfg.method == "auto" and mode is Mode.SELECTIVE:
            from ..adaptive.method import MethodAuto

            self.method = MethodAuto(self)
        from ..wire.health import start_check

        # Every adapter builds an engine: the start-of-run check runs once per engine, in the schedule.
        self.call(lambda: start_check(self.groups), "start-of-run check")()  # verified once landed

    # ------------------------------------------------------------------ the parts' views

    @property
    def wire(self) -> Wire:
        """The wire (wire.py): the dispatcher's, replaced there by a regrouping."""
        return self.dispatcher.wire

    @property
    def groups(self):
        """The process groups (the wire's)."""
        return self.dispatcher.wire.groups

    @property
    def mode(self) -> Mode:
        """The current mode (the schedule's; an adaptive level or a regrouping may change it)."""
        return self.dispatcher.mode

    @property
    def sync_dtype(self) -> torch.dtype:
        return self.dispatcher.sync_dtype

    @property
    def local_dtype(self) -> torch.dtype:
        return self.dispatcher.local_dtype

    # ------------------------------------------------------------------ classes (policy.py)

    @property
    def selective(self) -> bool:
        return self.mode is Mode.SELECTIVE

    @property
    def classes(self) -> dict[str, str]:
        return self.policy.classes

    @property
    def names(self) -> list[str]:
        return self.policy.names

    @property
    def numels(self) -> dict[str, int]:
        return self.policy.numels

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.policy.params

    @property
    def importance(self) -> Importance:
        return self.policy.importance

    @property
    def drift(self) -> DriftMonitor:
        return self.policy.drift

    @property
    def class_version(self) -> int:
        return self.policy.class_version

    @property
    def tracks_fisher(self) -> bool:
        """Whether :meth:`observe` is worth calling (fisher scores that can change the classes)."""
        return self.policy.tracks_fisher(self.selective)

    def is_sync(self, name: str) -> bool:
        return self.policy.is_sync(name)

    def local_names(self) -> list[str]:
        return self.policy.local_names()

    def has_local(self) -> bool:
        return self.policy.has_local()

    def sync_fraction(self) -> float:
        return self.policy.sync_fraction()

    def on_reconfigure(self, fn: Callable[["Engine"], None]) -> None:
        """``fn(engine)`` runs after every change of classes, mode, wire dtype or groups."""
        self._listeners.append(fn)

    def reconfigure(self, *, classes: dict[str, str] | None = None, mode: str | None = None,
                    reconcile_interval: int | None = None, sync_dtype=None, groups=None) -> None:
        """Change the policy at a step boundary (nothing in flight); adapters are told by their listener.

        Classes may change only when every replica is identical (after a blocking reconciliation),
        else a tensor would carry a group-specific value into SYNC (invariant 1). Residuals of the
        old layout are dropped (at most one rounding step each).
        """
        changed = False
        if groups is not None and groups is not self.groups:
            wire = Wire(groups, device=self.device, error_feedback=self.cfg.communication.error_feedback,
                        stats=self.stats_, chunk_numel=self.wire.chunk_numel)
            wire.dispatch = self.dispatcher
            self.dispatcher.set_wire(wire)
            changed = True
        new_mode, new_sync = self.mode, self.sync_dtype
        if mode is not None and mode != self.mode:
            new_mode = Mode(mode)
            changed = True
        if classes is not None and self.policy.set_classes(classes):
            self.reconciler.reset_anchors()
            changed = True
        if reconcile_interval is not None:
            self.reconciler.interval = int(reconcile_interval)
        if sync_dtype is not None and wire_dtype(sync_dtype) != self.sync_dtype:
            new_sync = wire_dtype(sync_dtype)
            changed = True
        self.dispatcher.configure(mode=new_mode, sync_dtype=new_sync, local_dtype=self.local_dtype)
        if changed:
            self.wire.reset_residuals()
            for fn in self._listeners:
                fn(self)

    # ------------------------------------------------------------------ importance

    def observe(self, names: list[str], sq_sums: torch.Tensor) -> None:
        """Fisher: fold this step's squared gradient sums of ``names`` (one value per name, of the
        part of the tensor this rank holds) into the per-element EMA."""
        if self.tracks_fisher and names:
            self.policy.observe(names, sq_sums)

    def set_loss_closure(self, fn: Callable[[], torch.Tensor] | None) -> None:
        """The loss closure `hutchinson` differentiates twice (the adapter may capture one itself)."""
        self.policy.loss_closure = fn

    def refresh_classes(self) -> bool:
        """Re-rank on agreed scores; True when the classes changed. Only right after a blocking
        reconciliation. Phases: 1. this rank's scores (policy.py); 2. one fp64 SUM all-reduce over
        the DP group, / DP size; 3. classify on the agreed scores."""
        self.policy.last_refresh = self.step
        if not self.selective:
            return False
        # The classes are decided on the host: the agreed scores come as a host copy (Wire.agree_later).
        s = self.wire.agree(self.policy.local_scores(self.step).reshape(-1), "sum", cls="control", host=True)
        new = self.policy.classify((s / self.groups.dp_size).tolist())
        if new == self.classes:
            return False
        self.reconfigure(classes=new)
        n_sync, n_local = self.policy.counts()
        log.info("topo_align: step %d: classes refreshed (%d SYNC / %d LOCAL tensors, SYNC %.1f%% of elements)",
                 self.step, n_sync, n_local, 100 * self.sync_fraction())
        return True

    # ------------------------------------------------------------------ the dispatcher's facade

    def reduce(self, bucket: CommBucket, cls: Cls):
        """Reduce one bucket of one class (:meth:`Dispatcher.reduce`): a ``torch.futures.Future``."""
        return self.dispatcher.reduce(bucket, cls)

    def wait(self, fut):
        """The value of a future of :meth:`reduce` (bounded by ``fallback.timeout_s``)."""
        return self.dispatcher.wait(fut)

    def sync_done(self) -> None:
        """The adapter submitted every SYNC bucket of this step (LOCAL buckets may go)."""
        self.dispatcher.sync_done()

    def all_submitted(self) -> None:
        """The adapter submitted every bucket of this step (held reconciliation may go)."""
        self.dispatcher.all_submitted()

    def call(self, fn: Callable, what: str, traffic: Traffic = Traffic.CONTROL):
        """Run ``fn`` (collectives on this engine's groups) in the schedule and return its value."""
        return self.dispatcher.call(fn, what, traffic)

    # ------------------------------------------------------------------ agreement

    def global_grad_norm_sq(self, local_sq: torch.Tensor, *, over: str = "dp") -> torch.Tensor:
        """Squared gradient norm equal on every rank: the mean over ranks of ``local_sq``
        (``|g_SYNC|^2 + mean_k |g_LOCAL,k|^2``; one fp64 all-reduce). ``over="inter"`` when the
        groups already agree inside (a framework reduced the norm over the island). A non-finite
        value stays non-finite (the frameworks' overflow sentinel). ``local_sq`` may live anywhere
        (Megatron's norm is a host float): the sum travels as fp64 on the communication device,
        where the agreed value stays."""
        if not self.selective or not self.has_local():
            return local_sq
        n = self.groups.dp_size if over == "dp" else self.groups.inter_size
        x = local_sq.detach().to(device=self.wire.device, dtype=torch.float64).reshape(-1)
        s = self.wire.agree(x, "sum", over=over, cls="control")
        return (s / n).reshape(local_sq.shape).to(local_sq.dtype)

    def agree_overflow(self, flag: bool, *, over: str = "dp") -> bool:
        """True on every rank when any rank saw an overflow (one MAX all-reduce on the comm device;
        the verdict is a host bool, read from a host copy made inside the agreement)."""
        t = self.wire.tensor([1.0 if flag else 0.0])
        return bool(self.wire.agree(t, "max", over=over, cls="control", host=True).item() > 0)

    # ------------------------------------------------------------------ the step and reconciliation

    def after_step(self, source: ReconcileSource | None, optimizer=None) -> bool:
        """Count an optimizer step; apply a pending asynchronous correction; reconcile when due
        (asynchronously unless a refresh or a promotion needs every replica identical now); refresh
        classes when due; run the adaptive controller. Returns True on a reconciliation step.
        Collective over the DP group on reconciliation steps (the same steps on every rank)."""
        self.step += 1
        rec = self.reconciler
        rec.source = source
        did = False
        if self.selective:
            rec.apply_pending(source, self.step)
            rec.all_synced = not self.has_local()
            frag = rec.due(self.step)
            if frag is not None:
                refresh = self.policy.refresh_due(self.step)
                promote = self.drift.wants_blocking(self.classes, self.numels)
                if refresh or promote or not self.cfg.local.async_reconcile:
                    # Classes may change after this one: moments too, so a tensor turning SYNC
                    # carries identical optimizer state. A refresh re-ranks every tensor: all
                    # fragments; a promotion only among the fragment just averaged.
                    self._reconcile_blocking(source, moments=refresh or promote,
                                             frag=None if refresh or rec.stream_k() == 1 else frag)
                else:
                    self.dispatcher.plan_window()  # every rank, whatever it has to send
                    rec.launch(source, self.step, frag)
                did = True
                if refresh:
                    self.refresh_classes()
        self.stats_.end_step()
        self.drift.poll()  # a drift measurement whose agreed sums have landed (never waits)
        if self.method is not None:
            self.method.after_step()
        if self.adaptive is not None:
            self.adaptive.after_step(optimizer)
        self.dispatcher.end_step(self.step)
        return did

    def reconcile(self, source: ReconcileSource | None, blocking: bool = True) -> None:
        """Force a reconciliation now (before evaluation or saving): applies a pending correction,
        then averages parameters and optimizer moments. Afterwards (blocking) every parameter and its
        optimizer state is identical on all ranks."""
        if not self.selective:
            return
        rec = self.reconciler
        rec.source = source
        rec.apply_pending(source, self.step)
        if not blocking and rec.stream_k() > 1:
            # one asynchronous average is in flight at a time, and one covers a fragment
            log.info("topo_align: step %d: reconcile(blocking=False) with local.stream_fragments = %d "
                     "reconciles every fragment now, blocking", self.step, rec.stream_k())
            blocking = True
        if blocking:
            self._reconcile_blocking(source, moments=True)
        else:
            rec.launch(source, self.step)

    def _reconcile_blocking(self, source, *, moments: bool = False, frag: int | None = None) -> None:
        """The reconciler averages now (fragment ``frag``, or every one); then the drift monitor may
        promote or demote among what was averaged."""
        done = self.reconciler.blocking(source, self.step, moments=moments, frag=frag)
        # The replicas of what was just averaged are identical: the only moment a LOCAL tensor may
        # become SYNC. A promoted (SYNC) tensor is identical everywhere, so it may turn LOCAL anytime.
        promoted, demoted = self.drift.promotions(self.classes, self.numels, eligible=done)
        if promoted or demoted:
            self._log_promotion_bytes(promoted, demoted)
            self.reconfigure(classes={n: (SYNC if n in promoted else LOCAL if n in demoted else c)
                                      for n, c in self.classes.items()})

    def _log_promotion_bytes(self, promoted: list[str], demoted: list[str]) -> None:
        """What the change costs on the slow tier per step (SYNC every step on its wire instead of a
        reconciliation every interval on the reconciliation wire; byte estimates, scales left out)."""
        net = sum(self.numels[n] for n in promoted) - sum(self.numels[n] for n in demoted)
        rec = self.reconciler
        per = self.sync_dtype.itemsize - rec.dtype.itemsize / rec.interval
        used = sum(self.numels[n] for n in self.drift.promoted)
        log.info("topo_align: step %d: promoted tensors now %d elements (%.1f%% of the %.1f%% budget); this "
                 "change adds about %.0f slow-tier bytes per step and rank", self.step, used,
                 100 * used / max(1, self.drift.total_numel), 100 * self.drift.promote_fraction, net * per)

    def drain(self) -> None:
        """Wait for an in-flight asynchronous average (no new collective); keeps the correction."""
        self.reconciler.drain()

    # ------------------------------------------------------------------ state and stats

    def state_dict(self) -> dict:
        """The engine's state on THIS rank (residuals differ per rank: save it per rank).

        Issues no collective, so any subset of ranks may call it (docs/design.md, invariant 7): an in-flight
        asynchronous reconciliation is kept as far as it got (chunks every rank released are waited
        for, held chunks are recorded as not run), so a resumed run finishes the same average and
        applies the same correction at the same step as an uninterrupted one. Reconciling first
        (``reconcile()``, the frameworks' save) is what makes the replicas identical; without it
        this state is this rank's group's."""
        rec = self.reconciler.state_dict()  # first: it waits for the released chunks
        ctrl = self.adaptive
        mode, classes = self.mode, dict(self.classes)
        if ctrl is not None:
            mode = ctrl.base_mode
            if ctrl.saved_classes:
                classes = dict(ctrl.saved_classes)
        # The keys and their order of ENGINE_STATE_FORMAT (a checkpoint of the previous release loads).
        return {"format": ENGINE_STATE_FORMAT, "mode": str(mode), "step": self.step,
                "last_refresh": self.policy.last_refresh, "reconciles": rec["reconciles"],
                "all_synced": rec["all_synced"], "classes": classes,
                "residuals": self.wire.residual_state(), "importance": self.importance.state_dict(),
                "pending": rec["pending"], "anchors": rec["anchors"], "moments_anchors": rec["moments_anchors"],
                "fragment_reconciles": rec["fragment_reconciles"], "max_staleness": rec["max_staleness"],
                "stats": self.stats_.state_dict(),
                "drift": self.drift.state_dict(), "adaptive": None if ctrl is None else ctrl.state_dict(),
                "method": None if self.method is None else self.method.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (same mode and parameters; else a clear error). Listeners run
        when the classes differ from the current ones, before the residuals are restored."""
        if not isinstance(sd, dict) or sd.get("format") != ENGINE_STATE_FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else None
            raise ValueError(f"not a topo_align engine state (format {got!r}; expected {ENGINE_STATE_FORMAT!r})")
        if self.method is not None:  # the saved method first: the classes below belong to it
            self.method.load_state_dict(sd.get("method"))
        ctrl = self.adaptive
        mine = ctrl.base_mode if ctrl is not None else self.mode
        if sd["mode"] != mine:
            raise ValueError(f"topo_align state was saved in mode {sd['mode']!r}; this run uses {mine!r}")
        if set(sd["classes"]) != set(self.names):
            diff = sorted(set(self.names) ^ set(sd["classes"]))[:3]
            raise ValueError(f"topo_align state names other parameters than this model (e.g. {diff})")
        ad = sd.get("adaptive")
        if ad and ad.get("level", 0) and ctrl is None:
            raise ValueError("topo_align state was saved at an adaptive level; this run has adaptive.enabled = "
                             "false (enable it to resume)")
        if ctrl is not None:
            ctrl.restore_base()
        self.reconfigure(classes=dict(sd["classes"]))
        if ctrl is not None and ad:
            ctrl.load_state_dict(ad)
        self.wire.load_residual_state(sd["residuals"])
        self.importance.load_state_dict(sd["importance"])
        self.step = int(sd["step"])
        self.policy.last_refresh = int(sd["last_refresh"])
        self.reconciler.load_state_dict(sd)
        self.stats_.load_state_dict(sd["stats"])
        self.drift.load_state_dict(sd.get("drift"))
        if ctrl is not None:
            ctrl.reset_window()

    def stats(self) -> dict:
        """Bytes, calls and seconds per tier and class (last step and total), classes and counters."""
        out = self.stats_.as_dict()
        sync_el = sum(self.numels[n] for n in self.names if self.classes[n] == SYNC)
        out.update({
            "mode": str(self.mode), "configured_mode": self.cfg.mode, "optimizer_steps": self.step,
            "sync_dtype": str(self.sync_dtype).removeprefix("torch."),
            "reconciles": self.reconciler.reconciles,
            "sync_tensors": sum(c == SYNC for c in self.classes.values()),
            "local_tensors": sum(c == LOCAL for c in self.classes.values()),
            "sync_elements": sync_el, "local_elements": sum(self.numels.values()) - sync_el,
            "sync_fraction": self.sync_fraction(), "intra_size": self.groups.intra_size,
            "inter_size": self.groups.inter_size, "max_staleness": self.reconciler.max_staleness,
            "drift": self.drift.as_dict(),
            "schedule": self.schedule_summary(),
            "adaptive_level": None if self.adaptive is None else self.adaptive.level,
            "method": None if self.method is None else self.method.method,
            # `method: auto`'s latest log line (DP position 0; None elsewhere and while timing)
            "method_line": next((ev["line"] for ev in reversed(self.method.events) if ev["line"]), None)
            if self.method is not None else None,
        })
        return out

    def schedule_summary(self) -> dict:
        """Mean time from the last SYNC submission to the last SYNC completion (the SYNC tail) over
        the steps with an asynchronous reconciliation outstanding and over those without (CPU)."""
        out = {}
        for key, flag in (("with_reconcile", True), ("without_reconcile", False)):
            xs = [r["sync_tail_s"] for r in self.dispatcher.schedule if r["reconcile_in_flight"] is flag]
            out[key] = {"steps": len(xs), "mean_sync_tail_s": sum(xs) / len(xs) if xs else None}
        return out

    def enable_adaptive(self) -> None:
        """Start the adaptive controller (``adaptive.enabled``) over the levels this adapter supports."""
        from ..adaptive.adaptive import AdaptiveController

        self.adaptive = AdaptiveController(self, levels=self.traits.levels)

    def close(self) -> None:
        """Stop the dispatcher's thread. Issues no collective (frameworks close from ``__del__``): a
        held asynchronous average is dropped, so call ``reconcile()`` first if the replicas must agree."""
        self.dispatcher.close()
