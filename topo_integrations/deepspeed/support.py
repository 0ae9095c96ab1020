"""Which DeepSpeed settings the adapter drives, checked before any engine is built.

Two kinds of refusal, both raised from ``topo_integrations.deepspeed.initialize`` before DeepSpeed
builds anything (a misconfigured job fails in its first seconds, not after loading a model onto a
thousand GPUs), each naming what is refused and what to use instead:

* combinations of DeepSpeed settings the adapter does not drive (:func:`check_supported`);
* ``topo_align`` keys the DeepSpeed adapter cannot honour: :data:`KEY_REFUSALS`, the one table of
  them. A key is refused only when the user set it (``TopoAlignConfig.explicit_keys()``); what
  happens to its default instead is documented in docs/deepspeed.md ("Keys").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import Mode

__all__ = ["UnsupportedConfigError", "check_supported", "check_keys", "zero_stage", "KEY_REFUSALS",
           "ds_communication_dtype"]


class UnsupportedConfigError(ValueError):
    """A DeepSpeed config + "topo_align" block combination the adapter does not drive."""


def zero_stage(ds: dict) -> int:
    z = ds.get("zero_optimization") or {}
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else 0


def _enabled(ds: dict, key: str) -> bool:
    block = ds.get(key)
    return isinstance(block, dict) and bool(block.get("enabled", False))


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                "bf16": "bf16", "bfloat16": "bf16"}


def ds_communication_dtype(ds: dict) -> str:
    """The dtype DeepSpeed reduces gradients in (``DeepSpeedEngine.communication_data_type``):
    ``communication_data_type`` when set, else fp16 / bf16 when enabled, else fp32."""
    comm = ds.get("communication_data_type")
    if isinstance(comm, str) and comm.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[comm.lower()]
    if _enabled(ds, "fp16"):
        return "fp16"
    if _enabled(ds, "bf16"):
        return "bf16"
    return "fp32"


@dataclass(frozen=True)
class KeyRefusal:
    key: str
    """Dotted ``topo_align`` key, refused only when the user set it."""
    applies: Callable[[dict, Any], bool]
    """(DeepSpeed config, TopoAlignConfig) -> whether the adapter cannot honour the key's value here."""
    why: Callable[[dict, Any], str]
    instead: Callable[[dict, Any], str]


def _island_dp(ds: dict, cfg) -> bool:
    return cfg.mode == Mode.SELECTIVE and zero_stage(ds) in (1, 2)


KEY_REFUSALS: tuple[KeyRefusal, ...] = (
    KeyRefusal(
        "communication.bucket_size_mb", lambda ds, cfg: cfg.communication.bucket_size_mb != "auto",
        lambda ds, cfg: "DeepSpeed builds and owns the gradient buckets the adapter reduces",
        lambda ds, cfg: "set zero_optimization.reduce_bucket_size (elements) in the DeepSpeed config instead"),
    KeyRefusal(
        "communication.overlap", lambda ds, cfg: True,
        lambda ds, cfg: "DeepSpeed decides when its buckets are reduced during backward",
        lambda ds, cfg: "set zero_optimization.overlap_comm in the DeepSpeed config instead"),
    KeyRefusal(
        "local.dtype", lambda ds, cfg: _island_dp(ds, cfg) and cfg.local.dtype != ds_communication_dtype(ds),
        lambda ds, cfg: ("at ZeRO-1/2 `selective` DeepSpeed reduces the LOCAL gradients inside the island itself, "
                         f"in its communication dtype ({ds_communication_dtype(ds)})"),
        lambda ds, cfg: (f"remove local.dtype (or set it to '{ds_communication_dtype(ds)}'), or set DeepSpeed's "
                         f"communication_data_type to '{cfg.local.dtype}'")),
    KeyRefusal(
        "topology.middle_level", lambda ds, cfg: cfg.topology.middle_level and zero_stage(ds) == 3,
        lambda ds, cfg: "the adapter's ZeRO-3 reduce-scatter has two levels (island, rail)",
        lambda ds, cfg: "remove topology.middle_level, or use ZeRO stage 0-2 for three levels"),
)
"""Every ``topo_align`` key the DeepSpeed adapter refuses, and when (docs/deepspeed.md, "Keys")."""


def check_keys(ds: dict, cfg) -> None:
    """Raise :class:`UnsupportedConfigError` for the first key of :data:`KEY_REFUSALS` the user set
    and the adapter cannot honour in this configuration."""
    if cfg.mode == Mode.FLAT or not cfg.enabled:
        return
    explicit = cfg.explicit_keys()
    for r in KEY_REFUSALS:
        if r.key in explicit and r.applies(ds, cfg):
            value = cfg
            for part in r.key.split("."):
                value = getattr(value, part)
            raise UnsupportedConfigError(
                f"topo_align.{r.key} = {value!r} is not supported by the DeepSpeed adapter "
                f"(mode {cfg.mode!r}, ZeRO stage {zero_stage(ds)}): {r.why(ds, cfg)}; {r.instead(ds, cfg)}")


def check_supported(ds: dict, cfg, *, model: Any = None, mpu: Any = None) -> None:
    """Raise :class:`UnsupportedConfigError` for a combination the adapter does not drive, then for a
    refused key (:func:`check_keys`)."""
    mode = cfg.mode
    stage = zero_stage(ds)
    zero = ds.get("zero_optimization") or {}
    fp16, bf16 = _enabled(ds, "fp16"), _enabled(ds, "bf16")
    where = f"topo_align.mode = {mode!r} with zero_optimization.stage = {stage}"

    def refuse(what: str, instead: str) -> None:
        raise UnsupportedConfigError(f"{where}: {what} is not supported; {instead}")

    if mode == Mode.FLAT:
        return
    if int(ds.get("sequence_parallel_size", 1) or 1) > 1:
        refuse("sequence_parallel_size > 1 (the data-parallel group then mixes sequence ranks)",
               "use topo_align.mode 'flat' or remove sequence parallelism")
    if stage == 3:
        if mode == Mode.SELECTIVE:
            refuse("selective at ZeRO-3 (parameters are partitioned over the whole data-parallel group, "
                   "so island replicas cannot drift and be reconciled)",
                   "use mode 'hierarchical' with ZeRO-3, or ZeRO stage 1 or 2 for 'selective'"
                   + (" (method 'auto' chooses among settings of mode 'selective': remove it at ZeRO-3)"
                      if cfg.method == "auto" else ""))
        if zero.get("zero_quantized_gradients"):
            refuse("zero_quantized_gradients (qgZ replaces the gradient reduce-scatter)",
                   "set zero_quantized_gradients to false, or use topo_align.mode 'flat'")
        if zero.get("reduce_scatter") is False:
            refuse("ZeRO-3 with reduce_scatter = false (a direct all-reduce the adapter does not intercept)",
                   "remove zero_optimization.reduce_scatter or set it to true")
    if mode == Mode.SELECTIVE:
        if mpu is not None:
            refuse("an mpu (tensor/pipeline model parallelism) with selective",
                   "use mode 'hierarchical' with model parallelism, or the Megatron adapter")
        if model is not None and type(model).__name__ == "PipelineModule":
            refuse("pipeline parallelism (PipelineModule) with selective", "use mode 'hierarchical'")
        if stage == 0 and (fp16 or bf16):
            refuse("selective at ZeRO-0 with fp16/bf16 (the mixed-precision wrapper keeps its own fp32 "
                   "masters per rank)", "use ZeRO stage 1 or 2 for selective with fp16/bf16, or fp32 at ZeRO-0")
        if stage == 1 and bf16 and (ds.get("data_types") or {}).get("grad_accum_dtype") == "fp32":
            refuse("selective at ZeRO-1 with bf16 and data_types.grad_accum_dtype = 'fp32' (DeepSpeed then "
                   "uses BF16_Optimizer, not the ZeRO optimizer)",
                   "use ZeRO stage 2, or drop data_types.grad_accum_dtype")
        if stage in (1, 2) and (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
            refuse("selective with offload_optimizer", "use mode 'hierarchical' with optimizer offload")
        if model is not None and any(getattr(p, "allreduce", True) is False for p in model.parameters()):
            refuse("selective with MoE expert parameters", "use mode 'hierarchical' for MoE models")
    check_keys(ds, cfg)
