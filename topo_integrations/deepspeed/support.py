"""Which DeepSpeed settings the adapter drives, checked before any engine is built.

Each refusal names the combination and says what to use instead; they are raised from
``topo_integrations.deepspeed.initialize`` before DeepSpeed builds anything, so a misconfigured job
fails in its first seconds, not after loading a model onto a thousand GPUs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnsupportedConfigError", "check_supported", "zero_stage"]


class UnsupportedConfigError(ValueError):
    """A DeepSpeed config + "topo_align" block combination the adapter does not drive."""


def zero_stage(ds: dict) -> int:
    z = ds.get("zero_optimization") or {}
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else 0


def _enabled(ds: dict, key: str) -> bool:
    block = ds.get(key)
    return isinstance(block, dict) and bool(block.get("enabled", False))


def check_supported(ds: dict, cfg, *, model: Any = None, mpu: Any = None) -> None:
    """Raise :class:`UnsupportedConfigError` for a combination the adapter does not drive."""
    mode = cfg.mode
    stage = zero_stage(ds)
    zero = ds.get("zero_optimization") or {}
    fp16, bf16 = _enabled(ds, "fp16"), _enabled(ds, "bf16")
    where = f"topo_align.mode = {mode!r} with zero_optimization.stage = {stage}"

    def refuse(what: str, instead: str) -> None:
        raise UnsupportedConfigError(f"{where}: {what} is not supported; {instead}")

    if mode == "flat":
        return
    if int(ds.get("sequence_parallel_size", 1) or 1) > 1:
        refuse("sequence_parallel_size > 1 (the data-parallel group then mixes sequence ranks)",
               "use topo_align.mode 'flat' or remove sequence parallelism")
    if stage == 3:
        if mode == "selective":
            refuse("selective at ZeRO-3 (parameters are partitioned over the whole data-parallel group, "
                   "so island replicas cannot drift and be reconciled)",
                   "use mode 'hierarchical' with ZeRO-3, or ZeRO stage 1 or 2 for 'selective'")
        if zero.get("zero_quantized_gradients"):
            refuse("zero_quantized_gradients (qgZ replaces the gradient reduce-scatter)",
                   "set zero_quantized_gradients to false, or use topo_align.mode 'flat'")
        if zero.get("reduce_scatter") is False:
            refuse("ZeRO-3 with reduce_scatter = false (a direct all-reduce the adapter does not intercept)",
                   "remove zero_optimization.reduce_scatter or set it to true")
    if mode == "selective":
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
        if cfg.importance.method == "hutchinson":
            refuse("importance.method 'hutchinson' in the DeepSpeed adapter (it needs a loss closure "
                   "DeepSpeed's engine does not expose)", "use importance.method 'fisher' or 'magnitude'")
        if model is not None and any(getattr(p, "allreduce", True) is False for p in model.parameters()):
            refuse("selective with MoE expert parameters", "use mode 'hierarchical' for MoE models")
    if cfg.adaptive.enabled:
        refuse("adaptive.enabled = true in the DeepSpeed adapter", "set adaptive.enabled to false")
