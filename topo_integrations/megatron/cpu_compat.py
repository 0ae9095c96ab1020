"""Run the real megatron-core (GPTModel, DDP, optimizers, schedules) on CPU with gloo.

For development and CI only. megatron-core assumes a GPU in a handful of places (docs/megatron.md,
"Running megatron-core on CPU"): CUDA RNG trackers, ``device=torch.cuda.current_device()`` allocations (DDP buffers,
GlobalMemoryBuffer), ``device='cuda'`` scalars and ``param.type() == 'torch.cuda.*'`` checks in the
optimizers, and CUDA streams on the ``num_distributed_optimizer_instances > 1`` path. :func:`apply`
makes each of them work on CPU:

* ``torch.cuda.current_device()`` returns ``"cpu"``, so every buffer allocated "on the current
  device" is a CPU tensor;
* the Megatron RNG tracker keeps CPU generator states instead of CUDA ones;
* a process-wide ``TorchFunctionMode`` turns ``device='cuda'`` into CPU, ``Tensor.cuda()`` into a
  no-op and makes ``Tensor.type()`` report ``torch.cuda.*`` so the optimizers accept CPU params;
* CUDA streams, events, synchronisation and memory queries become inert stand-ins;
* the MoE router's missing TransformerEngine name is defined (as None, i.e. "no TE").

:func:`apply_training` does the same for Megatron-LM's training code (``megatron.training``, what
``pretrain_gpt.py`` runs; docs/megatron.md lists what it changes): ``initialize_megatron``
runs without the "Megatron requires CUDA" assertion and with one visible "device" while it sets up
the model-parallel groups and the RNG tracker (it skips both when ``device_count()`` is 0), the
dataset helpers are not rebuilt with ``make`` when the wheel's prebuilt ``helpers_cpp`` imports,
the fused kernels (``nvcc``) are not loaded, and the triton-only batch-invariant kernels module is
replaced by an import-only stand-in when triton is absent (it has no CPU build).

It is **never active when CUDA is available**: :func:`apply` then does nothing and returns False,
so a GPU job that imports it by accident is untouched. It changes process-global state and is
meant to be applied once, at start-up, before megatron-core builds anything.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import threading
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply", "apply_training", "stub_absent_imports", "is_active", "cuda_available"]

_lock = threading.Lock()
_active = False
_mode: TorchFunctionMode | None = None


def cuda_available() -> bool:
    """True when a usable CUDA device exists (then the compatibility layer stays off)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver counts as "no CUDA" for this purpose
        return False


def is_active() -> bool:
    return _active


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return False


class _CudaAsCpuMode(TorchFunctionMode):
    """``device='cuda'`` -> CPU; ``Tensor.cuda()`` -> self; ``Tensor.type()`` -> ``torch.cuda.*``.

    Megatron's optimizers accept only parameters whose ``type()`` is a CUDA type and allocate their
    scalars with ``device='cuda'``; this mode lets those lines run unchanged on CPU tensors.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_Event":
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _CpuRngTrackerMixin:
    """Megatron's RNG tracker with CPU generator states (``fork`` swaps the CPU RNG state)."""

    def add(self, name, seed):  # noqa: D401 - mirrors CudaRNGStatesTracker.add
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_topo_cpu", False):
        return
    cpu_tracker = type("CpuRNGStatesTracker", (_CpuRngTrackerMixin, base), {"_topo_cpu": True})
    # initialize_rng_tracker() looks the class up as a module global at call time; a subclass keeps
    # every isinstance(..., CudaRNGStatesTracker) check true.
    mrandom.CudaRNGStatesTracker = cpu_tracker
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, cpu_tracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    _default = _Stream()
    cuda.default_stream = lambda *a, **k: _default
    cuda.current_stream = lambda *a, **k: _default
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    # Megatron-LM checkpoints save/restore the CUDA RNG state; keep a CPU byte tensor in its place.
    _state = {"s": torch.Generator().get_state()}
    cuda.get_rng_state = lambda *a, **k: _state["s"].clone()
    cuda.set_rng_state = lambda s, *a, **k: _state.__setitem__("s", s.clone())
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    try:
        import torch.cuda.random as cuda_random

        cuda_random.get_rng_state = cuda.get_rng_state
        cuda_random.set_rng_state = cuda.set_rng_state
    except ImportError:  # pragma: no cover
        pass


def _patch_moe() -> None:
    # megatron-core 0.16 leaves `te_general_gemm` undefined when TransformerEngine is absent (it is
    # never present on CPU), and the MoE router's gating then fails with a NameError.
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:  # pragma: no cover - MoE module missing in other versions
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> bool:
    """Activate the CPU compatibility layer; returns True if it is (now) active.

    Does nothing and returns False when CUDA is available. Idempotent. Call it before
    megatron-core builds models, buffers or optimizers.
    """
    global _active, _mode
    if cuda_available():
        return False
    with _lock:
        if _active:
            return True
        from .compat import CPU_CORE_SEAMS, check_seams

        check_seams(CPU_CORE_SEAMS)  # the private RNG-tracker names _patch_rng replaces
        _patch_torch_cuda()
        _patch_rng()
        _patch_moe()
        _mode = _CudaAsCpuMode()
        _mode.__enter__()
        _active = True
    return True


_OPTIONAL_IMPORTS = {
    # module Megatron-LM imports at import time -> the package it needs and what for
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": ("triton", "--batch-invariant-mode"),
    "regex": ("regex", "the GPT-2 BPE tokenizer (--tokenizer-type GPT2BPETokenizer)"),
}


class _Unavailable(types.ModuleType):
    """Import-only stand-in for a module whose package is absent: any use raises, naming it."""

    def __init__(self, name: str, package: str, used_by: str):
        super().__init__(name)
        self._why = f"{used_by} needs the package {package!r}, which is not installed (no CPU build for triton)"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(self._why)

        return unavailable


def stub_absent_imports() -> None:
    """Megatron-LM imports triton's kernels (initialize.py) and ``regex`` (the GPT-2 tokenizer) at
    import time; neither is used by a CPU run with another tokenizer. A stand-in that raises when
    used keeps a run that does need them from silently doing nothing."""
    for name, (package, used_by) in _OPTIONAL_IMPORTS.items():
        if name not in sys.modules and importlib.util.find_spec(package) is None:
            sys.modules[name] = _Unavailable(name, package, used_by)


@contextlib.contextmanager
def _one_visible_device():
    """``torch.cuda.device_count()`` is 1 inside: initialize.py then builds the model-parallel groups
    and seeds the (CPU) RNG tracker; ``set_device`` is already inert."""
    orig = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = orig


def _patch_training() -> None:
    from megatron.core.datasets import utils as dataset_utils
    from megatron.legacy import fused_kernels
    from megatron.training import initialize, training

    if getattr(training.initialize_megatron, "_topo_cpu", False):
        return
    stock_init = training.initialize_megatron

    @functools.wraps(stock_init)
    def initialize_megatron(*args: Any, **kwargs: Any):
        kwargs["allow_no_cuda"] = True
        with _one_visible_device():
            return stock_init(*args, **kwargs)

    initialize_megatron._topo_cpu = True  # type: ignore[attr-defined]
    training.initialize_megatron = initialize_megatron
    initialize.initialize_megatron = initialize_megatron
    stock_compile = dataset_utils.compile_helpers

    @functools.wraps(stock_compile)
    def compile_helpers() -> None:
        try:  # the wheel ships the extension prebuilt but no Makefile
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            stock_compile()

    dataset_utils.compile_helpers = compile_helpers
    stock_kernels = fused_kernels.load

    @functools.wraps(stock_kernels)
    def load(args: Any) -> None:  # nvcc; a CPU run uses the unfused paths
        return None

    fused_kernels.load = load


def _patch_distopt_checkpoint() -> None:
    """Resuming with ``--use-distributed-optimizer`` and torch's Adam (no apex, no TransformerEngine:
    the CPU case) in fp32 (what a CPU run trains). Three stock call sites fail there:

    * Megatron-LM builds the load template from the fresh optimizer, whose
      ``DistributedOptimizer.state_dict`` asserts one ``step`` value over the still empty torch state
      (the template's step is 0 there; the loaded value replaces it);
    * ``load_state_dict`` gives every parameter's torch state ONE shared ``step`` tensor (torch's
      Adam increments each in place) and on this path leaves it at the template's 0 instead of the
      saved count: each parameter gets its own tensor holding the checkpoint's step count;
    * an fp32 parameter's main shard is a view of the model parameter (a leaf that requires grad)
      and the loader copies into it in place outside ``no_grad``.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if dopt.HAVE_APEX_OR_TE or getattr(cls.state_dict, "_topo_cpu", False):
        return
    stock_sd, stock_load = cls.state_dict, cls.load_state_dict

    @functools.wraps(stock_sd)
    def state_dict(self):
        inner = self.optimizer
        if inner.state:
            return stock_sd(self)
        first = next(p for g in inner.param_groups for p in g["params"])
        inner.state[first]["step"] = torch.zeros(())
        try:
            return stock_sd(self)
        finally:
            inner.state.clear()

    @functools.wraps(stock_load)
    def load_state_dict(self, sd):
        out = stock_load(self, sd)
        steps = {float(g["step"]) for g in sd.get("optimizer", {}).get("param_groups", []) if "step" in g}
        if len(steps) == 1:
            step = steps.pop()
            for st in self.optimizer.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    state_dict._topo_cpu = True  # type: ignore[attr-defined]
    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = torch.no_grad()(cls._set_main_param_and_optimizer_states)


def apply_training() -> bool:
    """`apply` plus Megatron-LM's training code (see the module docstring). Returns False and changes
    nothing when CUDA is available. Call it before ``pretrain()`` runs; idempotent."""
    if not apply():
        return False
    stub_absent_imports()
    from .compat import CPU_SEAMS, check_seams

    check_seams(CPU_SEAMS)
    _patch_training()
    _patch_distopt_checkpoint()
    return True
