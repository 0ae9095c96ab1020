"""The selective engine: one policy and one wire behind GroupedReducer, DeepSpeed and Megatron.

An adapter owns the framework's buffers (GroupedReducer: its buckets; DeepSpeed: the engine's flat
buckets or the ZeRO partition; Megatron: the bucket groups and the optimizer's main shards) and
asks the engine everything else:

* **classes** -- which tensors are SYNC and which LOCAL (``engine.classes``), recomputed from agreed
  importance every ``importance.refresh_interval`` steps, right after a blocking reconciliation, plus
  drift promotions; adapters rebuild their layout in a listener (:meth:`Engine.on_reconfigure`);
* **dispatcher** -- every collective (``engine.reduce(bucket, cls)`` -> Future; dispatch.py), with
  the one error-feedback scheme (``engine.wire``, wire.py);
* **importance** -- per-tensor scores the adapter feeds with :meth:`Engine.observe` (fisher) or
  that are computed at refresh (magnitude; hutchinson from a loss closure);
* **reconciliation** -- every ``local.reconcile_interval`` optimizer steps the LOCAL tensors the
  adapter lists (:class:`ReconcileItem`) are averaged across groups, blocking or asynchronously
  (snapshot now, correction ``x += avg(snapshot) - snapshot`` one step later);
* **drift**, **adaptive** levels, **state** (``state_dict``) and **stats**.

Ordering rule (docs/reducer.md, "One schedule"): every collective of the engine goes through its
:class:`~topo_integrations.reducer.dispatch.Dispatcher`, released at positions fixed by the program
(SYNC buckets, then LOCAL ones, then reconciliation chunks; control at its place) and issued from one
thread, so every rank issues the same sequence on every communicator; ``monitor.check_collectives``
checks it at every step.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ...config import TopoAlignConfig
from ..classes.auto_sync import resolved_config
from ..classes.classes import LOCAL, SYNC
from ..classes.drift import DriftMonitor
from ..classes.importance import Importance
from ..classes.policy import ClassPolicy
from ..kinds import Cls, Mode, Traffic
from ..reconcile.reconcile import (
    ParamReconcileSource,
    PendingAverage,
    ReconcileItem,
    ReconcileMixin,
    ReconcileSource,
    due_fragment,
)
from ..schedule.dispatch import CommBucket, Dispatcher
from ..schedule.order import check_requested
from ..wire.compression import wire_dtype
from ..wire.wire import Wire
from .stats import Stats

__all__ = ["Engine", "ReconcileItem", "ReconcileSource", "ParamReconcileSource", "ENGINE_STATE_FORMAT"]

log = logging.getLogger("topo_align")

ENGINE_STATE_FORMAT = "topo-align/engine/v1"


class Engine(ReconcileMixin):
    """Policy, wire, reconciliation and state of one reducer (see the module docstring).

    ``names``/``numels``: the tensors the adapter reduces, in registration order. ``layers``: global
    layer index per name (None outside layers). ``params``: name -> parameter (for magnitude and
    hutchinson scores); ``forced_sync``: names that must stay SYNC (e.g. Megatron's shared embedding).
    ``levels``: the adaptive levels this adapter can apply (GroupedReducer: all four).
    """

    def __init__(self, cfg: TopoAlignConfig, groups, names: list[str], numels: list[int], *, device,
                 layers: dict[str, int | None], num_layers: int | None = None,
                 params: dict[str, torch.Tensor] | None = None, forced_sync: set[str] = frozenset(),
                 loss_closure: Callable[[], torch.Tensor] | None = None, workers: bool = False,
                 levels: tuple[str, ...] = ("normal", "reconcile", "fp16", "flat"), can_regroup: bool = False):
        # `auto` SYNC wire and share, from the planned group count (config.resolve_sync); regrouping
        # keeps what was resolved here.
        cfg, note = resolved_config(cfg, groups.inter_size if groups.hierarchical else 1)
        if note and groups.position == 0:
            log.info(note)
        self.cfg = cfg
        self.groups = groups
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # `enabled: false` keeps the framework's reduction: for the adapters that own the reduction
        # (GroupedReducer, the DDP hook) that is one flat all-reduce, as DDP does.
        self.mode = Mode(cfg.mode) if groups.hierarchical and cfg.enabled else Mode.FLAT
        if not cfg.enabled and groups.position == 0:
            log.info("topo_align: enabled = false: gradients go through one flat all-reduce over the "
                     "data-parallel group (the framework's own reduction)")
        self.policy = ClassPolicy(cfg, names, numels, device=self.device, layers=layers, num_layers=num_layers,
                                  params=params, forced_sync=forced_sync, loss_closure=loss_closure,
                                  selective=self.mode is Mode.SELECTIVE)
        """Which tensors are SYNC / LOCAL (policy.py): names, sizes, importance, drift, classes."""
        self.stats_ = Stats()
        self.wire = Wire(groups, device=self.device, error_feedback=cfg.communication.error_feedback,
                         stats=self.stats_)
        # Every collective of this engine goes through the dispatcher (dispatch.py: one ordered
        # schedule). A thread of its own (CPU) when work should overlap the caller's.
        self.dispatcher = Dispatcher(self.wire, threaded=workers or (self.mode is Mode.SELECTIVE and
                                                                     cfg.local.async_reconcile),
                                     timeout_s=cfg.fallback.timeout_s,
                                     check=check_requested(cfg.monitor.check_collectives))
        self.wire.dispatch = self.dispatcher
        self.sync_dtype = wire_dtype(cfg.sync.dtype if cfg.mode == Mode.SELECTIVE else cfg.communication.inter_dtype)
        self.local_dtype = wire_dtype(cfg.local.dtype)
        self.reconcile_interval = cfg.local.reconcile_interval
        self.reconcile_dtype = wire_dtype(cfg.local.reconcile_dtype)
        self.moments_dtype = wire_dtype(cfg.local.moments_dtype)
        self._anchors: dict[int, dict] = {}
        """Per fragment (0 without streaming): the last reconciled LOCAL values (keys, flat fp32,
        outer momentum), identical on every rank."""
        self._sanchors: dict[int, dict] = {}
        """Per fragment: the last averaged LOCAL optimizer moments (keys, flat fp32), kept with a
        lossy ``local.moments_dtype`` only: identical on every replica of each item."""
        self._frag_reconciles: dict[int, int] = {}
        """Reconciliations per fragment (the moment average is due at every ``moments_interval``-th)."""
        self.step = 0
        self.last_refresh = 0
        self.reconciles = 0
        self.all_synced = True
        self.max_staleness = 0
        self._pending: PendingAverage | None = None
        self._listeners: list[Callable[[Engine], None]] = []
        self.levels = levels
        self.can_regroup = can_regroup
        """Whether adaptive regrouping may rebuild the groups (GroupedReducer only: a framework's
        data-parallel layout is fixed at its start)."""
        self.source: ReconcileSource | None = None
        """The adapter's reconcile source of the latest step (used by adaptive level changes)."""
        self.adaptive = None
        self._configure_dispatch()
        from ..wire.health import start_check

        # Every adapter builds an engine: the start-of-run check runs once per engine, in the schedule.
        self.call(lambda: start_check(self.groups), "start-of-run check")()  # verified once landed

    def _configure_dispatch(self) -> None:
        self.dispatcher.configure(mode=self.mode, sync_dtype=self.sync_dtype, local_dtype=self.local_dtype)

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
            self.groups = groups
            self.wire = Wire(groups, device=self.device, error_feedback=self.cfg.communication.error_feedback,
                             stats=self.stats_, chunk_numel=self.wire.chunk_numel)
            self.wire.dispatch = self.dispatcher
            self.dispatcher.set_wire(self.wire)
            changed = True
        if mode is not None and mode != self.mode:
            self.mode = Mode(mode)
            changed = True
        if classes is not None and self.policy.set_classes(classes):
            # a new LOCAL set (new fragments): its first reconciliation averages values exactly
            self._anchors, self._sanchors = {}, {}
            changed = True
        if reconcile_interval is not None:
            self.reconcile_interval = int(reconcile_interval)
        if sync_dtype is not None and wire_dtype(sync_dtype) != self.sync_dtype:
            self.sync_dtype = wire_dtype(sync_dtype)
            changed = True
        self._configure_dispatch()
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
        self.last_refresh = self.step
        if not self.selective:
            return False
        s = self.wire.agree(self.policy.local_scores(self.step).reshape(-1), "sum", cls="control")
        new = self.policy.classify((s / self.groups.dp_size).cpu().tolist())
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
        value stays non-finite (the frameworks' overflow sentinel)."""
        if not self.selective or not self.has_local():
            return local_sq
        n = self.groups.dp_size if over == "dp" else self.groups.inter_size
        s = self.wire.agree(local_sq.detach().double().reshape(-1), "sum", over=over, cls="control")
        return (s / n).reshape(local_sq.shape).to(local_sq.dtype)

    def agree_overflow(self, flag: bool, *, over: str = "dp") -> bool:
        """True on every rank when any rank saw an overflow (one MAX all-reduce on the comm device)."""
        t = self.wire.tensor([1.0 if flag else 0.0])
        return bool(self.wire.agree(t, "max", over=over, cls="control").item() > 0)

    # ------------------------------------------------------------------ the step and reconciliation

    def after_step(self, source: ReconcileSource | None, optimizer=None) -> bool:
        """Count an optimizer step; apply a pending asynchronous correction; reconcile when due
        (asynchronously unless a refresh or a promotion needs every replica identical now); refresh
        classes when due; run the adaptive controller. Returns True on a reconciliation step.
        Collective over the DP group on reconciliation steps (the same steps on every rank)."""
        self.step += 1
        self.source = source
        did = False
        if self.selective:
            if self._pending is not None:
                self._apply_pending(source)
            self.all_synced = not self.has_local()
            frag = due_fragment(self.step, self.reconcile_interval, self._stream_k())
            if frag is not None:
                refresh = self.step - self.last_refresh >= self.cfg.importance.refresh_interval
                promote = self.drift.wants_blocking(self.classes, self.numels)
                if refresh or promote or not self.cfg.local.async_reconcile:
                    # Classes may change after this one: moments too, so a tensor turning SYNC
                    # carries identical optimizer state. A refresh re-ranks every tensor: all
                    # fragments; a promotion only among the fragment just averaged.
                    self._reconcile_blocking(source, moments=refresh or promote,
                                             frag=None if refresh or self._stream_k() == 1 else frag)
                else:
                    self.dispatcher.plan_window()  # every rank, whatever it has to send
                    self._reconcile_async(source, frag)
                did = True
                if refresh:
                    self.refresh_classes()
        self.stats_.end_step()
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
        self.source = source
        if self._pending is not None:
            self._apply_pending(source)
        if not blocking and self._stream_k() > 1:
            # one asynchronous average is in flight at a time, and one covers a fragment
            log.info("topo_align: step %d: reconcile(blocking=False) with local.stream_fragments = %d "
                     "reconciles every fragment now, blocking", self.step, self._stream_k())
            blocking = True
        if blocking:
            self._reconcile_blocking(source, moments=True)
        else:
            self._reconcile_async(source)

    # ------------------------------------------------------------------ state and stats

    def state_dict(self) -> dict:
        """The engine's state on THIS rank (residuals differ per rank: save it per rank).

        Issues no collective, so any subset of ranks may call it (docs/design.md, invariant 7): an in-flight
        asynchronous reconciliation is kept as far as it got (chunks every rank released are waited
        for, held chunks are recorded as not run), so a resumed run finishes the same average and
        applies the same correction at the same step as an uninterrupted one. Reconciling first
        (``reconcile()``, the frameworks' save) is what makes the replicas identical; without it
        this state is this rank's group's."""
        pend = self._pending_state()
        def to_cpu(d):
            return None if d is None else {k: (v.cpu().clone() if torch.is_tensor(v) else v) for k, v in d.items()}

        anchors = {f: to_cpu(a) for f, a in self._anchors.items()}
        sanchors = {f: to_cpu(a) for f, a in self._sanchors.items()}
        ctrl = self.adaptive
        mode, classes = self.mode, dict(self.classes)
        if ctrl is not None:
            mode = ctrl.base_mode
            if ctrl.saved_classes:
                classes = dict(ctrl.saved_classes)
        return {"format": ENGINE_STATE_FORMAT, "mode": str(mode), "step": self.step, "last_refresh": self.last_refresh,
                "reconciles": self.reconciles, "all_synced": self.all_synced, "classes": classes,
                "residuals": self.wire.residual_state(), "importance": self.importance.state_dict(),
                "pending": pend, "anchors": anchors, "moments_anchors": sanchors,
                "fragment_reconciles": dict(self._frag_reconciles), "max_staleness": self.max_staleness,
                "stats": self.stats_.state_dict(),
                "drift": self.drift.state_dict(), "adaptive": None if ctrl is None else ctrl.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (same mode and parameters; else a clear error). Listeners run
        when the classes differ from the current ones, before the residuals are restored."""
        if not isinstance(sd, dict) or sd.get("format") != ENGINE_STATE_FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else None
            raise ValueError(f"not a topo_align engine state (format {got!r}; expected {ENGINE_STATE_FORMAT!r})")
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
        self.last_refresh = int(sd["last_refresh"])
        self.reconciles = int(sd.get("reconciles", 0))
        self.all_synced = bool(sd["all_synced"])
        self.max_staleness = int(sd["max_staleness"])
        def to_dev(d):
            return None if d is None else {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in d.items()}

        self._pending = PendingAverage.from_state(sd.get("pending"), self.device)
        # states of 0.2 and older: one anchor (fragment 0) and one reconciliation counter
        anchors = sd.get("anchors", {0: sd.get("anchor")})
        sanchors = sd.get("moments_anchors", {0: sd.get("moments_anchor")})
        self._anchors = {int(f): to_dev(a) for f, a in anchors.items() if a is not None}
        self._sanchors = {int(f): to_dev(a) for f, a in sanchors.items() if a is not None}
        self._frag_reconciles = {int(f): int(n) for f, n in
                                 sd.get("fragment_reconciles", {0: self.reconciles}).items()}
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
            "reconciles": self.reconciles,
            "sync_tensors": sum(c == SYNC for c in self.classes.values()),
            "local_tensors": sum(c == LOCAL for c in self.classes.values()),
            "sync_elements": sync_el, "local_elements": sum(self.numels.values()) - sync_el,
            "sync_fraction": self.sync_fraction(), "intra_size": self.groups.intra_size,
            "inter_size": self.groups.inter_size, "max_staleness": self.max_staleness,
            "drift": self.drift.as_dict(),
            "schedule": self.schedule_summary(),
            "adaptive_level": None if self.adaptive is None else self.adaptive.level,
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

        self.adaptive = AdaptiveController(self, levels=self.levels)

    def close(self) -> None:
        """Stop the dispatcher's thread. Issues no collective (frameworks close from ``__del__``): a
        held asynchronous average is dropped, so call ``reconcile()`` first if the replicas must agree."""
        self.dispatcher.close()
