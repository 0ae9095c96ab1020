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

`uninstall()` restores every name. Both are idempotent. The optimizer and checkpoint hooks and the
record of rebound names are in runtime.py (a `TopoAlignDDP` built by the source patch installs them too).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from .compat import INSTALL_SEAMS, check_seams
from .ddp import TopoAlignDDP
from .flags import RESOLVED_ATTR, add_topo_align_args
from .layout import INSTANCES, UNSET_ATTR, derive_layout
from .runtime import import_training, install_runtime, is_installed, patch, saved, uninstall

__all__ = ["install", "install_runtime", "uninstall", "is_installed", "TopoAlignDDPConfig", "extra_args_provider"]

log = logging.getLogger("topo_align")


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


def install() -> None:
    """Patch Megatron-LM's training package in this process (flags, model, optimizer, checkpoints).

    Raises ImportError with a clear message when ``megatron.training`` (Megatron-LM's training
    code, not part of the megatron-core wheel) cannot be imported, and `MegatronLMVersionError`
    (naming the seam and the supported versions) when a function it patches has another signature.
    """
    global TopoAlignDDPConfig
    arguments, training = import_training()
    if (training, "get_model") in saved:
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

    patch(arguments, "add_megatron_arguments", add_megatron_arguments)
    patch(training, "get_model", get_model)
    _patch_initialize_distributed(training)
    # get_model() rebinds these two per call; remember the stock values for uninstall().
    saved.setdefault((training, "DDP"), stock_ddp)
    saved.setdefault((training, "DistributedDataParallelConfig"), stock_cfg)
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

    patch(initialize, "_initialize_distributed", _initialize_distributed)
