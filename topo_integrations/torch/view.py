"""What the plain-PyTorch adapters share: their view of the engine and the calls after a step.

``GroupedReducer`` and ``TopoAlignHookState`` differ in how gradients reach the engine (buckets
filled from hooks vs DDP's own buckets); counting steps, reconciling, classes and agreement are the
same calls on the same engine, so they live here once. A subclass sets ``engine``, ``device``,
``_params`` (name -> parameter) and ``_optimizer``.
"""

from __future__ import annotations

import logging

import torch

from ..reducer.engine.engine import ParamReconcileSource
from ..reducer.plan.groups import ReducerGroups

__all__ = ["EngineView"]

log = logging.getLogger("topo_align")


class EngineView:
    engine = None
    device = None
    _params: dict = {}
    _optimizer = None

    @property
    def groups(self) -> ReducerGroups:
        return self.engine.groups

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def step(self) -> int:
        return self.engine.step

    def _source(self, optimizer) -> ParamReconcileSource:
        if optimizer is not None:
            self._optimizer = optimizer
        return ParamReconcileSource(self._params, self._optimizer)

    def log_step(self, who: str) -> None:
        """Every ``monitor.log_interval`` optimizer steps DP position 0 logs one statistics line."""
        e = self.engine
        if e.step % e.cfg.monitor.log_interval == 0 and e.groups.position == 0:
            st = e.stats()
            log.info("topo_align: %s step %d: %s, SYNC %.1f%% of elements, %d reconciliations, "
                     "bytes this step %s", who, e.step, st["mode"], 100 * st["sync_fraction"], st["reconciles"],
                     st["step"]["bytes"])

    def reconcile(self, optimizer=None, blocking: bool = True) -> None:
        """Force a full reconciliation now (before evaluation or saving): applies a pending
        asynchronous correction, then averages LOCAL parameters (+ optimizer state) across groups.
        Afterwards every parameter is identical on all ranks. ``blocking=False`` starts an
        asynchronous one instead. No-op outside `selective`. Collective over the DP group."""
        self.engine.reconcile(self._source(optimizer), blocking=blocking)

    def classify(self) -> dict[str, str]:
        """Parameter name -> "SYNC" | "LOCAL" (all SYNC outside `selective`)."""
        return dict(self.engine.classes)

    def global_grad_norm_sq(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Squared gradient norm for clipping, equal on every rank.

        ``local_sq`` is the squared norm of the whole gradient as this rank holds it. In `selective`
        the result is its mean over the DP group, ``|g_SYNC|^2 + mean_k |g_LOCAL,k|^2`` (one fp64
        all-reduce); in the other modes gradients agree already and ``local_sq`` is returned.
        """
        return self.engine.global_grad_norm_sq(local_sq.to(self.device))

    def agree_overflow(self, flag: bool) -> bool:
        """True on every rank when any rank saw an overflow (one MAX all-reduce)."""
        return self.engine.agree_overflow(flag)
