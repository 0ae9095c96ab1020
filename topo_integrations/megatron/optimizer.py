"""The Megatron optimizer side of `TopoAlignDDP`: step hook, checkpoints, global gradient statistics,
and the engine's reconcile source over the optimizer's main parameters and moments.

* `prepare_optimizer` wraps ``optimizer.step()`` so every active chunk tells its engines that a step
  happened (reconciliation when due, asynchronous corrections, class refreshes, adaptive levels) and,
  in `selective`, makes the gradient statistics global (invariant 2 of docs/megatron.md);
* `prepare_checkpoint` reconciles (blocking) and returns each chunk's plugin state;
* `MegatronReconcileSource` lists what the optimizer steps on for the engine's LOCAL parameters:
  the fp32 main parameters (the distributed optimizer's main *shards*: ``shard=True`` items, averaged
  over the rail) and their Adam moments, and after a change copies main to model parameters and,
  with the distributed optimizer, re-gathers the parameters inside each instance. Averaging only
  model parameters would not stick: the next step rewrites them from the main copies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import Mode
from ..reducer.engine import ReconcileItem
from .compat import OPTIMIZER_BUILT, check_built

__all__ = ["prepare_optimizer", "prepare_checkpoint", "is_topo_chunk", "MegatronReconcileSource", "sub_optimizers",
           "make_grad_stats_global", "check_optimizer"]

SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def _fp32_optimizer_cls():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return FP32Optimizer


def is_distopt(sub) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(sub, DistributedOptimizer)


def sub_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds dense + expert ones)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def check_optimizer(optimizer) -> None:
    """The version gate on a built Megatron optimizer (compat.OPTIMIZER_BUILT): every attribute this
    module reads exists, so a renamed one is refused at start instead of e.g. `main_param_pairs`
    silently taking another branch."""
    if "ChainedOptimizer" in {c.__name__ for c in type(optimizer).__mro__}:
        check_built(optimizer, OPTIMIZER_BUILT["ChainedOptimizer"])
    for sub in sub_optimizers(optimizer):
        check_built(sub, OPTIMIZER_BUILT["MegatronOptimizer"])
        check_built(sub.config, OPTIMIZER_BUILT["OptimizerConfig"])
        kinds = {c.__name__ for c in type(sub).__mro__}
        for kind in ("DistributedOptimizer", "Float16OptimizerWithFloat16Params"):
            if kind in kinds:
                check_built(sub, OPTIMIZER_BUILT[kind])


def main_param_pairs(sub) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, the fp32 tensor the optimizer steps on) for one Megatron optimizer.

    Distributed optimizer: the main *shard* (a fresh fp32 tensor for 16-bit params; a view into the
    model param for fp32 params). Float16 optimizer: fp32 copies of 16-bit params, fp32 params
    themselves. FP32 optimizer: the params.
    """
    if is_distopt(sub):
        pairs = []
        for mg, sg in zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups):
            pairs += list(zip(mg, sg))
        for mg, sg in zip(sub.model_fp32_groups, sub.shard_fp32_groups):
            pairs += list(zip(mg, sg))
        return pairs
    if hasattr(sub, "float16_groups"):
        pairs = []
        for mg, sg in zip(sub.float16_groups, sub.fp32_from_float16_groups):
            pairs += list(zip(mg, sg))
        for g in sub.fp32_from_fp32_groups:
            pairs += [(p, p) for p in g]
        return pairs
    return [(p, p) for group in sub.optimizer.param_groups for p in group["params"]]


class MegatronReconcileSource:
    """The engine's `ReconcileSource` for one engine of a `TopoAlignDDP` and a Megatron optimizer."""

    def __init__(self, names: dict[torch.nn.Parameter, str], bucket_groups: list, optimizer):
        self.names = names
        """model parameter -> engine name (the parameters of this engine)."""
        self.bucket_groups = bucket_groups
        self.optimizer = optimizer
        self._pairs: dict[str, tuple[torch.Tensor, Any]] = {}
        for sub in sub_optimizers(optimizer):
            for model_p, main_p in main_param_pairs(sub):
                if model_p in names and main_p is not None and main_p.numel():
                    self._pairs[names[model_p]] = (main_p, sub)
        self._empty = torch.zeros(0, device=bucket_groups[0].buckets[0].grad_data.device) if bucket_groups \
            else torch.zeros(0)
        self._subs = []
        for _, sub in self._pairs.values():
            if all(sub is not s for s in self._subs):
                self._subs.append(sub)

    def items(self, local: list[str]) -> list[ReconcileItem]:
        """Main parameter (or shard) and its floating optimizer state of each LOCAL name this rank
        holds, in the engine's name order (the same on every rail peer: identical buffer layouts)."""
        out = []
        for name in local:
            if name not in self._pairs:
                # Distributed optimizer: no element of this parameter in my shard. An empty item still
                # names it, so every rank measures drift over the same names (one agreed vector).
                out.append(ReconcileItem(f"main:{name}", self._empty, shard=True, param=name))
                continue
            main_p, sub = self._pairs[name]
            shard = is_distopt(sub)
            out.append(ReconcileItem(f"main:{name}", main_p.data, shard=shard, param=name))
            state = sub.optimizer.state.get(main_p, {}) if hasattr(sub, "optimizer") else {}
            for k in sorted(state):
                v = state[k]
                if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.numel() == main_p.numel():
                    out.append(ReconcileItem(f"state:{name}:{k}", v, shard=shard, nonneg=k in SECOND_MOMENTS,
                                             state=True))
        return out

    def written(self) -> None:
        """Main -> model parameters; with the distributed optimizer, re-gather inside each instance
        (Megatron's own parameter all-gather over its instance group)."""
        for sub in self._subs:
            if hasattr(sub, "_copy_main_params_to_model_params") and not isinstance(sub, _fp32_optimizer_cls()):
                sub._copy_main_params_to_model_params()
        for bg in self.bucket_groups:
            if not bg.ddp_config.use_distributed_optimizer:
                continue
            if bg.param_gather_handle is not None:  # an overlapped gather still in flight
                bg.param_gather_handle.wait()
                bg.param_gather_handle = None
            bg.start_param_sync(force_sync=True)


def _chunks(model_chunks) -> list:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def is_topo_chunk(m) -> bool:
    """Whether ``m`` is a `TopoAlignDDP` chunk (ddp.py), asked of the object: ddp.py imports this
    module, so this module does not import its class (every TopoAlignDDP sets ``topo_active`` in its
    constructor and has the ``topo_*`` methods used here)."""
    return hasattr(m, "topo_active") and callable(getattr(m, "topo_state_dict", None))


def prepare_optimizer(optimizer, model_chunks) -> Any:
    """Make a Megatron optimizer agree with `TopoAlignDDP` chunks; returns the same optimizer.

    * ``step()`` then counts steps on every active chunk (`TopoAlignDDP.topo_after_optimizer_step`);
    * in `selective` the gradient statistics become global: found-inf/NaN (skip) and zero counts over
      the whole job, and the gradient norm is ``sqrt(|g_SYNC|^2 + mean_k |g_LOCAL,k|^2)`` on every rank
      (the stock norm when LOCAL gradients agree), so every rank clips by the same factor and skips
      the same steps.

    Communication added: none per step beyond the stock norm all-reduce (it runs over the world
    instead of one instance); reconciliation as the engine schedules it.
    """
    chunks = [m for m in _chunks(model_chunks) if is_topo_chunk(m) and m.topo_active]
    if not chunks or getattr(optimizer, "_topo_prepared", False):
        return optimizer
    check_optimizer(optimizer)
    if any(m.topo_config.mode == Mode.SELECTIVE for m in chunks):
        make_grad_stats_global(optimizer, chunks[0].topo_engines[0])
    original_step = optimizer.step

    def step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        for m in chunks:
            m.topo_after_optimizer_step(optimizer)
        return out

    optimizer.step = step
    optimizer._topo_prepared = True
    optimizer._topo_chunks = chunks
    return optimizer


def prepare_checkpoint(model_chunks, optimizer) -> list[dict]:
    """Reconcile every chunk, blocking (so a replica-0 checkpoint holds every parameter and the
    averaged moments), and return their plugin states (engine state included)."""
    out = []
    for m in _chunks(model_chunks):
        if is_topo_chunk(m):
            m.topo_reconcile(optimizer)
            out.append(m.topo_state_dict())
        else:
            out.append({})
    return out


def make_grad_stats_global(optimizer, engine) -> None:
    """Gradient statistics over the whole job (docs/megatron.md, "Optimizer"): each sub-optimizer's
    ``grad_stats_parallel_group`` becomes the world (found-inf/skip and zero counts agree), and the
    clipping norm is the engine's global norm (`Engine.global_grad_norm_sq`, the one every adapter
    uses): Megatron's own norm over its stock group (the model-parallel group with plain DDP, the
    optimizer instance = island with the distributed optimizer) squared, then averaged over the
    data-parallel ranks (resp. the islands), i.e. ``sqrt(|g_SYNC|^2 + mean_k |g_LOCAL,k|^2)``."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    subs = sub_optimizers(optimizer)
    for sub in subs:
        stock_group = sub.get_grad_stats_parallel_group()
        over = "inter" if is_distopt(sub) else "dp"  # the instance already agrees inside an island
        sub.grad_stats_parallel_group = None  # None = the world, in megatron-core's collectives

        def get_grad_norm(sub=sub, group=stock_group, over=over):
            grads = sub.get_main_grads_for_grad_norm() if sub.get_parameters() else []
            local = get_grad_norm_fp32(grads, grad_stats_parallel_group=group)
            sq = engine.global_grad_norm_sq(torch.tensor([float(local) ** 2], dtype=torch.float64), over=over)
            return math.sqrt(float(sq.item()))

        def clip_grad_norm(clip_grad, sub=sub, get_grad_norm=get_grad_norm):
            norm = get_grad_norm()
            params = sub.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, clip_grad, norm,
                                             sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            return norm

        sub.get_grad_norm = get_grad_norm
        sub.clip_grad_norm = clip_grad_norm
    if len(subs) > 1:
        def chained_norm():
            return math.sqrt(sum(float(s.get_grad_norm() or 0.0) ** 2 for s in subs))

        optimizer.get_grad_norm = chained_norm
