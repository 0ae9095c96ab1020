"""`TopoAlignDDP`: megatron-core's DistributedDataParallel whose bucket groups reduce topology-aware.

Everything Megatron owns stays Megatron's: the contiguous grad (and, with the distributed optimizer,
param) buffers, ``param.main_grad`` views, the backward hooks that dispatch a bucket group during
backward, ``no_sync``, the first-batch logic, ``force_all_reduce``, the parameter all-gather of the
distributed optimizer and the optimizer's shard ranges. Megatron's bucket groups get their class
swapped to `TopoBucketGroup` (bucket_group.py), whose collectives go through the shared selective
`Engine` (topo_integrations/reducer/engine/engine.py): one engine per set of topology groups (the dense
data-parallel group and, when it is another set of ranks, the expert one). The engine owns the
policy (classes, importance, drift promotion, adaptive levels), the wire (error feedback, device
checks, statistics), reconciliation (blocking or asynchronous, through its dispatcher) and the state.

Modes (docs/megatron.md):

* ``hierarchical`` -- plain DDP: per bucket, island reduce-scatter, rail all-reduce of the shard,
  island all-gather. Distributed optimizer: ``num_distributed_optimizer_instances`` must equal the
  number of islands and Megatron's instances must be the islands; island reduce-scatter and rail
  all-reduce of this rank's shard (Megatron's own parameter all-gather completes it).
* ``selective`` -- SYNC element ranges reduced over all ranks every step; LOCAL ranges only inside
  the island (released right after the step's last bucket group with SYNC work, during backward
  with ``--overlap-grad-reduce``: bucket_group.py `StepRelease`); every ``local.reconcile_interval``
  optimizer steps the engine averages the LOCAL main parameters and their moments across islands
  (optimizer.py: `MegatronReconcileSource`); gradient statistics are global (`prepare_optimizer`).
* ``flat``, ``enabled: false``, or a topology with a single tier: stock Megatron (nothing swapped).

Keys the adapter cannot honour are refused at start (refusals.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from ..config import Mode, TopoAlignConfig
from ..reducer.classes.classes import SYNC, layer_indices
from ..reducer.engine import AdapterTraits, Engine, EngineTensors
from ..reducer.kinds import Method
from ..reducer.plan.groups import ReducerGroups
from .bucket_group import StepRelease, TopoBucketGroup
from .compat import CORE_BUILT, check_built, check_core
from .groups import GroupSet, LayoutError, groups_for_dp_group
from .layers import global_layer_index
from .layout import instances_refusal
from .loss_capture import LossCapture
from .optimizer import MegatronReconcileSource, prepare_checkpoint, prepare_optimizer
from .refusals import MegatronSide, TopoAlignDDPError, check_config, check_megatron_settings

__all__ = ["TopoAlignDDP", "TopoBucketGroup", "TopoAlignDDPError", "topo_config_of", "prepare_optimizer",
           "prepare_checkpoint", "STATE_FORMAT"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/megatron/v2"

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


class _EngineSlot:
    """One engine and the Megatron bucket groups whose collectives it issues."""

    def __init__(self, engine: Engine, bucket_groups: list, names: dict[torch.nn.Parameter, str]):
        self.engine = engine
        self.bucket_groups = bucket_groups
        self.names = names
        self.source: MegatronReconcileSource | None = None

    def source_for(self, optimizer) -> MegatronReconcileSource | None:
        if optimizer is None:
            return self.source
        if self.source is None or self.source.optimizer is not optimizer:
            self.source = MegatronReconcileSource(self.names, self.bucket_groups, optimizer)
        return self.source


class TopoAlignDDP(DistributedDataParallel):
    """megatron-core DDP with topology-aware gradient reduction (see the module docstring).

    Signature of ``DistributedDataParallel`` plus ``topo_align`` (a `TopoAlignConfig`; default
    ``ddp_config.topo_align_resolved``, which Megatron-LM's ``get_model`` copies from the parsed
    ``--topo-align*`` flags once `install()` ran) and ``topo_groups`` (a `GroupSet` shared with other
    chunks of the model, so they reuse one set of communicators; default: the DDP config's
    ``topo_align_groups`` when it has that field, else a new one). Without a config, with
    ``enabled: false``, mode ``flat`` or a one-tier topology it is stock ``DistributedDataParallel``.

    Construction is collective over the whole job (process groups are created).
    """

    def __init__(self, config, ddp_config, module, disable_bucketing: bool = False, pg_collection=None, *,
                 topo_align: TopoAlignConfig | None = None, topo_groups: GroupSet | None = None):
        cfg, source = topo_config_of(ddp_config, topo_align)
        if cfg is not None and cfg.enabled and cfg.mode != Mode.FLAT:
            check_core()  # the version gate, before Megatron builds what the adapter would then patch
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing, pg_collection=pg_collection)
        self.topo_config = cfg
        self.topo_active = False
        self.topo_reason = "no topo_align config"
        self.topo_groups: ReducerGroups | None = None
        self.topo_expert_groups: ReducerGroups | None = None
        self.topo_slots: list[_EngineSlot] = []
        self._topo_capture: LossCapture | None = None
        if cfg is None:
            return
        if not cfg.enabled or cfg.mode == Mode.FLAT:
            self.topo_reason = "topo_align disabled" if not cfg.enabled else "mode 'flat': Megatron's own reduction"
            log.info("topo_align: %s", self.topo_reason)
            return
        side = MegatronSide(
            use_distributed_optimizer=bool(ddp_config.use_distributed_optimizer),
            overlap_grad_reduce=bool(ddp_config.overlap_grad_reduce),
            pipeline_parallel_size=int(getattr(config, "pipeline_model_parallel_size", 1) or 1),
            calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            reduce_scatter_with_fp32_accumulation=bool(getattr(ddp_config, "reduce_scatter_with_fp32_accumulation",
                                                               False)))
        check_megatron_settings(cfg, side)
        check_config(cfg, side)
        self._topo_check_built()
        self.topo_group_set = topo_groups or getattr(ddp_config, "topo_align_groups", None) or GroupSet()
        if hasattr(ddp_config, "topo_align_groups"):
            ddp_config.topo_align_groups = self.topo_group_set  # the next chunk built from this config reuses it
        groups = groups_for_dp_group(cfg, self.dp_cp_group, self.topo_group_set)
        if not groups.hierarchical:
            reason = groups.plan.reason
            if cfg.fallback.on_flat_topology == "error":
                raise TopoAlignDDPError(f"topo_align: fallback.on_flat_topology = 'error' and the topology has a "
                                        f"single tier ({reason}); use 'flat' to fall back to Megatron's reduction")
            self.topo_reason = f"falling back to Megatron's reduction: {reason}"
            log.warning("topo_align: %s", self.topo_reason)
            return
        self.topo_groups = groups
        if self.expert_parallel_bucket_groups:
            expert_groups = groups_for_dp_group(cfg, self.expt_dp_group, self.topo_group_set)
            if expert_groups.hierarchical:
                self.topo_expert_groups = expert_groups
            else:
                # E.g. expert parallelism inside a node leaves one rank per node in an expert
                # data-parallel group: nothing to reduce hierarchically. Those buckets keep
                # Megatron's reduction (every step, over all their replicas: SYNC in `selective`).
                log.info("topo_align: expert parameters keep Megatron's reduction: %s", expert_groups.plan.reason)
        if ddp_config.use_distributed_optimizer:
            if cfg.mode == Mode.SELECTIVE:
                # Not a silent fallback: the default local.dtype cannot apply here (an explicit
                # other value was refused by check_config above).
                log.info("topo_align: selective with the distributed optimizer: LOCAL gradients travel in the "
                         "island reduce-scatter in the gradient buffer's dtype (%s); local.dtype applies with "
                         "plain DDP only", "fp32" if ddp_config.grad_reduce_in_fp32 else "the parameters' dtype")
            self._topo_check_instances(groups, self.intra_dp_cp_group, "dense")
            if self.topo_expert_groups is not None:
                self._topo_check_instances(self.topo_expert_groups, self.intra_expt_dp_group, "expert")
        self._topo_build_engines(cfg)
        for s in self.topo_slots:  # when each engine's held LOCAL and reconciliation work goes
            StepRelease.attach(s.engine, s.bucket_groups)
        if cfg.mode == Mode.SELECTIVE and cfg.importance.method == Method.HUTCHINSON:
            self._topo_capture = LossCapture(self.module)
            self.topo_set_loss_closure(self._topo_capture.closure)
        self.topo_active = True
        self.topo_reason = f"mode {cfg.mode!r}: {groups.plan.reason}"
        if source == "megatron-lm-args":
            # Built by Megatron-LM through the source patch (--ddp-impl): hook its optimizer and
            # checkpoint calls too, which the patch does not touch.
            from .runtime import install_runtime

            install_runtime()
        log.info("topo_align: TopoAlignDDP active, %s", self.topo_reason)

    # -- set-up helpers ----------------------------------------------------------------------------

    def _topo_check_built(self) -> None:
        """The version gate's second half: attributes megatron-core sets in ``__init__`` (invisible
        to `check_core`), on what Megatron just built, before any class is swapped."""
        check_built(self, CORE_BUILT["ddp"])
        for buf in self.buffers + self.expert_parallel_buffers:
            check_built(buf, CORE_BUILT["buffer"])
            for bucket in buf.buckets:
                check_built(bucket, CORE_BUILT["bucket"])
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            check_built(bg, CORE_BUILT["bucket_group"])

    def _topo_check_instances(self, groups: ReducerGroups, instance_group, kind: str) -> None:
        """The distributed optimizer shards over Megatron's instance groups: they must be our islands."""
        K = self.ddp_config.num_distributed_optimizer_instances
        if K != groups.plan.num_groups:
            raise LayoutError(instances_refusal(K, groups.plan))
        inst = tuple(dist.get_process_group_ranks(instance_group))
        if tuple(sorted(inst)) != tuple(sorted(groups.intra_ranks)) or instance_group.rank() != groups.intra_rank:
            raise LayoutError(
                f"topo_align: Megatron's {kind} optimizer instance of this rank holds global ranks {list(inst)}, "
                f"but its topology group (island) holds {list(groups.intra_ranks)}; Megatron builds instances from "
                "consecutive data-parallel ranks, so launch with the ranks of each node consecutive "
                "(`topo-align hostfile` writes a host order that does this)")

    def _topo_layers(self, cfg: TopoAlignConfig, names: list[str]) -> tuple[dict[str, int | None], int | None]:
        if cfg.sync.layer_pattern is not None:
            return layer_indices(names, layer_pattern=cfg.sync.layer_pattern), None
        return global_layer_index(self.module), self.config.num_layers

    def _topo_build_engines(self, cfg: TopoAlignConfig) -> None:
        """One engine per set of topology groups; bucket groups swapped to `TopoBucketGroup`.

        Dense bucket groups reduce over ``topo_groups``; expert ones over ``topo_expert_groups`` (the
        same object, hence the same engine, when the expert data-parallel group has the same ranks).
        Expert buckets that keep Megatron's reduction are named in the dense engine as forced SYNC
        (they are reduced over all replicas every step), as is the tied word embedding.
        """
        named = {p: n for n, p in self.module.named_parameters() if p.requires_grad}
        by_groups: dict[int, tuple[ReducerGroups, list]] = {id(self.topo_groups): (self.topo_groups, [])}
        by_groups[id(self.topo_groups)][1].extend(self.bucket_groups)
        stock = []
        if self.topo_expert_groups is not None:
            by_groups.setdefault(id(self.topo_expert_groups), (self.topo_expert_groups, []))[1].extend(
                self.expert_parallel_bucket_groups)
        else:
            stock = list(self.expert_parallel_bucket_groups)
        index_map = {b: buf.param_index_map for buf in self.buffers + self.expert_parallel_buffers for b in buf.buckets}
        first = self.buffers[0] if self.buffers else self.expert_parallel_buffers[0]
        device = first.grad_data.device
        for slot_i, (groups, bgs) in enumerate(by_groups.values()):
            params = {p for bg in bgs for p in bg.params}
            extra = {p for bg in stock for p in bg.params} if slot_i == 0 else set()
            mine = {p: n for p, n in named.items() if p in params or p in extra}
            names = list(mine.values())
            layers, num_layers = self._topo_layers(cfg, list(named.values()))
            forced = {n for p, n in mine.items() if p in extra or getattr(p, "shared_embedding", False)}
            self.topo_group_set.share_schedule(groups)  # one schedule for every chunk and the expert engine
            tensors = EngineTensors(names, [p.numel() for p in mine], layers={n: layers.get(n) for n in names},
                                    num_layers=num_layers, params={n: p for p, n in mine.items()},
                                    forced_sync=frozenset(forced))
            # --overlap-grad-reduce: the hooks hand buckets to the dispatcher's thread and return
            # (gloo); on CUDA the dispatcher enqueues on its stream anyway.
            engine = Engine(cfg, groups, tensors, device=device,
                            traits=AdapterTraits.fixed_layout(workers=bool(self.ddp_config.overlap_grad_reduce)))
            if self.ddp_config.bucket_size:
                engine.wire.chunk_numel = min(engine.wire.chunk_numel, int(self.ddp_config.bucket_size))
            for gi, bg in enumerate(bgs):
                bg.__class__ = TopoBucketGroup
                bg.topo_setup(engine, f"s{slot_i}.bg{gi}", mine, index_map)
            engine.on_reconfigure(lambda _e, bgs=bgs: [bg.topo_apply_classes() for bg in bgs])
            if cfg.adaptive.enabled:
                engine.enable_adaptive()
            self.topo_slots.append(_EngineSlot(engine, bgs, mine))

    # -- public API --------------------------------------------------------------------------------

    @property
    def topo_engines(self) -> list[Engine]:
        """The engines of this chunk (dense first)."""
        return [s.engine for s in self.topo_slots]

    @property
    def topo_step(self) -> int:
        """Optimizer steps counted (`topo_after_optimizer_step`)."""
        return self.topo_slots[0].engine.step if self.topo_slots else 0

    def topo_param_classes(self) -> dict[str, str]:
        """Parameter name -> "SYNC" / "LOCAL" (every parameter is SYNC outside `selective`)."""
        if not self.topo_active:
            return {}
        out = {n: SYNC for n, p in self.module.named_parameters() if p.requires_grad}
        for e in self.topo_engines:
            out.update(e.classes)
        return out

    def topo_stats(self) -> dict:
        """Bytes handed to collectives and seconds spent, per class ("sync"/"local"/"reconcile"/"control")
        and tier (only tiers a class used), summed over the engines; ``engines``: each engine's stats."""
        totals: dict[str, dict[str, dict[str, float]]] = {}
        for e in self.topo_engines:
            tot = e.stats_.as_dict()["total"]
            for tier, per_cls in tot["calls"].items():
                for cls, calls in per_cls.items():
                    if calls:
                        slot = totals.setdefault(cls, {}).setdefault(tier, {"bytes": 0, "seconds": 0.0})
                        slot["bytes"] += int(tot["bytes"][tier][cls])
                        slot["seconds"] += float(tot["seconds"][tier][cls])
        return {"step": self.topo_step, "active": self.topo_active, "reason": self.topo_reason, "totals": totals,
                "engines": [e.stats() for e in self.topo_engines]}

    def topo_set_loss_closure(self, fn: Callable[[], torch.Tensor] | None) -> None:
        """The loss closure ``importance.method = "hutchinson"`` differentiates twice at a class
        refresh (replaces the one captured from the model's forward)."""
        for e in self.topo_engines:
            e.set_loss_closure(fn)

    def topo_after_optimizer_step(self, optimizer) -> bool:
        """Tell every engine a step happened (asynchronous correction, reconciliation when due, class
        refresh, drift promotion, adaptive level); log statistics every ``monitor.log_interval`` steps.
        True if it reconciled. Collective over the data-parallel group on reconciliation steps."""
        if not self.topo_active:
            return False
        did = False
        for s in self.topo_slots:
            did = s.engine.after_step(s.source_for(optimizer), optimizer) or did
        if self.topo_step % self.topo_config.monitor.log_interval == 0 and self.topo_groups.position == 0:
            for s in self.topo_slots:
                st = s.engine.stats()
                log.info("topo_align: step %d: %s, SYNC %.1f%% of elements, max staleness %d, step bytes %s",
                         st["optimizer_steps"], st["mode"], 100 * st["sync_fraction"], st["max_staleness"],
                         st["step"]["bytes"])
        return did

    @torch.no_grad()
    def topo_reconcile(self, optimizer=None, blocking: bool = True) -> None:
        """Force a reconciliation now (before evaluation or saving): a pending asynchronous correction
        is applied, then every LOCAL main parameter (or shard) and its moments are averaged across
        islands, main is copied to the model and (distributed optimizer) re-gathered. Afterwards
        (blocking) every parameter is identical on every rank. No-op outside `selective`."""
        for s in self.topo_slots:
            s.engine.reconcile(s.source_for(optimizer), blocking=blocking)

    def topo_state_dict(self) -> dict:
        """The plugin's state for a checkpoint (per rank: error-feedback residuals differ by rank):
        every engine's state (classes, step, importance, residuals, pending correction, drift,
        adaptive level) and the plan. Save it after `topo_reconcile` (`prepare_checkpoint` does both),
        so that the replica-0 model and optimizer checkpoint Megatron writes holds every parameter."""
        return {
            "format": STATE_FORMAT, "active": self.topo_active,
            "mode": self.topo_config.mode if self.topo_config else None, "step": self.topo_step,
            "classes": self.topo_param_classes(),
            "plan": self.topo_groups.plan.to_json() if self.topo_groups is not None else None,
            "engines": [e.state_dict() for e in self.topo_engines],
        }

    def load_topo_state_dict(self, sd: dict) -> None:
        """Restore `topo_state_dict` output (same mode, topology plan and engines; else a clear error)."""
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else None
            raise TopoAlignDDPError(f"topo_align: not a TopoAlignDDP state (format {got!r}; expected {STATE_FORMAT!r})")
        my_mode = self.topo_config.mode if self.topo_config else None
        if sd.get("active") != self.topo_active or sd.get("mode") != my_mode:
            raise TopoAlignDDPError(
                f"topo_align: checkpoint was written with mode {sd.get('mode')!r} (active={sd.get('active')}), "
                f"this run uses {my_mode!r} (active={self.topo_active})")
        mine = self.topo_groups.plan.to_json() if self.topo_groups is not None else None
        if mine is not None and sd.get("plan") is not None and \
                (sd["plan"]["intra_groups"], sd["plan"]["inter_groups"]) != \
                (mine["intra_groups"], mine["inter_groups"]):
            raise TopoAlignDDPError(
                f"topo_align: checkpoint groups {sd['plan']['intra_groups']} differ from this run's "
                f"{mine['intra_groups']}; resume on the same layout (or drop the plugin state)")
        if len(sd["engines"]) != len(self.topo_slots):
            raise TopoAlignDDPError(f"topo_align: checkpoint holds {len(sd['engines'])} engine states, this chunk has "
                                    f"{len(self.topo_slots)} (dense / expert layout changed)")
        for e, esd in zip(self.topo_engines, sd["engines"]):
            e.load_state_dict(esd)

    def topo_close(self) -> None:
        """Stop the engines' worker threads and remove the loss-capture hook."""
        for e in self.topo_engines:
            e.close()
        if self._topo_capture is not None:
            self._topo_capture.close()
