"""GroupedReducer: topology-aware gradient reduction for any ``nn.Module`` (DESIGN.md 4 and 5.4).

One training step, seen from the reducer:

  backward     post-accumulate-grad hooks copy each gradient into its bucket (fp32, reverse
               registration order); a bucket is launched when it is full and every earlier bucket
               of its class has been launched (so all ranks issue collectives in the same order even
               when some parameters get no gradient). With ``communication.overlap`` the bucket is
               reduced by a worker thread per class (SYNC and LOCAL have their own thread, process
               groups and, on CUDA, streams: SYNC on a high-priority stream), overlapping backward.
  finish_grad_sync()
               launches what is left (a parameter without gradient contributes zeros), waits, and
               writes the reduced gradient into ``p.grad`` of every parameter (also of those that
               got none, so every rank's optimizer sees the same set of gradients).
  optimizer.step()
  after_optimizer_step(optimizer)
               counts the step; in `selective`, every ``local.reconcile_interval`` steps averages
               the LOCAL parameters (and the optimizer state of LOCAL parameters) across groups,
               blocking or asynchronously; re-ranks the classes right after a reconciliation every
               ``importance.refresh_interval`` steps.

Modes: `flat` (one all-reduce over the DP group), `hierarchical` (intra reduce-scatter, inter
all-reduce of the shard, intra all-gather), `selective` (SYNC hierarchical every step, LOCAL inside
the group, reconciliation). A plan with one tier falls back to `flat` (logged once).
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import TopoAlignConfig
from ..topology import Plan
from . import reconcile as rec
from .buckets import Bucket, build_buckets
from .classes import LOCAL, SYNC, classify, layer_indices
from .collectives import agree_scalar, flat_all_reduce, hierarchical_all_reduce, intra_all_reduce
from .compression import is_lossy, wire_dtype
from .groups import ReducerGroups, build_groups, discover_plan
from .drift import DriftMonitor
from .importance import Importance
from .stats import Stats

__all__ = ["GroupedReducer", "ConsistencyError"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/reducer/v1"


class ConsistencyError(RuntimeError):
    """Replicas that must be identical are not (DESIGN invariant 1/2); the message names the first."""


def _hash_tensor(t: torch.Tensor) -> torch.Tensor:
    """A bitwise fingerprint (two int64 sums over the raw bits) of ``t``; equal bits -> equal hash."""
    flat = t.detach().reshape(-1)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
    bits = flat.contiguous().view(ints).to(torch.int64)
    w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1_000_003 + 1
    return torch.stack([(bits * w).sum(), (bits * bits).sum() + bits.numel()])


def _dense(name: str, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        raise ValueError(f"topo_align: parameter {name!r} has a sparse gradient; the reducer supports dense "
                         "gradients only (use nn.Embedding(sparse=False))")
    return grad.detach()


class GroupedReducer:
    """See the module docstring. Public methods follow notes/REDUCER_API.md."""

    def __init__(self, model: nn.Module, cfg: TopoAlignConfig, *, groups: ReducerGroups | None = None,
                 plan: Plan | None = None, param_names: dict | None = None, register_hooks: bool = True,
                 loss_closure: Callable[[], torch.Tensor] | None = None,
                 dp_ranks_all: list[list[int]] | None = None, broadcast_parameters: bool = True):
        """Discover the topology (unless ``groups`` or ``plan`` is given), create the groups, broadcast
        the parameters from DP position 0 (``broadcast_parameters``), classify, bucket, hook.

        ``param_names`` maps parameter -> name (or name -> parameter) when the module's own names are
        not the ones to classify by (e.g. global layer numbers under pipeline parallelism).
        Collective over the data-parallel group (and, to create groups, over the default group).
        """
        if not isinstance(cfg, TopoAlignConfig):
            raise TypeError(f"cfg must be a TopoAlignConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.model = model
        if groups is None:
            if plan is None:
                plan = discover_plan(cfg)
            groups = build_groups(plan, dp_ranks_all=dp_ranks_all, timeout_s=cfg.fallback.timeout_s)
        self.groups = groups
        self.plan = groups.plan
        self.mode = cfg.mode
        self.fallback_reason: str | None = None
        if self.mode != "flat" and not groups.hierarchical:
            if cfg.fallback.on_flat_topology == "error":
                raise ValueError(f"topo_align: mode {cfg.mode!r} needs a hierarchical plan, but {self.plan.reason} "
                                 "(fallback.on_flat_topology = 'error')")
            self.fallback_reason = self.plan.reason
            log.warning("topo_align: mode %r falls back to 'flat': %s", cfg.mode, self.plan.reason)
            self.mode = "flat"
        if self.mode != "flat" and self.plan.middle_level:
            log.info("topo_align: middle_level planned; the reducer reduces over 2 levels (island, rail); "
                     "the leaf and spine rail groups are available to adapters")

        # Parameters: registration order, shared parameters once.
        self._named = self._named_params(model, param_names)
        if not self._named:
            raise ValueError("topo_align: the model has no parameter that requires a gradient")
        self._params = {n: p for n, p in self._named}
        self._names = [n for n, _ in self._named]
        self.device = self._named[0][1].device
        self._cuda = self.device.type == "cuda"
        if broadcast_parameters:
            self._broadcast_parameters()

        self.stats_ = Stats()
        self._rec = {c: self.stats_.recorder(c) for c in ("sync", "local", "reconcile", "control")}
        comm = cfg.communication
        self._ef = comm.error_feedback
        self._inter_dtype = wire_dtype(cfg.sync.dtype if self.mode == "selective" else comm.inter_dtype)
        self._local_dtype = wire_dtype(cfg.local.dtype)
        self._bucket_numel = max(1, int(comm.bucket_size_mb * 1024 * 1024) // 4)
        self._H = cfg.local.reconcile_interval
        self._numels = {n: p.numel() for n, p in self._named}
        # Drift of LOCAL replicas at each reconciliation (reducer/drift.py); promotions are applied by
        # _classify, so they survive class refreshes.
        self._drift = DriftMonitor(cfg.local.promote_drift_fraction, sum(self._numels.values()))

        # Classes (agreed scores), buckets, hooks.
        self._layers = layer_indices(self._names, model=model, layer_pattern=cfg.sync.layer_pattern)
        self.importance = Importance(cfg.importance.method, cfg.importance.ema_decay,
                                     [p for _, p in self._named], loss_closure)
        if self.mode == "selective":
            scores = self._agreed(Importance.magnitude([p for _, p in self._named]))
            self._classes = self._classify(scores)
        else:
            self._classes = {n: SYNC for n in self._names}
        self._build_buckets()

        self.step = 0
        self._last_refresh = 0
        self._sync_enabled = True
        self._all_synced = True
        self._pending: dict | None = None
        self.max_staleness = 0
        self.launched_from_hooks = 0
        """Buckets launched during backward (overlap), cumulative; the rest launch in finish_grad_sync."""
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._streams: dict[str, Any] = {}
        if comm.overlap:
            self._executors = {c: ThreadPoolExecutor(1, thread_name_prefix=f"topo_align_{c.lower()}")
                               for c in (SYNC, LOCAL)}
        if self._cuda:
            self._streams = {SYNC: torch.cuda.Stream(device=self.device, priority=-1),
                             LOCAL: torch.cuda.Stream(device=self.device, priority=0)}
        self._hooks = []
        if register_hooks:
            for n, p in self._named:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(n)))
        # Degradation handling (reducer/adaptive.py): checks every adaptive.check_interval steps.
        self.adaptive = None
        if cfg.adaptive.enabled:
            from .adaptive import AdaptiveController

            self.adaptive = AdaptiveController(self)

    # ------------------------------------------------------------------ set-up helpers

    @staticmethod
    def _named_params(model: nn.Module, param_names: dict | None) -> list[tuple[str, nn.Parameter]]:
        if param_names:
            k = next(iter(param_names))
            by_param = param_names if isinstance(k, torch.Tensor) else {p: n for n, p in param_names.items()}
            by_id = {id(p): n for p, n in by_param.items()}
        else:
            by_id = None
        out, seen = [], set()
        for n, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((by_id.get(id(p), n) if by_id is not None else n, p))
        names = [n for n, _ in out]
        if len(set(names)) != len(names):
            raise ValueError("topo_align: param_names gives two parameters the same name")
        return out

    def _broadcast_parameters(self) -> None:
        """Every replica starts from DP position 0's parameters and buffers (as DDP does).

        Phases: tensors grouped by (device, dtype) are concatenated into chunks of about 64 MiB,
        each chunk is one broadcast from DP position 0 over the DP group, then copied back.
        """
        src = self.groups.dp_ranks[0]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.numel():
                by_kind.setdefault((t.device, t.dtype), []).append(t)
        limit = 64 * 1024 * 1024
        with torch.no_grad():
            for ts in by_kind.values():
                chunk: list[torch.Tensor] = []
                size = 0
                for t in ts + [None]:
                    if t is not None and (not chunk or size + t.numel() * t.element_size() <= limit):
                        chunk.append(t)
                        size += t.numel() * t.element_size()
                        continue
                    flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                    dist.broadcast(flat, src=src, group=self.groups.dp_group)
                    off = 0
                    for c in chunk:
                        c.data.copy_(flat[off:off + c.numel()].view(c.shape))
                        off += c.numel()
                    chunk, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)

    def _agreed(self, scores: torch.Tensor) -> list[float]:
        """Scores averaged over the data-parallel group (every rank ranks identically)."""
        s = agree_scalar(scores.detach().double().reshape(-1), self.groups, "sum", record=self._rec["control"])
        return (s / self.groups.dp_size).cpu().tolist()

    def _classify(self, scores: list[float]) -> dict[str, str]:
        c = self.cfg.sync
        return self._drift.apply(classify(
                        self._names, [p.numel() for _, p in self._named], last_n_layers=c.last_n_layers,
                        always_sync=list(c.always_sync), top_fraction=c.top_fraction, scores=scores,
                        layers=self._layers))

    def _build_buckets(self) -> None:
        self._buckets = build_buckets(self._named, self._classes, bucket_numel=self._bucket_numel,
                                      pad_to=self.groups.intra_size, class_order=(SYNC, LOCAL))
        self._where: dict[str, tuple[Bucket, int, int]] = {}
        for bl in self._buckets.values():
            for b in bl:
                for n, off, p in zip(b.names, b.offsets, b.params):
                    self._where[n] = (b, off, p.numel())
                b.residual = self._new_residual(b)
        self._next = {SYNC: 0, LOCAL: 0}

    def _new_residual(self, b: Bucket) -> torch.Tensor | None:
        if not self._ef:
            return None
        if b.cls == SYNC and self.mode == "hierarchical" or (self.mode == "selective" and b.cls == SYNC):
            if is_lossy(b.buffer.dtype, self._inter_dtype):
                return torch.zeros(b.buffer.numel() // self.groups.intra_size, device=b.buffer.device)
        if b.cls == LOCAL and is_lossy(b.buffer.dtype, self._local_dtype):
            return torch.zeros(b.buffer.numel(), device=b.buffer.device)
        return None

    # ------------------------------------------------------------------ backward side

    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if not self._sync_enabled:
                return
            b, off, n = self._where[name]
            if name in b.ready and b.launched:
                raise RuntimeError(
                    f"topo_align: parameter {name!r} received a gradient after its bucket was reduced "
                    "(two backward passes before finish_grad_sync?); use no_sync() for accumulation")
            b.buffer[off:off + n].copy_(_dense(name, p.grad).reshape(-1))
            b.ready.add(name)
            if b.full and self._executors:  # without overlap everything launches in finish_grad_sync
                self.launched_from_hooks += self._launch_ready(b.cls)
        return hook

    def _launch_ready(self, cls: str) -> int:
        """Launch, in order, the buckets of ``cls`` that are full; returns how many were launched."""
        bl = self._buckets[cls]
        n = 0
        while self._next[cls] < len(bl) and bl[self._next[cls]].full:
            self._launch(bl[self._next[cls]])
            self._next[cls] += 1
            n += 1
        return n

    def _reduce_bucket(self, b: Bucket) -> None:
        """The collective of one bucket (runs in the class's worker thread or inline)."""
        g = self.groups
        if self.mode == "flat":
            flat_all_reduce(b.buffer, g, record=self._rec["sync"])
        elif b.cls == SYNC:
            hierarchical_all_reduce(b.buffer, g, inter_dtype=self._inter_dtype, residual=b.residual,
                                    record=self._rec["sync"])
        else:
            intra_all_reduce(b.buffer, g, wire_dtype=self._local_dtype, residual=b.residual, low_priority=True,
                             record=self._rec["local"])

    def _submit(self, cls: str, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the class's worker (FIFO) or inline; on CUDA on the class's side stream,
        ordered after the work already queued on the caller's stream."""
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        stream = self._streams.get(cls)

        def job():
            if stream is None:
                return fn()
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = fn()
                done = torch.cuda.Event()
                done.record(stream)
            return done

        ex = self._executors.get(cls)
        if ex is not None:
            return ex.submit(job)
        fut: Future = Future()
        try:
            fut.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            fut.set_exception(exc)
        return fut

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        b.future = self._submit(b.cls, lambda: self._reduce_bucket(b))

    def _wait(self, fut: Future):
        """Result of a worker job; on CUDA the caller's stream waits for the job's stream."""
        out = fut.result()
        if self._cuda and out is not None and isinstance(out, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(out)
        return out

    def finish_grad_sync(self) -> None:
        """Launch the remaining buckets, wait for all, write the reduced gradients into ``p.grad``.

        Inside ``no_sync()`` it does nothing (gradients keep accumulating locally).
        """
        if not self._sync_enabled:
            return
        for cls in (SYNC, LOCAL):
            for b in self._buckets[cls]:
                if b.full:
                    continue
                for n, off, p in zip(b.names, b.offsets, b.params):
                    if n in b.ready:
                        continue
                    seg = b.buffer[off:off + p.numel()]
                    if p.grad is not None:  # hooks off (adapter-driven), or no hook fired this step
                        seg.copy_(_dense(n, p.grad).reshape(-1))
                    else:
                        seg.zero_()
                    b.ready.add(n)
            self._launch_ready(cls)
        errors = []
        for cls in (SYNC, LOCAL):
            for b in self._buckets[cls]:
                try:
                    self._wait(b.future)
                except Exception as exc:  # noqa: BLE001 - first error re-raised below
                    errors.append(exc)
        if errors:
            self._reset_buckets()
            raise errors[0]
        with torch.no_grad():
            for cls in (SYNC, LOCAL):
                for b in self._buckets[cls]:
                    for off, p in zip(b.offsets, b.params):
                        seg = b.buffer[off:off + p.numel()].view(p.shape)
                        if p.grad is None:
                            p.grad = seg.to(p.dtype).clone()
                        else:
                            p.grad.copy_(seg)
        self._reset_buckets()
        self.importance.update_from_grads()

    def _reset_buckets(self) -> None:
        for bl in self._buckets.values():
            for b in bl:
                b.reset()
        self._next = {SYNC: 0, LOCAL: 0}

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: inside, backward only accumulates into ``p.grad`` (no communication);
        the backward after the block (the boundary) reduces the accumulated gradients."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    # ------------------------------------------------------------------ after the optimizer step

    def after_optimizer_step(self, optimizer=None) -> None:
        """Count the step; in `selective` apply a pending asynchronous correction, reconcile when due,
        and re-rank the classes when a refresh is due (right after a blocking reconciliation).
        Collective over the DP group on reconciliation steps (same steps on every rank)."""
        self.step += 1
        if self.mode == "selective":
            if self._pending is not None:
                self._apply_pending(optimizer)
            self._all_synced = not self._has_local()
            if self.step % self._H == 0:
                refresh = self.step - self._last_refresh >= self.cfg.importance.refresh_interval
                if (refresh or not self.cfg.local.async_reconcile
                        or self._drift.wants_blocking(self._classes, self._numels)):
                    self._reconcile_blocking(optimizer)
                else:
                    self._reconcile_async(optimizer)
                if refresh:
                    self._refresh_classes()
        self.stats_.end_step()
        if self.adaptive is not None:
            self.adaptive.after_step(optimizer)

    def _has_local(self) -> bool:
        return any(c == LOCAL for c in self._classes.values())

    def _local_names(self) -> list[str]:
        return [n for n in self._names if self._classes[n] == LOCAL]

    def _reconcile_blocking(self, optimizer) -> None:
        keys = rec.keys_for(self._local_names(), self._params, optimizer)
        tensors = rec.resolve(keys, self._params, optimizer)
        if tensors:
            flat = rec.gather_flat(tensors).to(self.device)
            before = flat.clone()
            self._wait(self._submit(LOCAL, lambda: rec.average_flat(flat, self.groups, chunk_numel=self._bucket_numel,
                                                                    record=self._rec["reconcile"])))
            rec.scatter_flat(flat, tensors)
            self._drift.measure(keys, before, flat, self._numels, self.groups, self.step, record=self._rec["control"])
        self._all_synced = True
        # Every replica is identical now: the only moment a LOCAL tensor may become SYNC.
        promoted = self._drift.promotions(self._classes, self._numels)
        if promoted:
            self._classes = {n: (SYNC if n in promoted else c) for n, c in self._classes.items()}
            self._build_buckets()

    def _reconcile_async(self, optimizer) -> None:
        keys = rec.keys_for(self._local_names(), self._params, optimizer)
        tensors = rec.resolve(keys, self._params, optimizer)
        if not tensors:
            self._all_synced = True
            return
        snap = rec.gather_flat(tensors).to(self.device)
        avg = snap.clone()
        fut = self._submit(LOCAL, lambda: rec.average_flat(avg, self.groups, chunk_numel=self._bucket_numel,
                                                           record=self._rec["reconcile"]))
        self._pending = {"keys": keys, "snap": snap, "avg": avg, "future": fut, "step": self.step}

    def _apply_pending(self, optimizer) -> None:
        p = self._pending
        self._pending = None
        if p.get("future") is not None:
            self._wait(p["future"])
        tensors = rec.resolve(p["keys"], self._params, optimizer)
        rec.scatter_flat(p["avg"], tensors, delta_from=p["snap"], nonneg=rec.nonnegative(p["keys"]))
        self._drift.measure(p["keys"], p["snap"], p["avg"], self._numels, self.groups, p["step"],
                            record=self._rec["control"])
        self.max_staleness = max(self.max_staleness, self.step - p["step"])

    def reconcile(self, optimizer=None, blocking: bool = True) -> None:
        """Force a full reconciliation now (before evaluation or saving): applies a pending
        asynchronous correction, then averages LOCAL parameters (+ optimizer state) across groups.
        Afterwards every parameter is identical on all ranks. ``blocking=False`` starts an
        asynchronous one instead. No-op outside `selective`. Collective over the DP group."""
        if self.mode != "selective":
            return
        if self._pending is not None:
            self._apply_pending(optimizer)
        if blocking:
            self._reconcile_blocking(optimizer)
        else:
            self._reconcile_async(optimizer)

    def _refresh_classes(self) -> None:
        self._last_refresh = self.step
        scores = self._agreed(self.importance.local_scores())
        new = self._classify(scores)
        if new != self._classes:
            # Error-feedback residuals of the old layout are dropped (at most one rounding step each).
            self._classes = new
            self._build_buckets()
            log.info("topo_align: step %d: classes refreshed (%d SYNC / %d LOCAL tensors)", self.step,
                     sum(c == SYNC for c in new.values()), sum(c == LOCAL for c in new.values()))

    # ------------------------------------------------------------------ classes and agreement

    def classify(self) -> dict[str, str]:
        """Parameter name -> "SYNC" | "LOCAL" (all SYNC outside `selective`)."""
        return dict(self._classes)

    def sync_mask(self) -> dict[str, bool]:
        return {n: c == SYNC for n, c in self._classes.items()}

    def is_sync(self, name: str) -> bool:
        return self._classes[name] == SYNC

    def global_grad_norm_sq(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Squared gradient norm for clipping, equal on every rank.

        ``local_sq`` is the squared norm of the whole gradient as this rank holds it. In `selective`
        the result is its mean over the DP group, ``|g_SYNC|^2 + mean_k |g_LOCAL,k|^2`` (one fp64
        all-reduce); in the other modes gradients agree already and ``local_sq`` is returned.
        """
        if self.mode != "selective" or not self._has_local():
            return local_sq
        s = agree_scalar(local_sq.detach().double().reshape(1), self.groups, "sum", record=self._rec["control"])
        return (s / self.groups.dp_size).reshape(local_sq.shape).to(local_sq.dtype)

    def agree_overflow(self, flag: bool) -> bool:
        """True on every rank when any rank saw an overflow (one MAX all-reduce)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(agree_scalar(t, self.groups, "max", record=self._rec["control"]).item() > 0)

    # ------------------------------------------------------------------ state, stats, checks

    def _layout(self) -> list[list[str]]:
        return [[b.cls] + list(b.names) for c in (SYNC, LOCAL) for b in self._buckets[c]]

    def state_dict(self) -> dict:
        """Reducer state of THIS rank (residuals differ per rank: save it per rank). Waits for an
        in-flight asynchronous reconciliation (no new collective) and keeps it, so a resumed run
        applies the same correction at the same step as an uninterrupted one."""
        pend = None
        if self._pending is not None:
            p = self._pending
            if p.get("future") is not None:
                self._wait(p["future"])
                p["future"] = None
            pend = {"keys": p["keys"], "snap": p["snap"].cpu().clone(), "avg": p["avg"].cpu().clone(),
                    "step": p["step"]}
        res = {}
        for c in (SYNC, LOCAL):
            for b in self._buckets[c]:
                if b.residual is not None:
                    res[f"{c}:{b.index}"] = b.residual.detach().cpu().clone()
        # Adapted to `flat`, the reducer runs every tensor as SYNC; the state keeps the CONFIGURED mode
        # and classes plus the adaptive level, so a fresh reducer (configured mode) restores both.
        ctrl = self.adaptive
        mode, classes = self.mode, dict(self._classes)
        if ctrl is not None:
            mode = ctrl.base_mode
            if ctrl._saved_classes:
                classes = dict(ctrl._saved_classes)
        return {
            "format": STATE_FORMAT, "mode": mode, "step": self.step, "last_refresh": self._last_refresh,
            "all_synced": self._all_synced, "classes": classes, "layout": self._layout(),
            "adaptive": None if ctrl is None else ctrl.state_dict(),
            "residuals": res, "importance": self.importance.state_dict(), "pending": pend,
            "max_staleness": self.max_staleness, "stats": self.stats_.state_dict(),
            "drift": self._drift.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a reducer state (format {sd.get('format') if isinstance(sd, dict) else None!r}; "
                             f"expected {STATE_FORMAT!r})")
        ctrl = self.adaptive
        mine = ctrl.base_mode if ctrl is not None else self.mode
        if sd["mode"] != mine:
            raise ValueError(f"reducer state was saved in mode {sd['mode']!r}; this reducer runs {mine!r}")
        if set(sd["classes"]) != set(self._names):
            missing = sorted(set(self._names) ^ set(sd["classes"]))[:3]
            raise ValueError(f"reducer state names other parameters than this model (e.g. {missing})")
        ad = sd.get("adaptive")  # absent in states saved before the adaptive state was kept
        if ad and ad.get("level", 0) and ctrl is None:
            raise ValueError(f"reducer state was saved adapted to level {ad.get('available', ['?'] * 4)[ad['level']]!r}; "
                             "this reducer has adaptive.enabled = false (enable it to resume)")
        if ctrl is not None and ctrl.policy.level != 0:
            ctrl._apply(ctrl.policy.level, 0, None, reconcile=False)  # back to the configured level first
            ctrl.policy.level = 0
        if sd["classes"] != self._classes:
            self._classes = dict(sd["classes"])
            self._build_buckets()
        if ctrl is not None and ad:
            ctrl.load_state_dict(ad)  # re-applies the saved level (layout, H, wire) before the checks below
        if sd["layout"] != self._layout():
            raise ValueError("reducer state has another bucket layout (bucket_size_mb or parameter order changed)")
        for c in (SYNC, LOCAL):
            for b in self._buckets[c]:
                key = f"{c}:{b.index}"
                if b.residual is not None:
                    if key in sd["residuals"]:
                        b.residual.copy_(sd["residuals"][key].to(b.residual.device))
                    else:
                        b.residual.zero_()
        self.importance.load_state_dict(sd["importance"])
        self.step = int(sd["step"])
        self._last_refresh = int(sd["last_refresh"])
        self._all_synced = bool(sd["all_synced"])
        self.max_staleness = int(sd["max_staleness"])
        p = sd.get("pending")
        self._pending = None if p is None else {
            "keys": [tuple(k) for k in p["keys"]], "snap": p["snap"].to(self.device),
            "avg": p["avg"].to(self.device), "future": None, "step": int(p["step"])}
        self.stats_.load_state_dict(sd["stats"])
        self._drift.load_state_dict(sd.get("drift"))
        if ctrl is not None:
            ctrl.reset_window()

    def stats(self) -> dict:
        """Bytes, calls and seconds per tier and class (last step and total) plus the current classes."""
        out = self.stats_.as_dict()
        sync_el = sum(self._params[n].numel() for n in self._names if self._classes[n] == SYNC)
        local_el = sum(self._params[n].numel() for n in self._names if self._classes[n] == LOCAL)
        out.update({
            "mode": self.mode, "configured_mode": self.cfg.mode, "fallback_reason": self.fallback_reason,
            "optimizer_steps": self.step, "sync_tensors": sum(c == SYNC for c in self._classes.values()),
            "local_tensors": sum(c == LOCAL for c in self._classes.values()),
            "sync_elements": sync_el, "local_elements": local_el,
            "buckets": {c.lower(): [b.numel for b in self._buckets[c]] for c in (SYNC, LOCAL)},
            "intra_size": self.groups.intra_size, "inter_size": self.groups.inter_size,
            "max_staleness": self.max_staleness, "launched_from_hooks": self.launched_from_hooks,
            "drift": self._drift.as_dict(),
        })
        return out

    def verify_consistency(self) -> None:
        """Check DESIGN invariants 1 and 2 now; raise :class:`ConsistencyError` naming the first
        parameter (or decision) that differs and between which ranks.

        Phases: 1. fingerprint every parameter and the class/bucket layout locally;
                2. all-gather the fingerprints over the DP group; 3. compare: SYNC on all ranks,
                LOCAL inside each group (on all ranks after a reconciliation).
        Collective over the DP group.
        """
        g = self.groups
        layout = str(self._layout()).encode()
        lay = torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(torch.int64)
        rows = [_hash_tensor(lay.to(self.device))] + [_hash_tensor(p) for _, p in self._named]
        mine = torch.stack(rows).reshape(-1)
        allh = [torch.empty_like(mine) for _ in range(g.dp_size)]
        dist.all_gather(allh, mine, group=g.dp_group)
        # all_gather orders by group rank (ascending global rank); reorder to DP positions
        order = sorted(g.dp_ranks)
        H = torch.stack([allh[order.index(r)] for r in g.dp_ranks]).reshape(g.dp_size, len(rows), 2).cpu()
        gi = [self.plan.group_index(pos) for pos in range(g.dp_size)]
        for pos in range(1, g.dp_size):
            if not torch.equal(H[pos, 0], H[0, 0]):
                raise ConsistencyError(
                    f"topo_align: class assignment / bucket layout differs between DP positions 0 and {pos} "
                    f"(global ranks {g.dp_ranks[0]} and {g.dp_ranks[pos]})")
        for i, (name, _) in enumerate(self._named, start=1):
            cls = self._classes[name]
            everywhere = cls == SYNC or self._all_synced
            for pos in range(g.dp_size):
                ref = 0 if everywhere else gi.index(gi[pos])
                if not torch.equal(H[pos, i], H[ref, i]):
                    where = "on all ranks" if everywhere else f"inside group {gi[pos]}"
                    raise ConsistencyError(
                        f"topo_align: parameter {name!r} ({cls}) must be identical {where} but differs between "
                        f"DP positions {ref} and {pos} (global ranks {g.dp_ranks[ref]} and {g.dp_ranks[pos]}, "
                        f"groups {gi[ref]} and {gi[pos]}) after {self.step} optimizer steps")

    def close(self) -> None:
        """Remove the hooks and stop the worker threads."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for ex in self._executors.values():
            ex.shutdown(wait=True)
        self._executors = {}
