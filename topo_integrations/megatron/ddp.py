"""`TopoAlignDDP`: megatron-core's DistributedDataParallel whose bucket groups reduce topology-aware.

Everything Megatron owns stays Megatron's: the contiguous grad (and, with the distributed optimizer,
param) buffers, ``param.main_grad`` views, the backward post-hooks that count gradients ready and
dispatch a bucket group during backward, ``no_sync`` for gradient accumulation, the first-batch
logic (the first iteration records how many times each gradient arrives; buckets are then
dispatched from ``finish_grad_sync``), ``force_all_reduce``, the parameter all-gather of the
distributed optimizer and the optimizer's shard ranges. Only the two methods of each bucket group
that issue the gradient collectives are replaced (``start_grad_sync`` / ``finish_grad_sync``, the
contract of research/megatron.md 1.6); the bucket groups' class is swapped after Megatron built
them.

Modes (DESIGN.md 4):

* ``hierarchical`` -- plain DDP: per bucket, intra reduce-scatter, inter all-reduce of the shard
  (wire ``communication.inter_dtype``, error feedback when lossy), intra all-gather. Distributed
  optimizer: ``num_distributed_optimizer_instances`` must equal the number of groups and Megatron's
  instances must be the topology's islands; per bucket, intra reduce-scatter and inter all-reduce of
  this rank's shard (Megatron's own parameter all-gather completes it).
* ``selective`` -- SYNC element ranges (from ``buffer.param_index_map``, which knows the distributed
  optimizer's padding) are reduced over all ranks every step; LOCAL ranges only inside the group
  (plain DDP: wire ``local.dtype`` with error feedback). Every ``local.reconcile_interval`` optimizer
  steps the LOCAL fp32 main parameters *and* their optimizer moments are averaged across groups
  (`reconcile`). Gradient-norm and overflow statistics are made global (`prepare_optimizer`), so
  every rank clips by the same factor and skips the same steps.
* ``flat``, ``enabled: false``, or a topology with a single tier: stock Megatron (nothing swapped).

Overlap: the collectives are issued from Megatron's backward hooks. On CUDA they run on a side
communication stream (the stream Megatron creates for ``num_distributed_optimizer_instances > 1``, or
one of ours), as Megatron's own multi-instance path does, and ``finish_grad_sync`` makes the default
stream wait for it; on CPU (gloo) they complete inside the hook.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer

from ..config import ConfigError, TopoAlignConfig
from ..reducer import collectives as C
from ..reducer.compression import is_lossy, wire_dtype
from ..reducer.groups import ReducerGroups
from .classes import classify, global_layer_index
from .groups import LayoutError, groups_for_dp_group

__all__ = ["TopoAlignDDP", "TopoBucketGroup", "TopoAlignDDPError", "topo_config_of"]

log = logging.getLogger("topo_align")

Ranges = list[tuple[int, int]]


class TopoAlignDDPError(ConfigError):
    """TopoAlignDDP cannot run with these settings; the message names the setting and the fix."""


def topo_config_of(ddp_config: Any, explicit: TopoAlignConfig | None = None) -> tuple[TopoAlignConfig | None, str]:
    """The plugin config and where it came from.

    In order: the explicit argument; ``ddp_config.topo_align_resolved`` (`install()` makes
    Megatron-LM's ``get_model`` copy it from the parsed flags); Megatron-LM's parsed arguments
    (the source patch's ``--ddp-impl`` route, where the stock DDP config class is used).
    """
    if explicit is not None:
        return explicit, "argument"
    cfg = getattr(ddp_config, "topo_align_resolved", None)
    if cfg is not None:
        return cfg, "ddp_config"
    try:
        from megatron.training.global_vars import get_args  # Megatron-LM only; absent from the wheel

        cfg = getattr(get_args(), "topo_align_resolved", None)
    except Exception:  # no Megatron-LM, or its arguments are not parsed (core-only use)
        cfg = None
    return cfg, "megatron-lm-args" if cfg is not None else "none"


def _clip(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """Ranges intersected with [lo, hi), made relative to lo."""
    out = []
    for s, e in ranges:
        s2, e2 = max(s, lo), min(e, hi)
        if s2 < e2:
            out.append((s2 - lo, e2 - lo))
    return out


def _gather(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    if len(ranges) == 1:
        s, e = ranges[0]
        return t[s:e].clone()
    return torch.cat([t[s:e] for s, e in ranges])


def _scatter(t: torch.Tensor, ranges: Ranges, values: torch.Tensor) -> None:
    off = 0
    for s, e in ranges:
        t[s:e].copy_(values[off:off + e - s])
        off += e - s


class _Stats:
    """Bytes and seconds per (class, tier), for `TopoAlignDDP.topo_stats`."""

    def __init__(self) -> None:
        self.total: dict[str, dict[str, list[float]]] = {}

    def recorder(self, cls: str):
        def record(tier: str, nbytes: int, seconds: float) -> None:
            slot = self.total.setdefault(cls, {}).setdefault(tier, [0, 0.0])
            slot[0] += nbytes
            slot[1] += seconds

        return record

    def as_dict(self) -> dict:
        return {c: {t: {"bytes": int(v[0]), "seconds": v[1]} for t, v in tiers.items()}
                for c, tiers in self.total.items()}


class TopoBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose gradient collectives follow the topology.

    Instances are Megatron's own bucket groups with their class swapped (see `TopoAlignDDP`);
    `_topo_setup` adds the plugin's state. Megatron's hooks call `register_grad_ready` (inherited),
    which calls `start_grad_sync` once every gradient of the group has arrived in the last
    microbatch.
    """

    # -- set-up ------------------------------------------------------------------------------------

    def _topo_setup(self, owner: "TopoAlignDDP", groups: ReducerGroups, kind: str) -> None:
        self._topo_owner = owner
        self._topo_groups = groups
        self._topo_kind = kind  # "dense" or "expert"
        self._topo_dispatched = False
        self._topo_distopt = bool(self.ddp_config.use_distributed_optimizer)
        self._topo_stream = None
        if torch.cuda.is_available() and self.ddp_config.overlap_grad_reduce:
            # Megatron's multi-instance path already made one; plain DDP gets the owner's.
            self._topo_stream = getattr(self, "communication_stream", None) or owner._topo_comm_stream()
        self._topo_residual: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._topo_local_residual: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._topo_sync_ranges: list[Ranges] = [[] for _ in self.buckets]
        self._topo_local_ranges: list[Ranges] = [[] for _ in self.buckets]

    def _topo_set_classes(self, is_sync: dict[torch.nn.Parameter, bool], param_index_maps: dict) -> None:
        """Bucket-relative SYNC / LOCAL element ranges (from the buffer's padded layout).

        Runs of consecutive parameters of one class become one range (it also covers the
        distributed optimizer's alignment padding between them, whose gradients are zero).
        """
        for i, bucket in enumerate(self.buckets):
            index_map = param_index_maps[bucket]
            spans = sorted((index_map[p][0] - bucket.offset, index_map[p][1] - bucket.offset, bool(is_sync[p]))
                           for p in bucket.params_list)
            runs: list[list] = []
            for s, e, cls in spans:
                if runs and runs[-1][2] == cls:
                    runs[-1][1] = e
                else:
                    runs.append([s, e, cls])
            self._topo_sync_ranges[i] = [(s, e) for s, e, c in runs if c]
            self._topo_local_ranges[i] = [(s, e) for s, e, c in runs if not c]
            # Error-feedback residuals follow the element layout of a class: reset on change.
            self._topo_local_residual[i] = None
            self._topo_residual[i] = None

    # -- Megatron's contract -----------------------------------------------------------------------

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        """Reduce every bucket of the group (see the module docstring for the phases per mode).

        Keeps Megatron's contract: pre-scaling by ``gradient_scaling_factor``, one dispatch per
        iteration (a second call in the first batch is a no-op), plain DDP reduces the whole
        bucket, the distributed optimizer at least this rank's shard, ``force_all_reduce`` reduces
        the whole bucket in either case.
        """
        if self._topo_dispatched:
            if self.is_first_batch:
                return
            raise AssertionError("Should not have multiple communication calls outstanding at once")
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        owner = self._topo_owner
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        if owner._topo_selective and owner._topo_track_importance:
            owner._topo_accumulate_importance(self)
        if self._topo_stream is not None:
            self._topo_stream.wait_stream(torch.cuda.default_stream())
            ctx = torch.cuda.stream(self._topo_stream)
        else:
            ctx = nullcontext()
        with ctx:
            for i, bucket in enumerate(self.buckets):
                if self._topo_distopt and not force_all_reduce:
                    self._reduce_shard(i, bucket)
                else:
                    self._reduce_whole(i, bucket)
        self._topo_dispatched = True
        self.grad_reduce_handle = None

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """Complete this iteration's reduction (dispatching it now when the hooks did not)."""
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
            self._topo_dispatched = False
            return
        if self.is_first_batch and not self._topo_dispatched:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if not self._topo_dispatched:
            raise AssertionError(
                f"Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available)"
            )
        if self._topo_stream is not None:
            torch.cuda.default_stream().wait_stream(self._topo_stream)
        self._topo_dispatched = False

    # -- reductions --------------------------------------------------------------------------------

    def _average(self) -> bool:
        return bool(self.ddp_config.average_in_collective)

    def _reduce_whole(self, i: int, bucket) -> None:
        """The whole bucket: plain DDP, or ``force_all_reduce`` under the distributed optimizer."""
        owner, g = self._topo_owner, self._topo_groups
        grad = bucket.grad_data
        avg = self._average()
        if not owner._topo_selective:
            wire = owner._topo_inter_dtype
            res = self._residual_for(i, grad, wire, -(-grad.numel() // g.intra_size), shard=True)
            C.hierarchical_all_reduce(grad, g, inter_dtype=wire, residual=res, average=avg,
                                      record=owner._topo_stats.recorder("all"))
            return
        sync_r, local_r = self._topo_sync_ranges[i], self._topo_local_ranges[i]
        if sync_r:
            vals = _gather(grad, sync_r)
            wire = owner._topo_sync_dtype
            res = self._residual_for(i, vals, wire, -(-vals.numel() // g.intra_size), shard=True)
            C.hierarchical_all_reduce(vals, g, inter_dtype=wire, residual=res, average=avg,
                                      record=owner._topo_stats.recorder("sync"))
            _scatter(grad, sync_r, vals)
        if local_r:
            vals = _gather(grad, local_r)
            wire = owner._topo_local_dtype
            res = self._residual_for(i, vals, wire, vals.numel(), shard=False)
            C.intra_all_reduce(vals, g, wire_dtype=wire, residual=res, average=avg, low_priority=True,
                               record=owner._topo_stats.recorder("local"))
            if not avg and g.inter_size > 1:
                # Pre-scaled by 1/(L*K) for a global mean; a group mean needs 1/L.
                vals.mul_(g.inter_size)
            _scatter(grad, local_r, vals)

    def _reduce_shard(self, i: int, bucket) -> None:
        """Distributed optimizer: intra reduce-scatter, then the inter hop of (part of) my shard.

        Phases: 1. reduce-scatter SUM of the bucket inside my group (= Megatron's optimizer
        instance), my shard = Megatron's ``shard_buffer(...)[instance rank]``; 2. all-reduce SUM over
        the rail of the whole shard (hierarchical) or of its SYNC ranges (selective), wire dtype per
        class; 3. (selective) LOCAL ranges are rescaled to the group mean.
        """
        owner, g = self._topo_owner, self._topo_groups
        L, K = g.intra_size, g.inter_size
        if self.cached_grad_buffer_shard_list[i] is None:
            self.cached_grad_buffer_shard_list[i] = shard_buffer(bucket.grad_data, L)
        shard = self.cached_grad_buffer_shard_list[i][g.intra_rank]
        avg = self._average()
        rec_all = owner._topo_stats.recorder("sync" if owner._topo_selective else "all")
        if L > 1:
            C._run("reduce_scatter", "intra", g.intra, g, bucket.grad_data.numel() * bucket.grad_data.element_size(),
                   rec_all, lambda: dist.reduce_scatter_tensor(shard, bucket.grad_data, group=g.intra))
        if avg and L > 1:
            shard.div_(L)
        if not owner._topo_selective:
            wire = owner._topo_inter_dtype
            res = self._residual_for(i, shard, wire, shard.numel(), shard=True)
            C._hop(shard, wire, res, g.inter, "inter", g, rec_all, K)
            if avg and K > 1:
                shard.div_(K)
            return
        n = shard.numel()
        lo = g.intra_rank * n
        sync_r = _clip(self._topo_sync_ranges[i], lo, lo + n)
        vals = _gather(shard, sync_r) if sync_r else None
        if vals is not None:
            wire = owner._topo_sync_dtype
            res = self._residual_for(i, vals, wire, vals.numel(), shard=True)
            C._hop(vals, wire, res, g.inter, "inter", g, rec_all, K)
            if avg and K > 1:
                vals.div_(K)
        if not avg and K > 1:
            # LOCAL (and padding) elements: pre-scaled by 1/(L*K), a group mean needs 1/L.
            shard.mul_(K)
        if vals is not None:
            _scatter(shard, sync_r, vals)

    def _residual_for(self, i: int, like: torch.Tensor, wire: torch.dtype, numel: int, *, shard: bool):
        """The error-feedback residual of bucket ``i`` for a lossy hop (None when exact or disabled)."""
        if not self._topo_owner._topo_error_feedback or not is_lossy(like.dtype, wire):
            return None
        store = self._topo_residual if shard else self._topo_local_residual
        res = store[i]
        if res is None or res.numel() != numel:
            res = torch.zeros(numel, dtype=torch.float32, device=like.device)
            store[i] = res
        return res


class TopoAlignDDP(DistributedDataParallel):
    """megatron-core DDP with topology-aware gradient reduction (see the module docstring).

    Signature of ``DistributedDataParallel`` plus ``topo_align`` (a `TopoAlignConfig`; default
    ``ddp_config.topo_align_resolved``, which Megatron-LM's ``get_model`` copies from the parsed
    ``--topo-align*`` flags once `install()` ran). Without a config, with ``enabled: false``, mode
    ``flat`` or a one-tier topology it is stock ``DistributedDataParallel``.

    Construction is collective over the whole job (process groups are created).
    """

    def __init__(self, config, ddp_config, module, disable_bucketing: bool = False, pg_collection=None, *,
                 topo_align: TopoAlignConfig | None = None):
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing, pg_collection=pg_collection)
        self.topo_config, source = topo_config_of(ddp_config, topo_align)
        self.topo_active = False
        self.topo_reason = "no topo_align config"
        self.topo_step = 0
        self._topo_selective = False
        self._topo_track_importance = False
        self._topo_stats = _Stats()
        self._topo_stream_obj = None
        self.topo_groups: ReducerGroups | None = None
        self.topo_expert_groups: ReducerGroups | None = None
        cfg = self.topo_config
        if cfg is None:
            return
        if not cfg.enabled or cfg.mode == "flat":
            self.topo_reason = "topo_align disabled" if not cfg.enabled else "mode 'flat': Megatron's own reduction"
            log.info("topo_align: %s", self.topo_reason)
            return
        self._topo_validate(cfg)
        groups = groups_for_dp_group(cfg, self.dp_cp_group)
        if not groups.hierarchical:
            reason = groups.plan.reason
            if cfg.fallback.on_flat_topology == "error":
                raise TopoAlignDDPError(f"topo_align: the topology has a single tier ({reason}) and "
                                        "fallback.on_flat_topology is 'error'")
            self.topo_reason = f"falling back to Megatron's reduction: {reason}"
            log.warning("topo_align: %s", self.topo_reason)
            return
        self.topo_groups = groups
        if self.expert_parallel_bucket_groups:
            same = (dist.get_process_group_ranks(self.expt_dp_group) == dist.get_process_group_ranks(self.dp_cp_group))
            expert_groups = groups if same else groups_for_dp_group(cfg, self.expt_dp_group)
            if expert_groups.hierarchical:
                self.topo_expert_groups = expert_groups
            else:
                # E.g. expert parallelism inside a node leaves one rank per node in an expert
                # data-parallel group: nothing to reduce hierarchically. Those buckets keep
                # Megatron's reduction (every step, over all their replicas: SYNC in `selective`).
                log.info("topo_align: expert parameters keep Megatron's reduction: %s", expert_groups.plan.reason)
        if ddp_config.use_distributed_optimizer:
            self._topo_check_instances(groups, self.intra_dp_cp_group, "dense")
            if self.topo_expert_groups is not None:
                self._topo_check_instances(self.topo_expert_groups, self.intra_expt_dp_group, "expert")
        self._topo_inter_dtype = wire_dtype(cfg.communication.inter_dtype)
        self._topo_sync_dtype = wire_dtype(cfg.sync.dtype)
        self._topo_local_dtype = wire_dtype(cfg.local.dtype)
        self._topo_error_feedback = cfg.communication.error_feedback
        self._topo_selective = cfg.mode == "selective"
        for bg in self.bucket_groups:
            bg.__class__ = TopoBucketGroup
            bg._topo_setup(self, groups, "dense")
        if self.topo_expert_groups is not None:
            for bg in self.expert_parallel_bucket_groups:
                bg.__class__ = TopoBucketGroup
                bg._topo_setup(self, self.topo_expert_groups, "expert")
        self._topo_names = {p: n for n, p in self.module.named_parameters() if p.requires_grad}
        self._topo_index_maps = {}
        for buf in self.buffers + self.expert_parallel_buffers:
            for bucket in buf.buckets:
                self._topo_index_maps[bucket] = buf.param_index_map
        if self._topo_selective:
            self._topo_setup_selective(cfg)
            if cfg.local.async_reconcile:
                log.info("topo_align: the Megatron adapter reconciles synchronously (local.async_reconcile "
                         "is not implemented here yet)")
            if ddp_config.use_distributed_optimizer and cfg.local.dtype != "fp32":
                log.info("topo_align: with the distributed optimizer LOCAL gradients are reduce-scattered in the "
                         "gradient buffer's dtype; local.dtype=%s applies to plain DDP", cfg.local.dtype)
        self.topo_active = True
        self.topo_reason = f"mode {cfg.mode!r}: {groups.plan.reason}"
        if source == "megatron-lm-args":
            # Built by Megatron-LM through the source patch (--ddp-impl): hook its optimizer and
            # checkpoint calls too, which the patch does not touch.
            from .megatron_lm import install_runtime

            install_runtime()
        log.info("topo_align: TopoAlignDDP active, %s", self.topo_reason)

    # -- set-up helpers ----------------------------------------------------------------------------

    def _topo_validate(self, cfg: TopoAlignConfig) -> None:
        if cfg.mode == "selective" and self.config.calculate_per_token_loss:
            raise TopoAlignDDPError(
                "topo_align: calculate_per_token_loss is not supported (Megatron all-reduces the token count "
                "over the whole data-parallel group, LOCAL gradients would need group counts); turn it off or "
                "use mode 'flat'")
        if cfg.mode == "selective" and cfg.importance.method == "hutchinson":
            raise TopoAlignDDPError(
                "topo_align: importance.method 'hutchinson' needs a loss closure, which Megatron's schedules do "
                "not expose; use 'fisher' or 'magnitude' with Megatron")
        if self.ddp_config.reduce_scatter_with_fp32_accumulation:
            raise TopoAlignDDPError("topo_align: reduce_scatter_with_fp32_accumulation is not supported; turn it off")

    def _topo_check_instances(self, groups: ReducerGroups, instance_group, kind: str) -> None:
        """The distributed optimizer shards over Megatron's instance groups: they must be our islands."""
        K = self.ddp_config.num_distributed_optimizer_instances
        plan = groups.plan
        if K != plan.num_groups:
            raise LayoutError(
                f"topo_align: with the distributed optimizer, num_distributed_optimizer_instances must equal the "
                f"number of topology groups: it is {K}, the topology has {plan.num_groups} groups of "
                f"{plan.group_size} ranks; launch with --num-distributed-optimizer-instances {plan.num_groups}")
        inst = tuple(dist.get_process_group_ranks(instance_group))
        if tuple(sorted(inst)) != tuple(sorted(groups.intra_ranks)) or instance_group.rank() != groups.intra_rank:
            raise LayoutError(
                f"topo_align: Megatron's {kind} optimizer instance of this rank holds global ranks {list(inst)}, "
                f"but its topology group (island) holds {list(groups.intra_ranks)}; Megatron builds instances from "
                "consecutive data-parallel ranks, so launch with the ranks of each node consecutive "
                "(`topo-align hostfile` writes a host order that does this)")

    def _topo_comm_stream(self):
        if self._topo_stream_obj is None:
            self._topo_stream_obj = torch.cuda.Stream(device=torch.cuda.current_device())
        return self._topo_stream_obj

    # -- selective: classes and importance --------------------------------------------------------

    def _topo_setup_selective(self, cfg: TopoAlignConfig) -> None:
        self._topo_layer_of = global_layer_index(self.module, cfg.sync.layer_pattern)
        stock = {p for bg in self.expert_parallel_bucket_groups if not isinstance(bg, TopoBucketGroup)
                 for p in bg.params}
        self._topo_forced = {n for p, n in self._topo_names.items()
                             if getattr(p, "shared_embedding", False) or p in stock}
        self._topo_params = [p for p in self._topo_names if p in self._topo_param_group_map()]
        self._topo_track_importance = cfg.sync.top_fraction > 0 and cfg.sync.top_fraction < 1 and \
            cfg.importance.method == "fisher"
        self._topo_scores = torch.zeros(len(self._topo_params), dtype=torch.float32,
                                        device=self._topo_params[0].main_grad.device if self._topo_params else "cpu")
        self._topo_score_index = {p: i for i, p in enumerate(self._topo_params)}
        self._topo_next_refresh = cfg.importance.refresh_interval
        self.topo_classes = self._topo_compute_classes(None)
        self._topo_apply_classes()

    def _topo_param_group_map(self) -> dict:
        out = {}
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            for p in bg.params:
                out[p] = bg
        return out

    def _topo_compute_classes(self, scores: dict[str, float] | None) -> dict[str, bool]:
        named = [(self._topo_names[p], p.numel()) for p in self._topo_params]
        return classify(named, self._topo_layer_of, self.config.num_layers, self.topo_config.sync,
                        forced_sync=self._topo_forced, scores=scores)

    def _topo_apply_classes(self) -> None:
        is_sync = {p: self.topo_classes[self._topo_names[p]] for p in self._topo_params}
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            if isinstance(bg, TopoBucketGroup):
                bg._topo_set_classes(is_sync, self._topo_index_maps)

    @torch.no_grad()
    def _topo_accumulate_importance(self, bg: TopoBucketGroup) -> None:
        """Fisher: EMA of the squared gradient norm per element of each tensor (local gradients)."""
        decay = self.topo_config.importance.ema_decay
        params = [p for b in bg.buckets for p in b.params_list]
        idx = torch.tensor([self._topo_score_index[p] for p in params], device=self._topo_scores.device)
        sq = torch.stack([p.main_grad.float().pow(2).sum() / p.numel() for p in params])
        self._topo_scores[idx] = decay * self._topo_scores[idx] + (1 - decay) * sq

    def _topo_refresh_classes(self) -> bool:
        """Re-rank with importance agreed over the data-parallel group; True if classes changed.

        Communication: one all-reduce (SUM) of the per-tensor score vector over the DP group.
        """
        cfg = self.topo_config
        if cfg.importance.method == "magnitude":
            local = torch.stack([p.detach().float().pow(2).sum() / p.numel() for p in self._topo_params])
        else:
            local = self._topo_scores
        agreed = C.agree_scalar(local, self.topo_groups, "sum")
        scores = {self._topo_names[p]: float(v) for p, v in zip(self._topo_params, agreed.tolist())}
        new = self._topo_compute_classes(scores)
        changed = new != self.topo_classes
        if changed:
            self.topo_classes = new
            self._topo_apply_classes()
            n_sync = sum(new.values())
            log.info("topo_align: classes refreshed at step %d: %d SYNC / %d LOCAL tensors",
                     self.topo_step, n_sync, len(new) - n_sync)
        return changed

    # -- public API --------------------------------------------------------------------------------

    def topo_param_classes(self) -> dict[str, str]:
        """Parameter name -> "SYNC" / "LOCAL" (every parameter is SYNC outside `selective`)."""
        if not self._topo_selective:
            return {n: "SYNC" for n in self._topo_names.values()} if self.topo_active else {}
        return {n: "SYNC" if s else "LOCAL" for n, s in self.topo_classes.items()}

    def topo_stats(self) -> dict:
        """Bytes handed to collectives and seconds spent, per class ("all"/"sync"/"local"/"reconcile") and tier."""
        return {"step": self.topo_step, "active": self.topo_active, "reason": self.topo_reason,
                "totals": self._topo_stats.as_dict()}

    def topo_after_optimizer_step(self, optimizer) -> bool:
        """Count an optimizer step; reconcile (and refresh classes) when due. True if it reconciled."""
        if not self.topo_active:
            return False
        self.topo_step += 1
        if self._topo_selective and self.topo_step % self.topo_config.local.reconcile_interval == 0:
            self.topo_reconcile(optimizer)
            return True
        return False

    @torch.no_grad()
    def topo_reconcile(self, optimizer) -> None:
        """Average LOCAL parameters, their fp32 main copies and optimizer moments across groups.

        Afterwards every parameter is identical on every rank. Classes are refreshed here when a
        refresh is due (right after the average, when all replicas agree).

        Communication, per optimizer of the chunk:
          distributed optimizer: 1. all-reduce SUM over the rail (inter group) of this rank's LOCAL
          main-shard elements and their moments (peers hold the same shard ranges), divide by K;
          2. copy main to model params; 3. Megatron's parameter all-gather inside the instance.
          other optimizers: `reconcile_average` of the LOCAL main params and moments (each rank 1/L
          over the rail, all-gather in the group); copy main to model params.
        """
        if not (self.topo_active and self._topo_selective):
            return
        local = {p for p in self._topo_params if not self.topo_classes[self._topo_names[p]]}
        dense = set(p for bg in self.bucket_groups for p in bg.params)
        rec = self._topo_stats.recorder("reconcile")
        for sub in _sub_optimizers(optimizer):
            pairs = _main_param_pairs(sub)
            by_groups: dict[int, tuple[ReducerGroups, list[torch.Tensor]]] = {}
            for model_p, main_p in pairs:
                if model_p not in local or main_p is None or main_p.numel() == 0:
                    continue
                g = self.topo_groups if model_p in dense else self.topo_expert_groups
                tensors = by_groups.setdefault(id(g), (g, []))[1]
                tensors.append(main_p)
                state = sub.optimizer.state.get(main_p, {}) if hasattr(sub, "optimizer") else {}
                for key in sorted(state):
                    v = state[key]
                    if key != "step" and torch.is_tensor(v) and v.is_floating_point() and v.numel() == main_p.numel():
                        tensors.append(v)
            for g, tensors in by_groups.values():
                flat = torch.cat([t.reshape(-1).float() for t in tensors])
                if _is_distopt(sub):
                    C._run("all_reduce", "inter", g.inter_low, g, flat.numel() * flat.element_size(), rec,
                           lambda: dist.all_reduce(flat, group=g.inter_low))
                    flat.div_(g.inter_size)
                else:
                    C.reconcile_average(flat, g, low_priority=True, record=rec)
                off = 0
                for t in tensors:
                    t.view(-1).copy_(flat[off:off + t.numel()].to(t.dtype))
                    off += t.numel()
            if hasattr(sub, "_copy_main_params_to_model_params") and not isinstance(sub, _fp32_optimizer_cls()):
                sub._copy_main_params_to_model_params()
        if self.ddp_config.use_distributed_optimizer:
            for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
                if bg.param_gather_handle is not None:  # an overlapped gather still in flight
                    bg.param_gather_handle.wait()
                    bg.param_gather_handle = None
            self.start_param_sync(force_sync=True)
        if self.topo_step >= self._topo_next_refresh:
            self._topo_next_refresh += self.topo_config.importance.refresh_interval
            if self.topo_config.sync.top_fraction not in (0.0, 1.0):
                self._topo_refresh_classes()

    def topo_state_dict(self) -> dict:
        """The plugin's state for a checkpoint (per rank: error-feedback residuals differ by rank).

        Save it after `topo_reconcile` (`prepare_checkpoint` does both), so that the
        replica-0 model and optimizer checkpoint Megatron writes holds every parameter.
        """
        residuals = {}
        for gi, bg in enumerate(self.bucket_groups + self.expert_parallel_bucket_groups):
            if not isinstance(bg, TopoBucketGroup):
                continue
            for i in range(len(bg.buckets)):
                for tag, store in (("shard", bg._topo_residual), ("local", bg._topo_local_residual)):
                    if store[i] is not None:
                        residuals[f"{gi}.{i}.{tag}"] = store[i].detach().cpu().clone()
        return {
            "version": 1,
            "active": self.topo_active,
            "mode": self.topo_config.mode if self.topo_config else None,
            "step": self.topo_step,
            "next_refresh": getattr(self, "_topo_next_refresh", None),
            "classes": dict(getattr(self, "topo_classes", {}) or {}),
            "scores": self._topo_scores.detach().cpu().clone() if self._topo_selective else None,
            "residuals": residuals,
            "plan": self.topo_groups.plan.to_json() if self.topo_groups is not None else None,
            "stats": self._topo_stats.as_dict(),
        }

    def load_topo_state_dict(self, sd: dict) -> None:
        """Restore `topo_state_dict` output (same mode and topology plan; else a clear error)."""
        if not isinstance(sd, dict) or sd.get("version") != 1:
            version = sd.get("version") if isinstance(sd, dict) else None
            raise TopoAlignDDPError(f"topo_align: not a TopoAlignDDP state (version {version!r}; expected 1)")
        mine = self.topo_groups.plan.to_json() if self.topo_groups is not None else None
        my_mode = self.topo_config.mode if self.topo_config else None
        if sd.get("active") != self.topo_active or sd.get("mode") != my_mode:
            raise TopoAlignDDPError(
                f"topo_align: checkpoint was written with mode {sd.get('mode')!r} (active={sd.get('active')}), "
                f"this run uses {self.topo_config.mode if self.topo_config else None!r} (active={self.topo_active})")
        if mine is not None and sd.get("plan") is not None and \
                (sd["plan"]["intra_groups"], sd["plan"]["inter_groups"]) != \
                (mine["intra_groups"], mine["inter_groups"]):
            raise TopoAlignDDPError(
                f"topo_align: checkpoint groups {sd['plan']['intra_groups']} differ from this run's "
                f"{mine['intra_groups']}; resume on the same layout (or drop the plugin state)")
        self.topo_step = int(sd["step"])
        if self._topo_selective:
            self._topo_next_refresh = sd["next_refresh"]
            if sd["classes"]:
                if set(sd["classes"]) != set(self.topo_classes):
                    raise TopoAlignDDPError("topo_align: checkpoint classes name other parameters than this model's")
                self.topo_classes = dict(sd["classes"])
                self._topo_apply_classes()
            if sd["scores"] is not None:
                self._topo_scores.copy_(sd["scores"].to(self._topo_scores.device))
        for key, value in sd.get("residuals", {}).items():
            gi, i, tag = key.split(".")
            bg = (self.bucket_groups + self.expert_parallel_bucket_groups)[int(gi)]
            store = bg._topo_residual if tag == "shard" else bg._topo_local_residual
            store[int(i)] = value.to(bg.buckets[int(i)].grad_data.device).clone()


# -- optimizer helpers ---------------------------------------------------------------------------


def _fp32_optimizer_cls():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return FP32Optimizer


def _is_distopt(sub) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(sub, DistributedOptimizer)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _main_param_pairs(sub) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, the fp32 tensor the optimizer steps on) for one Megatron optimizer.

    Distributed optimizer: the main *shard* (a fresh fp32 tensor for 16-bit params; a view into the
    model param for fp32 params). Float16 optimizer: fp32 copies of 16-bit params, fp32 params
    themselves. FP32 optimizer: the params.
    """
    if _is_distopt(sub):
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


def prepare_optimizer(optimizer, model_chunks) -> Any:
    """Make a Megatron optimizer agree with `TopoAlignDDP` chunks; returns the same optimizer.

    * ``step()`` then counts steps on every active chunk and reconciles when due;
    * in `selective` mode the gradient statistics become global: found-inf/NaN (skip) and
      zero counts over the whole job, and the gradient norm is
      ``sqrt(|g_SYNC|^2 + mean_k |g_LOCAL,k|^2)`` on every rank (the stock norm when LOCAL gradients
      agree), so every rank clips by the same factor and skips the same steps (invariant 2).

    Communication added: none per step beyond the stock norm all-reduce (it runs over the world
    instead of one instance); reconciliation as in `TopoAlignDDP.topo_reconcile`.
    """
    chunks = [m for m in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])
              if isinstance(m, TopoAlignDDP) and m.topo_active]
    if not chunks or getattr(optimizer, "_topo_prepared", False):
        return optimizer
    if any(m._topo_selective for m in chunks):
        _make_grad_stats_global(optimizer)
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
    """Reconcile every chunk (so a replica-0 checkpoint holds every parameter) and return their plugin states."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    out = []
    for m in chunks:
        if isinstance(m, TopoAlignDDP):
            m.topo_reconcile(optimizer)
            out.append(m.topo_state_dict())
        else:
            out.append({})
    return out


def _make_grad_stats_global(optimizer) -> None:
    """Gradient statistics over the whole job, norm divided by sqrt(replicas) (research/megatron-selective.md)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    world = dist.get_world_size()
    subs = _sub_optimizers(optimizer)
    for sub in subs:
        old = sub.get_grad_stats_parallel_group()
        old_size = dist.get_world_size(old) if old is not None else world
        replicas = world / old_size
        sub.grad_stats_parallel_group = None  # None = the world, in megatron-core's collectives

        def get_grad_norm(sub=sub, replicas=replicas):
            grads = sub.get_main_grads_for_grad_norm() if sub.get_parameters() else []
            return get_grad_norm_fp32(grads, grad_stats_parallel_group=None) / math.sqrt(replicas)

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
