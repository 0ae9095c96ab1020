"""The adapter's per-engine object: one shared :class:`~topo_integrations.reducer.engine.Engine` and
what DeepSpeed needs around it.

Attached as ``engine.topo_align`` (and as ``optimizer.topo_align`` on a ZeRO optimizer). The policy
(classes, importance, reconciliation schedule, drift, adaptive levels, error feedback, statistics,
state) is the Engine's, the same one GroupedReducer and the Megatron adapter use; this object only
adds the DeepSpeed specifics:

* the stable keys of DeepSpeed's anonymous buckets (the same buckets arrive in the same order every
  step, so a bucket's key is its sequence number within the step, reset after every optimizer step);
* the reconcile source of the stage (ZeRO-0: module parameters + torch optimizer state; ZeRO-1/2
  `selective`: the optimizer's LOCAL partition slices, see zero.py);
* the loss closure ``importance.method = "hutchinson"`` differentiates: the model's own loss,
  re-computed from the last micro-batch a forward pre-hook recorded, unless the user gave one with
  ``engine.topo_set_loss_closure(fn)``;
* the per-rank checkpoint file's content and the scalars written to DeepSpeed's monitor.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..config import ConfigError, Mode
from ..reducer.classes.classes import SYNC, layer_indices
from ..reducer.engine import AdapterTraits, Engine, EngineTensors, ParamReconcileSource
from ..reducer.kinds import Method

__all__ = ["DeepSpeedTopo", "STATE_FORMAT"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/deepspeed/v2"


def comm_device() -> torch.device:
    """The device DeepSpeed's communication backend reduces on (the CPU with gloo)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


class DeepSpeedTopo:
    """One per DeepSpeed engine (see the module docstring)."""

    def __init__(self, cfg, groups, stage: int, module: torch.nn.Module, *, island_dp: bool):
        self.cfg = cfg
        self.groups = groups
        self.stage = stage
        self.island_dp = island_dp
        """`selective` at ZeRO-1/2: DeepSpeed's data-parallel group is the island (mpu.py)."""
        self.engine_reduces = stage == 0
        """Gradients go through the DeepSpeed engine's buffered all-reduce (ZeRO-0, or ZeRO-1 with
        DeepSpeed's BF16_Optimizer) rather than through a ZeRO optimizer."""
        self.module = module
        # ZeRO-3 partitions parameters in place (p.numel() is then 0): ds_numel is the full size.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = dict(named)
        numels = [int(getattr(p, "ds_numel", p.numel())) for _, p in named]
        selective = cfg.mode == Mode.SELECTIVE
        tensors = EngineTensors(self.names, numels,
                                layers=layer_indices(self.names, model=module, layer_pattern=cfg.sync.layer_pattern),
                                params=self.params if selective else None)
        self.engine = Engine(cfg, groups, tensors, device=comm_device(), traits=AdapterTraits.fixed_layout())
        if cfg.adaptive.enabled:
            self.engine.enable_adaptive()
        self._clip_norm: torch.Tensor | float | None = None
        self.last_overflow = False
        self.last_local_overflow = False
        """This island's own overflow verdict before agreement (ZeRO-1/2 `selective`; tests and logs)."""
        self._seq: dict[str, int] = {}
        self._covers: dict[int, bool] = {}
        self._user_closure: Callable[[], torch.Tensor] | None = None
        self._last_batch: tuple[tuple, dict] | None = None
        self._hook = None
        if selective and cfg.importance.method == Method.HUTCHINSON:
            self._hook = module.register_forward_pre_hook(self._record_batch, with_kwargs=True)
            self.engine.set_loss_closure(self._loss)

    @property
    def last_clip_norm(self) -> float | None:
        """The latest agreed clip norm (tests and logs). The step keeps it a device tensor; it is
        read on the host here, when asked for, not in the step."""
        v = self._clip_norm
        return float(v.item()) if torch.is_tensor(v) else v

    @last_clip_norm.setter
    def last_clip_norm(self, value: torch.Tensor | float | None) -> None:
        self._clip_norm = value.detach() if torch.is_tensor(value) else value

    # ------------------------------------------------------------------ views of the engine

    @property
    def selective(self) -> bool:
        return self.engine.selective

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def steps(self) -> int:
        return self.engine.step

    @property
    def reconciles(self) -> int:
        return self.engine.reconciler.reconciles

    @property
    def class_version(self) -> int:
        return self.engine.class_version

    @property
    def sync(self) -> dict[str, bool]:
        """Name -> True for SYNC (all True outside `selective`)."""
        return {n: c == SYNC for n, c in self.engine.classes.items()}

    @property
    def wire(self):
        return self.engine.wire

    def sync_fraction(self) -> float:
        return self.engine.sync_fraction()

    # ------------------------------------------------------------------ DeepSpeed's anonymous buckets

    def key(self, stream: str) -> str:
        """``stream/n`` for the n-th bucket of ``stream`` in this step (error-feedback residual key)."""
        n = self._seq.get(stream, 0)
        self._seq[stream] = n + 1
        return f"{stream}/{n}"

    def covers_dp(self, group) -> bool:
        """Whether ``group`` is the data-parallel group the adapter's groups were planned for."""
        import torch.distributed as tdist

        k = id(group)
        if k not in self._covers:
            ranks = (tdist.get_process_group_ranks(group) if group is not None
                     else range(tdist.get_world_size()))
            self._covers[k] = tuple(sorted(ranks)) == tuple(sorted(self.groups.dp_ranks))
        return self._covers[k]

    # ------------------------------------------------------------------ hutchinson's loss closure

    def _record_batch(self, _module, args, kwargs):
        # References only: the closure re-runs the forward on the last micro-batch at the refresh.
        self._last_batch = (tuple(args), dict(kwargs))

    def set_user_closure(self, fn: Callable[[], torch.Tensor] | None) -> None:
        self._user_closure = fn

    def _loss(self) -> torch.Tensor:
        if self._user_closure is not None:
            return self._user_closure()
        if self._last_batch is None:
            raise ConfigError("topo_align: importance.method = 'hutchinson' (DeepSpeed adapter): no forward pass "
                              "was recorded before the class refresh; call engine.topo_set_loss_closure(fn) or use "
                              "importance.method 'fisher' / 'magnitude'")
        args, kwargs = self._last_batch
        out = self.module(*args, **kwargs)
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if torch.is_tensor(out) and out.is_floating_point():
            return out
        raise ConfigError(
            "topo_align: importance.method = 'hutchinson' (DeepSpeed adapter): the model's forward returned "
            f"{type(out).__name__}, not a floating-point loss tensor (or a tuple starting with one), so the loss "
            "cannot be re-computed at the class refresh; call engine.topo_set_loss_closure(fn) with a closure "
            "returning the loss, or use importance.method 'fisher' / 'magnitude'")

    # ------------------------------------------------------------------ the step

    def param_source(self, optimizer) -> ParamReconcileSource:
        """ZeRO-0: full parameters on every rank and the torch optimizer's state of their shape."""
        return ParamReconcileSource(self.params, optimizer)

    def after_step(self, source, optimizer) -> bool:
        """After every optimizer step (boundary): the engine's schedule; bucket keys restart."""
        self._seq.clear()
        return self.engine.after_step(source, optimizer)

    def monitor_events(self, x: int) -> list[tuple[str, float, int]]:
        """Scalars for DeepSpeed's monitor: bytes and seconds of the last step per tier and class."""
        st = self.engine.stats()
        events = []
        for what in ("bytes", "seconds"):
            for tier, per_cls in st["step"][what].items():
                for cls, v in per_cls.items():
                    if v:
                        events.append((f"TopoAlign/{tier}/{cls}/{what}", float(v), x))
        events.append(("TopoAlign/sync_fraction", float(st["sync_fraction"]), x))
        events.append(("TopoAlign/reconciles", float(st["reconciles"]), x))
        clip = self.last_clip_norm
        if clip is not None:
            events.append(("TopoAlign/clip_norm", clip, x))
        return events

    def stats(self) -> dict[str, Any]:
        out = self.engine.stats()
        out.update(stage=self.stage, steps=self.engine.step, plan_reason=self.groups.plan.reason,
                   last_clip_norm=self.last_clip_norm)
        return out

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """This rank's adapter state (residuals differ per rank): the engine's, plus the plan."""
        return {"format": STATE_FORMAT, "stage": self.stage, "engine": self.engine.state_dict(),
                "plan": self.groups.plan.dumps()}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            got = sd.get("format", sd.get("version")) if isinstance(sd, dict) else None
            raise ValueError(f"topo_align: the checkpoint's adapter state has format {got!r}; this DeepSpeed adapter "
                             f"reads {STATE_FORMAT!r} (a checkpoint of an older topo-align: resume it with that "
                             "version, or load with load_module_only=True)")
        self.engine.load_state_dict(sd["engine"])

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.engine.close()
