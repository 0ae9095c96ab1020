"""Which Megatron versions the adapter drives, and the checks that refuse others.

Two kinds of seams (docs/megatron.md, "Version gate"):

* Megatron-LM's training code: `install()` (megatron_lm.py) and `cpu_compat.apply_training` rebind a
  few of its functions (`INSTALL_SEAMS`, `CPU_SEAMS`). It has no version number of its own; a seam
  whose signature changed would be wrapped with wrong assumptions (e.g. which positional argument is
  the model), so before patching every seam is looked up and its parameter names are compared with
  the ones this adapter was written against (as the DeepSpeed adapter does, deepspeed/compat.py).
* megatron-core: `TopoAlignDDP` swaps Megatron's bucket groups to a subclass of the private
  ``_ParamAndGradBucketGroup``, replaces its ``start_grad_sync``/``finish_grad_sync`` and reads
  attributes of the DDP, its buffers, buckets and optimizers that are no public API (`CORE_SEAMS`:
  classes and methods, checked before anything is built; `CORE_BUILT`: attributes that exist only on
  built objects, checked on them before the swap; `OPTIMIZER_BUILT`: on the optimizers
  `prepare_optimizer` wraps). `check_core` also refuses a megatron-core outside `CORE_RANGE`, the one
  place the supported range is written (setup.py reads it from this file).

A mismatch is refused with one message naming the seam, what was expected, what was found, the
installed megatron-core and the supported range.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

__all__ = ["MegatronLMVersionError", "Seam", "Built", "INSTALL_SEAMS", "CPU_SEAMS", "CORE_SEAMS", "CPU_CORE_SEAMS",
           "CORE_BUILT", "OPTIMIZER_BUILT", "CORE_RANGE", "CORE_TESTED", "SUPPORTED", "check_seams", "check_core",
           "check_built", "core_version"]

# The megatron-core releases whose seams were read; setup.py's `megatron` extra is built from this
# line (a literal, parsed there without importing the package) and constraints.txt pins CORE_TESTED,
# what the suite runs. Widen it only after running the suite on the new release.
CORE_RANGE = ((0, 16, 1), (0, 17, 0))
CORE_TESTED = "0.16.1"


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


SUPPORTED = (f"Megatron-LM tag core_v{CORE_TESTED} (megatron-core >={_fmt(CORE_RANGE[0])},<{_fmt(CORE_RANGE[1])}, "
             f"tested: {CORE_TESTED})")


class MegatronLMVersionError(RuntimeError):
    """A seam of Megatron-LM's training code or of megatron-core is missing or has another signature,
    or megatron-core is outside the supported range."""


@dataclass(frozen=True)
class Seam:
    module: str
    qualname: str
    params: tuple[str, ...]
    """Parameter names the wrapper relies on, in order (the leading ones it reads positionally)."""
    why: str
    exact: bool = False
    """Compare the whole signature, not only the leading names."""


@dataclass(frozen=True)
class Built:
    """Attributes megatron-core sets in ``__init__`` (invisible on the class), checked on built objects."""

    kind: str
    """What the object is, as megatron-core names it (e.g. ``_ParamAndGradBucketGroup``)."""
    attrs: tuple[str, ...]
    why: str


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
    # cpu_compat._patch_distopt_checkpoint (resuming the distributed optimizer on CPU)
    Seam("megatron.core.optimizer.distrib_optimizer", "HAVE_APEX_OR_TE", (), "the CPU resume of the distributed "
         "optimizer (torch's Adam only)"),
    Seam("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict", ("self",),
         "the CPU resume of the distributed optimizer", exact=True),
    Seam("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict", ("self", "state_dict"),
         "the CPU resume of the distributed optimizer", exact=True),
    Seam("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._set_main_param_and_optimizer_states",
         ("self",), "the CPU resume of the distributed optimizer (fp32 main shards loaded under no_grad)"),
)

_PGB = "megatron.core.distributed.param_and_grad_buffer"
_OPT = "megatron.core.optimizer.optimizer"
_DOPT = "megatron.core.optimizer.distrib_optimizer"
_CLIP = "megatron.core.optimizer.clip_grads"
_DDP_FIELDS = ("use_distributed_optimizer", "overlap_grad_reduce", "num_distributed_optimizer_instances",
               "grad_reduce_in_fp32", "bucket_size", "check_for_nan_in_grad", "check_for_large_grads",
               "average_in_collective", "reduce_scatter_with_fp32_accumulation")

CORE_SEAMS: tuple[Seam, ...] = (
    Seam(_PGB, "_ParamAndGradBucketGroup", (), "TopoBucketGroup, the class Megatron's bucket groups are swapped to"),
    Seam(_PGB, "_ParamAndGradBucketGroup.start_grad_sync", ("self", "force_all_reduce"),
         "replacing the bucket group's gradient reduction", exact=True),
    Seam(_PGB, "_ParamAndGradBucketGroup.finish_grad_sync", ("self", "force_all_reduce"),
         "replacing the bucket group's gradient reduction", exact=True),
    Seam(_PGB, "_ParamAndGradBucketGroup.register_grad_ready", ("self", "param", "force_all_reduce"),
         "Megatron's backward hooks starting the replaced start_grad_sync", exact=True),
    Seam(_PGB, "_ParamAndGradBucketGroup.check_grads", ("self", "check_for_nan_or_inf", "check_for_large"),
         "the NaN / large-gradient check before the reduction", exact=True),
    Seam(_PGB, "_ParamAndGradBucketGroup.start_param_sync", ("self", "force_sync"),
         "re-gathering parameters after a reconciliation (distributed optimizer)"),
    Seam(_PGB, "shard_buffer", ("buffer", "data_parallel_world_size"),
         "this rank's shard of a bucket (distributed optimizer)", exact=True),
    Seam("megatron.core.distributed", "DistributedDataParallel.__init__",
         ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection"),
         "TopoAlignDDP, a subclass with the same constructor", exact=True),
    *(Seam("megatron.core.distributed", f"DistributedDataParallelConfig.{f}", (), "the DDP settings the adapter "
           "honours or refuses") for f in _DDP_FIELDS),
    Seam(_DOPT, "DistributedOptimizer", (), "finding the main shards and their moments (reconciliation)"),
    Seam(_DOPT, "DistributedOptimizer._copy_main_params_to_model_params", ("self",),
         "writing reconciled main shards back to the model", exact=True),
    Seam(_OPT, "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params", ("self",),
         "writing reconciled main parameters back to the model", exact=True),
    Seam(_OPT, "FP32Optimizer", (), "reconciliation with fp32 parameters"),
    Seam(_OPT, "MegatronOptimizer.get_grad_stats_parallel_group", ("self",), "global gradient statistics",
         exact=True),
    Seam(_OPT, "MegatronOptimizer.get_main_grads_for_grad_norm", ("self",), "global gradient statistics",
         exact=True),
    Seam(_OPT, "MegatronOptimizer.get_parameters", ("self",), "global gradient statistics", exact=True),
    Seam(_OPT, "MegatronOptimizer.get_grad_norm", ("self",), "replacing the clipping norm", exact=True),
    Seam(_OPT, "MegatronOptimizer.clip_grad_norm", ("self", "clip_grad"), "replacing the clipping norm", exact=True),
    Seam(_CLIP, "get_grad_norm_fp32", ("grads_for_norm", "norm_type", "grad_stats_parallel_group"),
         "the clipping norm"),
    Seam(_CLIP, "clip_grad_by_total_norm_fp32", ("parameters", "max_norm", "total_norm", "use_decoupled_grad"),
         "clipping by the global norm"),
)

CPU_CORE_SEAMS: tuple[Seam, ...] = (
    Seam("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", ("self", "name", "seed"),
         "the CPU RNG tracker (cpu_compat)", exact=True),
    Seam("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork", ("self", "name"),
         "the CPU RNG tracker (cpu_compat)", exact=True),
    Seam("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER", (), "the CPU RNG tracker (cpu_compat)"),
    Seam("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED", (),
         "the CPU RNG tracker (cpu_compat)"),
)

CORE_BUILT: dict[str, Built] = {
    "ddp": Built("DistributedDataParallel", ("module", "config", "ddp_config", "dp_cp_group", "intra_dp_cp_group",
                                             "expt_dp_group", "intra_expt_dp_group", "buffers", "bucket_groups",
                                             "expert_parallel_buffers", "expert_parallel_bucket_groups"),
                 "mapping Megatron's buffers and groups onto the engine"),
    "buffer": Built("_ParamAndGradBuffer", ("buckets", "param_index_map", "grad_data"),
                    "element ranges per class (param_index_map)"),
    "bucket_group": Built("_ParamAndGradBucketGroup",
                          ("buckets", "ddp_config", "params", "is_first_batch", "per_param_grad_ready_counts",
                           "grad_reduce_handle", "param_gather_handle", "param_gather_dispatched",
                           "cached_grad_buffer_shard_list"),
                          "the replaced start_grad_sync / finish_grad_sync"),
    "bucket": Built("_ParamAndGradBucket", ("params_list", "offset", "grad_data", "gradient_scaling_factor"),
                    "the replaced start_grad_sync"),
}

OPTIMIZER_BUILT: dict[str, Built] = {
    "MegatronOptimizer": Built("MegatronOptimizer", ("optimizer", "config"),
                               "reconciling main parameters and their moments"),
    "OptimizerConfig": Built("OptimizerConfig", ("use_precision_aware_optimizer_no_fp8_or_ds_fp8",),
                             "clipping by the global norm"),
    "ChainedOptimizer": Built("ChainedOptimizer", ("chained_optimizers",), "the dense and expert optimizers"),
    "DistributedOptimizer": Built("DistributedOptimizer", ("model_float16_groups", "shard_fp32_from_float16_groups",
                                                           "model_fp32_groups", "shard_fp32_groups"),
                                  "finding the main shards (reconciliation)"),
    "Float16OptimizerWithFloat16Params": Built("Float16OptimizerWithFloat16Params",
                                               ("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups"),
                                               "finding the fp32 main parameters (reconciliation)"),
}


def _resolve(seam: Seam):
    obj = importlib.import_module(seam.module)
    for part in seam.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def core_version() -> str:
    """The installed megatron-core's version string (``megatron.core.package_info``; "unknown" without one)."""
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def _installed() -> str:
    return f"installed megatron-core {core_version()}; supported: {SUPPORTED}"


def _version_tuple(version: str) -> tuple[int, ...] | None:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def check_seams(seams: tuple[Seam, ...]) -> None:
    """Raise :class:`MegatronLMVersionError` unless every seam exists with the expected parameters.

    Wrappers this project installed are looked through (``functools.wraps``), so a second check
    after patching sees Megatron-LM's own signatures.
    """
    for seam in seams:
        where = f"{seam.module}.{seam.qualname}"
        owner = "megatron-core" if seam.module.startswith("megatron.core") else "Megatron-LM"
        try:
            fn = _resolve(seam)
        except (ImportError, AttributeError):
            raise MegatronLMVersionError(
                f"topo-align: this {owner} has no {where} (needed for {seam.why}); {_installed()}"
            ) from None
        if not seam.params and not seam.exact:
            continue  # a name that must exist (a class the patched function looks up)
        fn = inspect.unwrap(fn)
        got = tuple(inspect.signature(fn).parameters)
        ok = got == seam.params if seam.exact else got[:len(seam.params)] == seam.params
        if not ok:
            raise MegatronLMVersionError(
                f"topo-align: {owner}'s {where}{inspect.signature(fn)} does not match the signature "
                f"topo-align was written for ({', '.join(seam.params)}{'' if seam.exact else ', ...'}), needed for "
                f"{seam.why}; refusing to patch it; {_installed()}")


def check_core(seams: tuple[Seam, ...] = CORE_SEAMS) -> str:
    """Raise :class:`MegatronLMVersionError` unless megatron-core is in `CORE_RANGE` and every
    megatron-core seam the adapter touches exists with the expected parameters; returns the version.

    Called by `TopoAlignDDP` before it builds anything, whenever the plugin is enabled.
    """
    version = core_version()
    parsed = _version_tuple(version)
    lo, hi = CORE_RANGE
    if parsed is None or not lo <= parsed < hi:
        raise MegatronLMVersionError(
            f"topo-align: megatron-core {version} is not supported; the Megatron adapter drives megatron-core "
            f">={_fmt(lo)},<{_fmt(hi)} (tested: {CORE_TESTED}). Install megatron-core=={CORE_TESTED}, or run "
            "without --topo-align (or with \"enabled\": false) for stock Megatron")
    check_seams(seams)
    return version


def check_built(obj, built: Built) -> None:
    """Raise :class:`MegatronLMVersionError` unless ``obj`` (a built megatron-core object) has every
    attribute of ``built``."""
    for attr in built.attrs:
        if not hasattr(obj, attr):
            raise MegatronLMVersionError(
                f"topo-align: this megatron-core's {built.kind} has no attribute {attr!r} (needed for {built.why}); "
                f"{_installed()}")
