"""GroupedReducer: topology-aware gradient reduction for any ``nn.Module`` (docs/reducer.md).

One training step, seen from the reducer:

  backward     post-accumulate-grad hooks copy each gradient into its bucket (fp32, reverse
               registration order); a bucket is launched when it is full and every earlier bucket
               of its class has been launched (so all ranks issue collectives in the same order even
               when some parameters get no gradient). With ``communication.overlap`` the bucket is
               handed to the engine's one schedule (the dispatcher's thread on gloo, one communication
               stream on CUDA; SYNC and LOCAL on their own process groups, LOCAL released after the
               step's last SYNC bucket), overlapping backward.
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

The policy (classes, importance, drift, reconciliation schedule, adaptive levels, state) and every
collective live in the shared :class:`~topo_integrations.reducer.engine.Engine` that the DeepSpeed
and Megatron adapters use too; this class adds what a bare ``nn.Module`` needs: buckets filled from
post-accumulate-grad hooks, parameter broadcast (reducer/wire/replicas.py), and the consistency check.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable

import torch
import torch.nn as nn

from ..config import Mode, TopoAlignConfig
from ..reducer.classes.classes import LOCAL, SYNC, layer_indices
from ..reducer.classes.importance import Importance
from ..reducer.engine import AdapterTraits, Engine, EngineTensors
from ..reducer.kinds import Method
from ..reducer.plan.discover import discover_plan
from ..reducer.plan.groups import ReducerGroups, build_groups
from ..reducer.schedule.dispatch import CommBucket
from ..reducer.wire.replicas import broadcast_from_first
from ..topology import Plan
from .buckets import Bucket, build_buckets
from .consistency import ConsistencyError, verify_replicas
from .view import EngineView

__all__ = ["GroupedReducer", "ConsistencyError", "trainable_parameters", "topology_groups"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/reducer/v2"

FIRST_BUCKET_BYTES = 1024 * 1024
"""Cap of the first bucket of each class, in fp32 bytes (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``: 1 MiB)."""


def check_config(cfg, loss_closure, who: str) -> None:
    """What a plain-PyTorch adapter refuses before it builds anything (named after ``who``)."""
    if not isinstance(cfg, TopoAlignConfig):
        raise TypeError(f"cfg must be a TopoAlignConfig, got {type(cfg).__name__}")
    if cfg.importance.method == Method.HUTCHINSON and cfg.mode == Mode.SELECTIVE and loss_closure is None:
        raise ValueError("importance.method = 'hutchinson' needs a loss closure: "
                         f"{who}(..., loss_closure=lambda: loss_fn(model(batch)))")


def topology_groups(cfg: TopoAlignConfig, *, groups: ReducerGroups | None = None, plan: Plan | None = None,
                    dp_ranks_all: list[list[int]] | None = None) -> tuple[ReducerGroups, str | None]:
    """The groups to reduce over (discovered and built unless given) and why the mode falls back to
    `flat` (None when it does not). A one-tier plan is an error with ``fallback.on_flat_topology =
    'error'``. Collective over the default group when it discovers or builds."""
    if groups is None:
        if plan is None:
            plan = discover_plan(cfg)
        groups = build_groups(plan, dp_ranks_all=dp_ranks_all, timeout_s=cfg.fallback.timeout_s)
    if cfg.mode == Mode.FLAT or groups.hierarchical:
        return groups, None
    if cfg.fallback.on_flat_topology == "error":
        raise ValueError(f"topo_align: mode {cfg.mode!r} needs a hierarchical plan, but {groups.plan.reason} "
                         "(fallback.on_flat_topology = 'error')")
    log.warning("topo_align: mode %r falls back to 'flat': %s", cfg.mode, groups.plan.reason)
    return groups, groups.plan.reason


def trainable_parameters(model: nn.Module, param_names: dict | None = None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that requires a gradient, registration order, shared ones
    once; ``param_names`` (parameter -> name or name -> parameter) overrides the module's names."""
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


def _dense(name: str, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        raise ValueError(f"topo_align: parameter {name!r} has a sparse gradient; the reducer supports dense "
                         "gradients only (use nn.Embedding(sparse=False))")
    return grad.detach()


class GroupedReducer(EngineView):
    """See the module docstring. Public methods: docs/reducer.md."""

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
        check_config(cfg, loss_closure, "GroupedReducer")
        self.cfg = cfg
        self.model = model
        groups, self.fallback_reason = topology_groups(cfg, groups=groups, plan=plan, dp_ranks_all=dp_ranks_all)

        # Parameters: registration order, shared parameters once.
        self._named = trainable_parameters(model, param_names)
        if not self._named:
            raise ValueError("topo_align: the model has no parameter that requires a gradient")
        self._params = {n: p for n, p in self._named}
        self._names = [n for n, _ in self._named]
        self.device = self._named[0][1].device
        if broadcast_parameters:
            # Every replica starts from DP position 0's parameters and buffers (as DDP does); before
            # the engine exists, whose initial classes rank the parameters by magnitude.
            broadcast_from_first(list(model.parameters()) + list(model.buffers()), groups)

        tensors = EngineTensors(self._names, [p.numel() for _, p in self._named],
                                layers=layer_indices(self._names, model=model, layer_pattern=cfg.sync.layer_pattern),
                                params=self._params, loss_closure=loss_closure)
        self.engine = Engine(cfg, groups, tensors, device=self.device,
                             traits=AdapterTraits(workers=cfg.communication.overlap, can_regroup=True))
        # The bucket size the engine resolved (`auto`: from the group count, config.resolve_bucket_mb).
        self._bucket_numel = max(1, int(self.engine.cfg.communication.bucket_size_mb * 1024 * 1024) // 4)
        self.engine.wire.chunk_numel = min(self.engine.wire.chunk_numel, self._bucket_numel)
        self.engine.on_reconfigure(lambda _engine: self._build_buckets())
        self._build_buckets()
        self._sync_enabled = True
        self._optimizer = None
        self.launched_from_hooks = 0
        """Buckets launched during backward (overlap), cumulative; the rest launch in finish_grad_sync."""
        self._hooks = []
        if register_hooks:
            # The hooks hold the reducer weakly: a parameter holds its hooks, so a strong reference
            # would keep a reducer dropped without close() (its engine, threads and process groups)
            # alive as long as the model. A dropped reducer takes its hooks off the model with it.
            me = weakref.ref(self)
            for n, p in self._named:
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, n)))
            weakref.finalize(self, _remove_hooks, list(self._hooks))
        if cfg.adaptive.enabled:
            self.engine.enable_adaptive()

    # ------------------------------------------------------------------ the engine's view

    @property
    def plan(self) -> Plan:
        return self.engine.groups.plan

    @property
    def adaptive(self):
        return self.engine.adaptive

    @property
    def max_staleness(self) -> int:
        return self.engine.reconciler.max_staleness

    @property
    def importance(self) -> Importance:
        return self.engine.importance

    # ------------------------------------------------------------------ set-up helpers

    def _build_buckets(self) -> None:
        """Buckets per class for the engine's current classes and groups (also its reconfigure listener)."""
        self._buckets = build_buckets(self._named, self.engine.classes, bucket_numel=self._bucket_numel,
                                      pad_to=self.engine.groups.intra_size, class_order=(SYNC, LOCAL),
                                      first_bucket_numel=FIRST_BUCKET_BYTES // 4)
        self._where: dict[str, tuple[Bucket, int, int]] = {}
        for bl in self._buckets.values():
            for b in bl:
                for n, off, p in zip(b.names, b.offsets, b.params):
                    self._where[n] = (b, off, p.numel())
        self._next = {SYNC: 0, LOCAL: 0}

    # ------------------------------------------------------------------ backward side

    def _on_grad(self, name: str, p: torch.Tensor) -> None:
        """A parameter's gradient is accumulated: copy it into its bucket; launch a full bucket."""
        if not self._sync_enabled:
            return
        b, off, n = self._where[name]
        if name in b.ready and b.launched:
            raise RuntimeError(
                f"topo_align: parameter {name!r} received a gradient after its bucket was reduced "
                "(two backward passes before finish_grad_sync?); use no_sync() for accumulation")
        b.buffer[off:off + n].copy_(_dense(name, p.grad).reshape(-1))
        b.ready.add(name)
        if b.full and self.cfg.communication.overlap:  # else everything launches in finish_grad_sync
            self.launched_from_hooks += self._launch_ready(b.cls)

    def _launch_ready(self, cls: str) -> int:
        """Launch, in order, the buckets of ``cls`` that are full; returns how many were launched."""
        bl = self._buckets[cls]
        n = 0
        while self._next[cls] < len(bl) and bl[self._next[cls]].full:
            self._launch(bl[self._next[cls]])
            self._next[cls] += 1
            n += 1
        return n

    def _launch(self, b: Bucket) -> None:
        """Hand one bucket to the dispatcher (it decides wire, residual, levels and when it goes)."""
        b.launched = True
        b.future = self.engine.reduce(CommBucket(f"{b.cls.lower()}/{b.index}", b.buffer), b.cls)
        if b.cls == SYNC and self._next[SYNC] + 1 >= len(self._buckets[SYNC]):
            self.engine.sync_done()  # the step's last SYNC bucket: LOCAL buckets may follow
        left = sum(len(self._buckets[c]) - self._next[c] for c in (SYNC, LOCAL)) - 1
        if left == 0:
            self.engine.all_submitted()  # the step's last bucket: held reconciliation may follow

    def finish_grad_sync(self) -> None:
        """Launch the remaining buckets, wait for all, write the reduced gradients into ``p.grad``.

        Inside ``no_sync()`` it does nothing (gradients keep accumulating locally).
        """
        if not self._sync_enabled:
            return
        if not self._buckets[SYNC]:
            self.engine.sync_done()
        if not any(self._buckets.values()):
            self.engine.all_submitted()
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
                    self.engine.wait(b.future)
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
        if self.engine.tracks_fisher:
            self.engine.observe(self._names, Importance.grad_sq_sums([p for _, p in self._named]))

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
        """Count the step; in `selective` apply a pending asynchronous correction, reconcile when due
        (LOCAL parameters and the optimizer state of their shape), re-rank the classes when a refresh
        is due. Collective over the DP group on reconciliation steps (same steps on every rank).
        Every ``monitor.log_interval`` steps DP position 0 logs one statistics line."""
        self.engine.after_step(self._source(optimizer), optimizer)
        self.log_step("GroupedReducer")

    # ------------------------------------------------------------------ classes and agreement

    def sync_mask(self) -> dict[str, bool]:
        return {n: c == SYNC for n, c in self.engine.classes.items()}

    def is_sync(self, name: str) -> bool:
        return self.engine.is_sync(name)

    # ------------------------------------------------------------------ state, stats, checks

    def _layout(self) -> list[list[str]]:
        return [[b.cls] + list(b.names) for c in (SYNC, LOCAL) for b in self._buckets[c]]

    def state_dict(self) -> dict:
        """Reducer state of THIS rank (residuals differ per rank: save it per rank). Waits for an
        in-flight asynchronous reconciliation (no new collective) and keeps it, so a resumed run
        applies the same correction at the same step as an uninterrupted one."""
        return {"format": STATE_FORMAT, "engine": self.engine.state_dict(), "layout": self._layout()}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a reducer state (format {sd.get('format') if isinstance(sd, dict) else None!r}; "
                             f"expected {STATE_FORMAT!r})")
        self.engine.load_state_dict(sd["engine"])
        if sd["layout"] != self._layout():
            raise ValueError("reducer state has another bucket layout (bucket_size_mb or parameter order changed, or "
                             "the state predates the 1 MiB first bucket); its error-feedback residuals are per bucket, "
                             "so resume with the same bucket_size_mb and code that saved it")

    def stats(self) -> dict:
        """Bytes, calls and seconds per tier and class (last step and total) plus the current classes."""
        out = self.engine.stats()
        out.update({"fallback_reason": self.fallback_reason,
                    "buckets": {c.lower(): [b.numel for b in self._buckets[c]] for c in (SYNC, LOCAL)},
                    "launched_from_hooks": self.launched_from_hooks})
        return out

    def verify_consistency(self) -> None:
        """Check invariants 1 and 2 (docs/reducer.md) now; raise :class:`ConsistencyError` naming the first
        parameter (or decision) that differs and between which ranks (torch/consistency.py).
        Collective over the DP group (one all-gather, issued in the engine's schedule)."""
        verify_replicas(self.engine, self._named, str(self._layout()))

    def close(self) -> None:
        """Remove the hooks and stop the worker threads."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.engine.close()


def _grad_hook(ref: "weakref.ref[GroupedReducer]", name: str):
    """The post-accumulate-grad hook of parameter ``name``, holding its reducer weakly."""
    def hook(p: torch.Tensor) -> None:
        red = ref()
        if red is not None:
            red._on_grad(name, p)
    return hook


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
