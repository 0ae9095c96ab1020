"""Defaults for the compute time per step when the command line does not give it (docs/costmodel.md,
"Compute per step").

compute per step = 6 * params * tokens per step / (GPUs * MFU * peak FLOP/s per GPU). Each missing
input gets a documented default, and every default used is recorded on the workload, so the output
says what was assumed:

* peak FLOP/s: from the GPU kind (``--gpu``, else the topology file's ``"gpu"`` key): dense BF16
  tensor-core peak of the SXM part, from NVIDIA's data sheets (V100: FP16, it has no BF16);
* MFU: :data:`DEFAULT_MFU` (0.4, a well-tuned large dense-transformer run);
* tokens per step: global batch x sequence length of the Megatron arguments, or the DeepSpeed
  config's ``train_batch_size`` x ``--seq-length`` (default 2048), else :data:`DEFAULT_TOKENS_PER_STEP`
  (1536 sequences x 2048 tokens, GPT-3 175B's batch).
"""

from __future__ import annotations

from dataclasses import replace

from .model import SimError

__all__ = ["GPU_PEAK_TFLOPS", "DEFAULT_MFU", "DEFAULT_SEQ_LENGTH", "DEFAULT_GLOBAL_BATCH",
           "DEFAULT_TOKENS_PER_STEP", "gpu_peak_tflops", "with_compute_defaults"]

GPU_PEAK_TFLOPS: dict[str, float] = {
    "V100": 125.0,   # FP16 tensor core (no BF16)
    "A100": 312.0,
    "H100": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
}
"""Dense BF16 tensor-core peak per GPU, TFLOP/s (SXM parts)."""

DEFAULT_MFU = 0.4
DEFAULT_SEQ_LENGTH = 2048
DEFAULT_GLOBAL_BATCH = 1536
DEFAULT_TOKENS_PER_STEP = float(DEFAULT_GLOBAL_BATCH * DEFAULT_SEQ_LENGTH)


def gpu_peak_tflops(kind: str) -> tuple[str, float]:
    """``(canonical kind, peak TFLOP/s)`` for a GPU kind such as ``"A100"``, ``"a100-sxm4-80gb"`` or
    ``"NVIDIA H100 80GB HBM3"`` (case-insensitive; the first known kind named in it)."""
    text = str(kind).upper().replace("NVIDIA", " ")
    for sep in "-_/":
        text = text.replace(sep, " ")
    for word in text.split():
        for known, peak in GPU_PEAK_TFLOPS.items():
            if word.startswith(known):
                return known, peak
    raise SimError(f"GPU kind {kind!r} is unknown; expected one of {', '.join(GPU_PEAK_TFLOPS)} "
                   "(or give --peak-tflops, or --compute-s)")


def with_compute_defaults(wl, gpu: str | None, *, gpu_from: str = "--gpu"):
    """``wl`` (a :class:`~topo_integrations.sim.workload.Workload`) with the missing compute inputs
    filled from the defaults above; unchanged when ``compute_s`` is given. ``gpu_from`` says where
    ``gpu`` came from, for the record of what was assumed."""
    if wl.compute_s is not None:
        return wl
    kw: dict = {}
    assumed = list(wl.assumed)
    if wl.peak_tflops is None:
        if not gpu:
            raise SimError("compute per step is unknown: the topology names no GPU kind (its \"gpu\" key); give "
                           f"--gpu KIND ({', '.join(GPU_PEAK_TFLOPS)}), or --peak-tflops, or --compute-s")
        known, peak = gpu_peak_tflops(gpu)
        kw["peak_tflops"] = peak
        assumed.append(f"peak {peak:g} TFLOP/s per GPU ({known} dense BF16, GPU kind from {gpu_from})")
    if wl.mfu is None:
        kw["mfu"] = DEFAULT_MFU
        assumed.append(f"MFU {DEFAULT_MFU:g} (default; --mfu)")
    if wl.tokens_per_step is None:
        kw["tokens_per_step"] = DEFAULT_TOKENS_PER_STEP
        assumed.append(f"{DEFAULT_TOKENS_PER_STEP:.0f} tokens per step (default: {DEFAULT_GLOBAL_BATCH} x "
                       f"{DEFAULT_SEQ_LENGTH}; --tokens-per-step)")
    return replace(wl, assumed=tuple(assumed), **kw)
