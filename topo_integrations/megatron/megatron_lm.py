"""`install()`: plug topo-align into an unmodified Megatron-LM (``megatron.training``).

Megatron-LM looks the following names up as module globals at call time, so rebinding them is
enough (docs/megatron.md, "Three ways in") and no Megatron-LM file is edited:

* ``megatron.training.arguments.add_megatron_arguments`` -> also adds the ``--topo-align*`` flags,
  so the stock ``pretrain_gpt.py`` (whose ``extra_args_provider`` is ModelOpt's or None) accepts
  them, and a bad value ends in argparse's one-line error (exit status 2);
* ``megatron.training.training.get_model`` -> when ``--topo-align`` is on, builds the model with
  ``DDP = TopoAlignDDP`` and a ``DistributedDataParallelConfig`` subclass carrying the resolved
  config (``get_model`` copies every ``args`` attribute named like a config field); without the flag
  the stock classes are used, so the run is stock Megatron;
* ``megatron.training.training.get_megatron_optimizer`` -> `prepare_optimizer` (global gradient
  statistics in `selective`, reconciliation every H steps);
* ``megatron.training.initialize._initialize_distributed`` -> with ``--topo-align
  --use-distributed-optimizer`` and no ``--num-distributed-optimizer-instances``, derives the
  instance count from the topology between ``init_process_group`` and ``initialize_model_parallel``
  (layout.py), which it wraps for the duration of that call only;
* ``save_checkpoint`` / ``load_checkpoint`` (in ``megatron.training.training``) -> reconcile before
  saving and write/read the plugin state per rank in ``<save>/iter_NNNNNNN/topo_align/rankR.pt``.

`uninstall()` restores every name. Both are idempotent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any

import torch

from .compat import INSTALL_SEAMS, check_seams
from .ddp import TopoAlignDDP, prepare_checkpoint, prepare_optimizer
from .flags import RESOLVED_ATTR, add_topo_align_args
from .layout import INSTANCES, UNSET_ATTR, derive_layout

__all__ = ["install", "install_runtime", "uninstall", "is_installed", "TopoAlignDDPConfig", "extra_args_provider"]

log = logging.getLogger("topo_align")

_saved: dict[tuple[Any, str], Any] = {}


def _ddp_config_cls():
    from megatron.core.distributed import DistributedDataParallelConfig

    @dataclasses.dataclass
    class TopoAlignDDPConfig(DistributedDataParallelConfig):
        """Megatron's DDP config plus the resolved topo-align config (filled by ``get_model``)."""

        topo_align_resolved: Any = None
        topo_align_groups: Any = None
        """The `GroupSet` the first TopoAlignDDP chunk built from this config stores, so later chunks
        of the same model reuse its communicators."""

    return TopoAlignDDPConfig


TopoAlignDDPConfig = None  # set on first install (megatron-core is imported lazily)


def extra_args_provider(parser):
    """For your own entry script: ``pretrain(..., extra_args_provider=extra_args_provider)``."""
    return add_topo_align_args(parser)


def is_installed() -> bool:
    return bool(_saved)


def _patch(module, name: str, value) -> None:
    key = (module, name)
    if key not in _saved:
        _saved[key] = getattr(module, name)
    setattr(module, name, value)


def _import_training():
    try:
        from megatron.training import arguments, training
    except ImportError as exc:
        raise ImportError(
            "topo_align: megatron.training (Megatron-LM's training code) cannot be imported "
            f"({exc}); put a Megatron-LM checkout (tag core_v0.16.1 or compatible) on PYTHONPATH"
        ) from exc
    return arguments, training


def install() -> None:
    """Patch Megatron-LM's training package in this process (flags, model, optimizer, checkpoints).

    Raises ImportError with a clear message when ``megatron.training`` (Megatron-LM's training
    code, not part of the megatron-core wheel) cannot be imported, and `MegatronLMVersionError`
    (naming the seam and the supported versions) when a function it patches has another signature.
    """
    global TopoAlignDDPConfig
    arguments, training = _import_training()
    if (training, "get_model") in _saved:
        return
    check_seams(INSTALL_SEAMS)
    if TopoAlignDDPConfig is None:
        TopoAlignDDPConfig = _ddp_config_cls()
    cfg_cls = TopoAlignDDPConfig
    orig_add = arguments.add_megatron_arguments
    stock_ddp = training.DDP
    stock_cfg = training.DistributedDataParallelConfig
    orig_get_model = training.get_model

    @functools.wraps(orig_add)
    def add_megatron_arguments(parser):
        return add_topo_align_args(orig_add(parser))

    @functools.wraps(orig_get_model)
    def get_model(*args, **kwargs):
        on = getattr(training.get_args(), RESOLVED_ATTR, None) is not None
        training.DDP = TopoAlignDDP if on else stock_ddp
        training.DistributedDataParallelConfig = cfg_cls if on else stock_cfg
        return orig_get_model(*args, **kwargs)

    _patch(arguments, "add_megatron_arguments", add_megatron_arguments)
    _patch(training, "get_model", get_model)
    _patch_initialize_distributed(training)
    # get_model() rebinds these two per call; remember the stock values for uninstall().
    _saved.setdefault((training, "DDP"), stock_ddp)
    _saved.setdefault((training, "DistributedDataParallelConfig"), stock_cfg)
    install_runtime()


def _patch_initialize_distributed(training) -> None:
    """Derive the unset layout flags (layout.py) where torch.distributed is up and the model-parallel
    groups are not built yet: inside Megatron-LM's ``_initialize_distributed``, just before its
    ``mpu.initialize_model_parallel`` call (``mpu`` is megatron-core's parallel_state, looked up at
    call time). The parallel_state function is swapped only while that call runs, and only when a
    flag is pending, so every other caller of megatron-core (and a stock run) is untouched."""
    from megatron.core import parallel_state
    from megatron.training import initialize

    orig_init = initialize._initialize_distributed

    @functools.wraps(orig_init)
    def _initialize_distributed(*args, **kwargs):
        margs = training.get_args()
        if getattr(margs, RESOLVED_ATTR, None) is None or not getattr(margs, UNSET_ATTR, ()):
            return orig_init(*args, **kwargs)
        orig_imp = parallel_state.initialize_model_parallel

        @functools.wraps(orig_imp)
        def initialize_model_parallel(*a, **kw):
            size = (margs.tensor_model_parallel_size * margs.pipeline_model_parallel_size
                    * margs.context_parallel_size)
            derive_layout(margs, getattr(margs, RESOLVED_ATTR, None), model_parallel_size=size)
            # The DDP config get_model builds copies the same args attribute: both see one value.
            kw[INSTANCES] = getattr(margs, INSTANCES)
            return orig_imp(*a, **kw)

        parallel_state.initialize_model_parallel = initialize_model_parallel
        try:
            return orig_init(*args, **kwargs)
        finally:
            parallel_state.initialize_model_parallel = orig_imp

    _patch(initialize, "_initialize_distributed", _initialize_distributed)


def install_runtime() -> None:
    """Only the optimizer and checkpoint hooks (`TopoAlignDDP` calls this itself when Megatron-LM
    built it through the source patch's ``--ddp-impl``)."""
    _, training = _import_training()
    if (training, "get_megatron_optimizer") in _saved:
        return
    orig_get_opt = training.get_megatron_optimizer
    orig_save = training.save_checkpoint
    orig_load = training.load_checkpoint

    @functools.wraps(orig_get_opt)
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        return prepare_optimizer(orig_get_opt(config, model_chunks, *args, **kwargs), model_chunks)

    @functools.wraps(orig_save)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        states = None
        if any(isinstance(m, TopoAlignDDP) and m.topo_active for m in _chunks(model)) and optimizer is not None:
            states = prepare_checkpoint(_chunks(model), optimizer)  # reconcile first: replica 0 is complete
        with _plain_resolved_config(training.get_args()):
            out = orig_save(iteration, model, optimizer, *args, **kwargs)
        if states is not None:
            save_dir = getattr(training.get_args(), "save", None)
            if save_dir:
                path = _state_path(save_dir, iteration)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(states, path)
        return out

    @functools.wraps(orig_load)
    def load_checkpoint(ddp_model, optimizer, *args, **kwargs):
        out = orig_load(ddp_model, optimizer, *args, **kwargs)
        chunks = [m for m in _chunks(ddp_model) if isinstance(m, TopoAlignDDP) and m.topo_active]
        load_dir = getattr(training.get_args(), "load", None)
        if chunks and load_dir and isinstance(out, tuple) and out and isinstance(out[0], int) and out[0] > 0:
            path = _state_path(load_dir, out[0])
            if os.path.exists(path):
                states = torch.load(path, map_location="cpu", weights_only=False)
                for m, sd in zip(_chunks(ddp_model), states):
                    if isinstance(m, TopoAlignDDP) and sd:
                        m.load_topo_state_dict(sd)
            else:
                log.warning("topo_align: %s not found; the plugin state (step count, classes, residuals) "
                            "starts fresh", path)
        return out

    _patch(training, "get_megatron_optimizer", get_megatron_optimizer)
    _patch(training, "save_checkpoint", save_checkpoint)
    _patch(training, "load_checkpoint", load_checkpoint)


@contextlib.contextmanager
def _plain_resolved_config(args):
    """Megatron-LM pickles ``args`` into the checkpoint and reads it back with ``torch.load(...,
    weights_only=True)``, which refuses the pydantic `TopoAlignConfig`: during a save the namespace
    holds the config as a plain dict (kept in the checkpoint for inspection; a resumed run parses its
    own flags)."""
    cfg = getattr(args, RESOLVED_ATTR, None)
    if cfg is None or isinstance(cfg, dict):
        yield
        return
    setattr(args, RESOLVED_ATTR, cfg.model_dump(mode="json"))
    try:
        yield
    finally:
        setattr(args, RESOLVED_ATTR, cfg)


def uninstall() -> None:
    """Undo `install` (restores every patched name)."""
    for (module, name), value in list(_saved.items()):
        setattr(module, name, value)
    _saved.clear()


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _state_path(root: str, iteration: int) -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(root, f"iter_{iteration:07d}", "topo_align", f"rank{rank}.pt")
