"""Which Megatron-LM versions `install()` and the CPU layer patch, and the check that refuses others.

`install()` (megatron_lm.py) and `cpu_compat.apply_training` rebind a few functions of Megatron-LM's
training code (the "seams", docs/megatron.md). Megatron-LM's training code has no version number of
its own; a seam whose signature changed would be wrapped with wrong assumptions (e.g. which positional
argument is the model), so before patching, every seam is looked up and its parameter names are
compared with the ones this adapter was written against (as the DeepSpeed adapter does,
deepspeed/compat.py). A mismatch is refused with a message naming the seam, what was expected, what
was found and the supported versions.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

__all__ = ["MegatronLMVersionError", "Seam", "INSTALL_SEAMS", "CPU_SEAMS", "SUPPORTED", "check_seams"]

SUPPORTED = "Megatron-LM tag core_v0.16.1 (megatron-core 0.16.x)"


class MegatronLMVersionError(RuntimeError):
    """A seam of Megatron-LM's training code is missing or has another signature."""


@dataclass(frozen=True)
class Seam:
    module: str
    qualname: str
    params: tuple[str, ...]
    """Parameter names the wrapper relies on, in order (the leading ones it reads positionally)."""
    why: str
    exact: bool = False
    """Compare the whole signature, not only the leading names."""


INSTALL_SEAMS: tuple[Seam, ...] = (
    Seam("megatron.training.arguments", "add_megatron_arguments", ("parser",), "the --topo-align* flags", exact=True),
    Seam("megatron.training.training", "get_model", ("model_provider_func", "model_type", "wrap_with_ddp"),
         "building the model with TopoAlignDDP (it reads the module globals DDP and DistributedDataParallelConfig)"),
    Seam("megatron.training.training", "DDP", (), "building the model with TopoAlignDDP"),
    Seam("megatron.training.training", "DistributedDataParallelConfig", (), "the DDP config carrying topo_align"),
    Seam("megatron.training.initialize", "_initialize_distributed",
         ("get_embedding_ranks", "get_position_embedding_ranks", "store"),
         "deriving --num-distributed-optimizer-instances from the topology", exact=True),
    Seam("megatron.training.training", "get_megatron_optimizer", ("config", "model_chunks"),
         "global gradient statistics and the reconciliation schedule"),
    Seam("megatron.training.training", "save_checkpoint", ("iteration", "model", "optimizer"),
         "reconciling before a save and saving the plugin state"),
    Seam("megatron.training.training", "load_checkpoint", ("ddp_model", "optimizer"), "restoring the plugin state"),
)

CPU_SEAMS: tuple[Seam, ...] = (
    Seam("megatron.training.training", "initialize_megatron",
         ("extra_args_provider", "args_defaults", "ignore_unknown_args", "allow_no_cuda"),
         "running initialize_megatron on CPU (allow_no_cuda)"),
    Seam("megatron.core.datasets.utils", "compile_helpers", (), "skipping the dataset helpers' make", exact=True),
    Seam("megatron.legacy.fused_kernels", "load", ("args",), "skipping the fused kernels' nvcc", exact=True),
)


def _resolve(seam: Seam):
    obj = importlib.import_module(seam.module)
    for part in seam.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_seams(seams: tuple[Seam, ...]) -> None:
    """Raise :class:`MegatronLMVersionError` unless every seam exists with the expected parameters.

    Wrappers this project installed are looked through (``functools.wraps``), so a second check
    after patching sees Megatron-LM's own signatures.
    """
    for seam in seams:
        where = f"{seam.module}.{seam.qualname}"
        try:
            fn = _resolve(seam)
        except (ImportError, AttributeError):
            raise MegatronLMVersionError(
                f"topo-align: this Megatron-LM has no {where} (needed for {seam.why}); supported: {SUPPORTED}"
            ) from None
        if not seam.params and not seam.exact:
            continue  # a name that must exist (a class the patched function looks up)
        fn = inspect.unwrap(fn)
        got = tuple(inspect.signature(fn).parameters)
        ok = got == seam.params if seam.exact else got[:len(seam.params)] == seam.params
        if not ok:
            raise MegatronLMVersionError(
                f"topo-align: Megatron-LM's {where}{inspect.signature(fn)} does not match the signature "
                f"topo-align was written for ({', '.join(seam.params)}{'' if seam.exact else ', ...'}), needed for "
                f"{seam.why}; refusing to patch it. Supported: {SUPPORTED}")
