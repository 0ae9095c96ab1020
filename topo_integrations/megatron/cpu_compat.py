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

It is **never active when CUDA is available**: :func:`apply` then does nothing and returns False,
so a GPU job that imports it by accident is untouched. It changes process-global state and is
meant to be applied once, at start-up, before megatron-core builds anything.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply", "is_active", "cuda_available"]

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
        _patch_torch_cuda()
        _patch_rng()
        _patch_moe()
        _mode = _CudaAsCpuMode()
        _mode.__enter__()
        _active = True
    return True
