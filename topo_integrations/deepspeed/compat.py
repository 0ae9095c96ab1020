"""Which DeepSpeed versions the adapter drives, and the check that refuses any other.

The adapter overrides a handful of DeepSpeed methods (the "seams", docs/deepspeed.md). A
seam whose signature changed between releases would be called with the wrong arguments and could
reduce gradients silently wrong, so before the first engine is patched every seam is looked up and
its parameter names compared with the ones the adapter was written against. A mismatch is refused
with a message naming the method, what was expected and what was found.

The CPU accelerator also JIT-compiles ``deepspeed_shm_comm`` (25-40 s) in every process that calls
``deepspeed.init_distributed``; the op only serves ``inference_all_reduce`` (AutoTP inference), never
training, so :func:`skip_shm_comm_build` turns it off (docs/deepspeed.md).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass

__all__ = [
    "DeepSpeedVersionError",
    "SUPPORTED_RANGE",
    "SEAMS",
    "check_deepspeed",
    "deepspeed_version",
    "skip_shm_comm_build",
]

# The releases whose seams were read; 0.19.8 is what CI runs (constraints.txt).
SUPPORTED_RANGE = ((0, 17, 0), (0, 20, 0))


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed is outside the supported range, or a seam's signature changed."""


@dataclass(frozen=True)
class Seam:
    module: str
    qualname: str
    params: tuple[str, ...]
    """Parameter names (``self`` included) the override relies on, in order."""
    why: str


SEAMS: tuple[Seam, ...] = (
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.allreduce_bucket",
         ("self", "bucket", "dp_group", "dp_world_size"), "ZeRO-0 hierarchical reduction"),
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.buffered_allreduce_fallback",
         ("self", "grads", "elements_per_buffer"), "ZeRO-0 selective routing"),
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.clip_fp32_gradients", ("self",),
         "ZeRO-0 clip-norm agreement"),
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.step", ("self", "lr_kwargs"), "reconciliation schedule"),
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint",
         ("self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"),
         "checkpoint hooks"),
    Seam("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint",
         ("self", "load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states",
          "load_module_only", "custom_load_fn"), "checkpoint hooks"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.allreduce_bucket",
         ("self", "bucket", "communication_data_type", "rank", "log", "divide", "process_group"),
         "ZeRO-1/2 hierarchical reduction"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.gradient_reduction_w_predivide",
         ("self", "tensor", "communication_data_type"), "ZeRO-1/2 hierarchical reduction (reduce_scatter=false)"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.step", ("self", "closure"),
         "ZeRO-1/2 selective SYNC reduction"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.reduce_ipg_grads", ("self", "comm_dtype"),
         "ZeRO-1/2 selective: SYNC rail reduction issued as buckets finish"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.scaled_global_norm",
         ("self", "norm_type"), "ZeRO-1/2 selective clip-norm agreement"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow",
         ("self", "partition_gradients"), "ZeRO-1/2 selective overflow agreement"),
    Seam("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_lp_params", ("self",),
         "ZeRO-1/2 selective reconciliation"),
    Seam("deepspeed.runtime.zero.stage3",
         "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
         ("self", "params_to_reduce", "communication_data_type"), "ZeRO-3 hierarchical reduce-scatter"),
    Seam("deepspeed.runtime.comm.coalesced_collectives", "reduce_scatter_coalesced", ("tensors", "group"),
         "ZeRO-3 hierarchical reduce-scatter"),
)


def deepspeed_version() -> tuple[int, int, int]:
    import deepspeed

    parts = []
    for p in deepspeed.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def _resolve(seam: Seam):
    obj = importlib.import_module(seam.module)
    for part in seam.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _unwrap(fn):
    """Follow ``functools.wraps`` and DeepSpeed's ``instrument_w_nvtx`` (a closure over ``func``)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_freevars == ("func",) and fn.__closure__:
        inner = fn.__closure__[0].cell_contents
        if callable(inner):
            return _unwrap(inner)
    return fn


def check_deepspeed(*, seams: tuple[Seam, ...] = SEAMS) -> str:
    """Raise :class:`DeepSpeedVersionError` unless every seam exists with the expected signature.

    Returns the DeepSpeed version string. Called once per process before the first engine is patched.
    """
    import deepspeed

    version = deepspeed_version()
    lo, hi = SUPPORTED_RANGE
    fmt = lambda v: ".".join(map(str, v))  # noqa: E731
    if not (lo <= version < hi):
        raise DeepSpeedVersionError(
            f"topo-align: DeepSpeed {deepspeed.__version__} is not supported; the DeepSpeed adapter drives "
            f">={fmt(lo)},<{fmt(hi)} (tested: 0.19.8). Install deepspeed==0.19.8, or remove the \"topo_align\" "
            "block (or set \"enabled\": false) to run stock DeepSpeed"
        )
    for seam in seams:
        where = f"{seam.module}.{seam.qualname}"
        try:
            fn = _resolve(seam)
        except (ImportError, AttributeError):
            raise DeepSpeedVersionError(
                f"topo-align: DeepSpeed {deepspeed.__version__} has no {where} (needed for {seam.why}); "
                "this DeepSpeed is not supported, install deepspeed==0.19.8"
            ) from None
        fn = _unwrap(fn)
        got = tuple(inspect.signature(fn).parameters)
        if got != seam.params:
            raise DeepSpeedVersionError(
                f"topo-align: DeepSpeed {deepspeed.__version__}: {where}{inspect.signature(fn)} does not match the "
                f"signature the adapter was written for ({', '.join(seam.params)}), needed for {seam.why}; "
                "refusing to patch it. Install deepspeed==0.19.8"
            )
    return deepspeed.__version__


def skip_shm_comm_build() -> bool:
    """Stop DeepSpeed from JIT-compiling ``deepspeed_shm_comm`` on the CPU accelerator.

    ``deepspeed.comm.torch.build_shm_op`` consults the cached ``deepspeed.ops.__compatible_ops__``
    dict before building; marking the op incompatible makes it return None, and the only user of the
    op (``inference_all_reduce``) falls back to ``torch.distributed.all_reduce``. Set
    ``TOPO_ALIGN_DS_SHM_COMM=1`` to keep DeepSpeed's behaviour. Returns True when the build is skipped.
    """
    if os.environ.get("TOPO_ALIGN_DS_SHM_COMM") == "1":
        return False
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    # Editing the cached dict persists: build_shm_op reads it at every TorchBackend construction.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True
