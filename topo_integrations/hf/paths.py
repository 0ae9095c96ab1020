"""Which path a prepared ``accelerate.Accelerator`` takes, and whether topo-align can act on it.

:func:`decide` reads only the accelerator's state (``distributed_type``, its plugins, the FP8
backend, the DDP handler's comm hook, the parallelism config) and returns a :class:`Decision`: the
path's name, whether topo-align acts on it, and why not when it does not. The refusals are here, in
one table (``CANNOT``), so that docs/hf.md and the tests quote the same words. Pure: no process
group, no framework import beyond reading enum values by name, so it is tested on stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Decision", "decide", "ds_block", "CANNOT", "MULTI_TYPES"]

MULTI_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
               "MULTI_HPU", "MULTI_NEURON")
"""Accelerate's ``DistributedType`` values that wrap the model in ``DistributedDataParallel``."""

CANNOT = {
    "fsdp1": "FSDP1 (FullyShardedDataParallel) reduces flat parameters inside its own handles and offers no "
             "hook for the cross-island step; set fsdp_version: 2 (the FSDP2 adapter) to use topo-align",
    "msamp": "MS-AMP (fp8_backend MSAMP) casts gradients to FP8 and builds its own optimizer and engine "
             "(msamp.initialize / msamp.deepspeed.initialize), which topo-align does not drive",
    "megatron": "Accelerate's Megatron-LM plugin builds Megatron's own DistributedDataParallel; run "
                "Megatron through its adapter instead (python -m topo_integrations.megatron, docs/megatron.md)",
    "xla": "TorchXLA reduces gradients inside the XLA graph (xm.all_reduce); there is no bucket to hand over",
    "comm_hook": "a DDP comm hook of your own is set (DistributedDataParallelKwargs(comm_hook=...)); DDP takes "
                 "one hook, so yours stays and topo-align's is not registered",
    "parallelism": "a ParallelismConfig with tensor, context or replicate dimensions shards the model on "
                   "accelerate's own device mesh; topo-align shards FSDP2 on the islands and drives plain "
                   "data parallelism only",
    "one_process": "one process: there is nothing to reduce",
    "no_config": "no topo_align config was given (install(config=...) or TOPO_ALIGN_CONFIG=FILE)",
    "no_block": "the DeepSpeed config has no \"topo_align\" block and install() was given none",
    "disabled": "the topo_align block says enabled: false; the framework reduces gradients itself",
}
"""Why topo-align does not act on a path: the reason quoted in the warning line at ``prepare()``."""


@dataclass(frozen=True)
class Decision:
    path: str
    """What Accelerate does: "DeepSpeed", "DDP (MULTI_CPU)", "FSDP2", "FSDP1", "Megatron-LM", ..."""
    kind: str
    """"deepspeed", "ddp", "fsdp2" where topo-align acts; otherwise the key of :data:`CANNOT`."""
    act: bool

    @property
    def why(self) -> str:
        return "" if self.act else CANNOT[self.kind]


def _name(value: Any) -> str:
    """An enum member's value (``DistributedType.MULTI_CPU`` -> "MULTI_CPU"), or the string itself."""
    return str(getattr(value, "value", value))


def _fp8(accelerator) -> str:
    try:
        return _name(accelerator.fp8_backend)
    except Exception:  # noqa: BLE001 - an accelerator without FP8 support has no backend
        return "NO"


def ds_block(accelerator) -> bool:
    """The DeepSpeed config of ``accelerator`` holds a "topo_align" block of its own."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    ds = getattr(plugin, "deepspeed_config", None)
    return isinstance(ds, dict) and "topo_align" in ds


def decide(accelerator, cfg) -> Decision:
    """The path ``accelerator`` takes and whether topo-align acts on it. ``cfg``: the block
    ``install()`` got (a ``TopoAlignConfig``) or None; on the DeepSpeed path the DeepSpeed config's
    own block comes first."""
    kind = _name(accelerator.distributed_type)
    state = accelerator.state
    msamp = _fp8(accelerator) == "MSAMP"
    if kind == "DEEPSPEED":
        if msamp:
            return Decision("DeepSpeed", "msamp", False)
        own = ds_block(accelerator)
        if not own and cfg is None:
            return Decision("DeepSpeed", "no_block", False)
        return _enabled(Decision("DeepSpeed", "deepspeed", True), cfg, own)
    if kind == "MEGATRON_LM":
        return Decision("Megatron-LM", "megatron", False)
    if kind == "XLA":
        return Decision("XLA", "xla", False)
    pc = getattr(state, "parallelism_config", None)
    extra_dims = pc is not None and any(getattr(pc, f, False) for f in ("tp_enabled", "cp_enabled",
                                                                         "dp_replicate_enabled"))
    if kind == "FSDP":
        version = getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1)
        if version != 2:
            return Decision("FSDP1", "fsdp1", False)
        if msamp:
            return Decision("FSDP2", "msamp", False)
        if extra_dims:
            return Decision("FSDP2", "parallelism", False)
        return _enabled(Decision("FSDP2", "fsdp2", True), cfg)
    if kind in MULTI_TYPES:
        path = f"DDP ({kind})"
        if msamp:
            return Decision(path, "msamp", False)
        if extra_dims:
            return Decision(path, "parallelism", False)
        hook = getattr(getattr(accelerator, "ddp_handler", None), "comm_hook", None)
        if hook is not None and _name(hook).lower() != "no":
            return Decision(path, "comm_hook", False)
        return _enabled(Decision(path, "ddp", True), cfg)
    return Decision("one process" if kind == "NO" else kind, "one_process", False)


def _enabled(d: Decision, cfg, own_block: bool = False) -> Decision:
    if own_block:  # the DeepSpeed adapter reads and logs its own block (enabled: false, mode: flat)
        return d
    if cfg is None:
        return Decision(d.path, "no_config", False)
    if not cfg.enabled:
        return Decision(d.path, "disabled", False)
    return d
