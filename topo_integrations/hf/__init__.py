"""Hugging Face Accelerate and Trainer (docs/hf.md): one ``install()`` for every path Accelerate takes.

    import topo_integrations.hf as thf
    thf.install("topo_align.json")   # before Accelerator.prepare() / Trainer.train()

Accelerate's DeepSpeed path goes through the DeepSpeed adapter (the block of the DeepSpeed config, or
the one given here), DDP (``MULTI_CPU``, ``MULTI_GPU``, ...) through the DDP comm hook, FSDP2
through the FSDP2 adapter (sharded inside the islands); every other path (FSDP1, MS-AMP, Megatron-LM,
XLA, a comm hook of one's own, ...) is named in one warning line at ``prepare()``. A Trainer gets
:class:`TopoAlignCallback` (figures in its logs, the engine state beside each checkpoint).

  paths.py     which path an Accelerator takes; where topo-align cannot act and why (CANNOT)
  attach.py    Attached: the adapter on a prepared model, its figures, start line and saved state
  prepare.py   the wrapped Accelerator.prepare, fsdp2_prepare_model and clip_grad_norm_
  callback.py  TopoAlignCallback and add_callback (transformers)
  console.py   the start line and warnings made visible on rank 0
  imports.py   patching transformers' Trainer when it is imported, not before
  harness.py   CPU ranks for the tests and the example: accelerate's FSDP path on CPU, tiny runs
"""

from __future__ import annotations

import functools
import os
from typing import Any

from .attach import Attached, attached
from .paths import CANNOT, Decision, decide

__all__ = ["install", "uninstall", "installed", "attached", "Attached", "TopoAlignCallback", "add_callback",
           "decide", "Decision", "CANNOT", "CONFIG_ENV", "read_config"]

CONFIG_ENV = "TOPO_ALIGN_CONFIG"
"""A JSON file with the block (or a framework config holding it under "topo_align"), read by
``install()`` when it is given no config: unchanged scripts under ``accelerate launch``."""

_TRAINER: dict[str, Any] = {}


def read_config(config=None):
    """The block as a ``TopoAlignConfig``: from ``config`` (a config, a dict, a JSON path), else from
    the file ``TOPO_ALIGN_CONFIG`` names, else None. A bad block raises ``ConfigError`` here."""
    from ..config import TopoAlignConfig

    if config is None:
        path = os.environ.get(CONFIG_ENV)
        return TopoAlignConfig.from_file(path) if path else None
    if isinstance(config, TopoAlignConfig):
        return config
    if isinstance(config, dict):
        return TopoAlignConfig.from_block(config.get("topo_align", config), where="install(config=...)")
    return TopoAlignConfig.from_file(config)


def install(config=None, *, trainer: bool = True, console: bool = True) -> None:
    """Make every ``Accelerator.prepare()`` (and so every ``Trainer``) use topo-align where it can.

    ``config``: the "topo_align" block for DDP and FSDP2 (and DeepSpeed configs without one): a
    ``TopoAlignConfig``, a dict or a JSON file; None reads ``TOPO_ALIGN_CONFIG``. ``trainer``: every
    ``transformers.Trainer`` built afterwards gets :class:`TopoAlignCallback`. ``console``: make the
    ``topo_align`` logger's lines visible on rank 0 (console.py). Call again to change the config."""
    from . import prepare

    prepare.set_config(read_config(config))
    prepare.patch()
    if console:
        from .console import ensure_console

        ensure_console()
    if trainer:
        _patch_trainer()


def uninstall() -> None:
    from . import prepare

    prepare.unpatch()
    prepare.set_config(None)
    _TRAINER["active"] = False  # the patched __init__ stays (another import may hold it) and adds nothing


def installed() -> bool:
    from . import prepare

    return prepare.patched()


def _patch_trainer() -> None:
    """Every ``transformers.Trainer`` built from now on gets the callback (transformers is patched
    when it is imported, not imported here)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    _TRAINER["active"] = True
    if not _TRAINER.get("pending"):
        from .imports import when_imported

        _TRAINER["pending"] = True
        when_imported("transformers.trainer", _patch_trainer_class)


def _patch_trainer_class(module) -> None:
    if "__init__" in _TRAINER:
        return
    from .callback import add_callback

    init = module.Trainer.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _TRAINER.get("active"):
            add_callback(self)

    _TRAINER["__init__"] = init
    module.Trainer.__init__ = __init__


def __getattr__(name: str):
    if name in ("TopoAlignCallback", "add_callback"):  # transformers is imported only when asked for
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'topo_integrations.hf' has no attribute {name!r}")
