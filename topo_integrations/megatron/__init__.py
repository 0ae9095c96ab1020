"""Megatron adapter (docs/megatron.md): `TopoAlignDDP`, the ``--topo-align*`` flags, `install()`,
the ``python -m topo_integrations.megatron pretrain_gpt.py ARGS`` launcher and a CPU
compatibility layer (`cpu_compat`) for running real megatron-core on CPU with gloo.

Importing this package does not import megatron-core; the names below load it on first use.
"""

from __future__ import annotations

from .flags import add_topo_align_args, config_from_args

__all__ = [
    "add_topo_align_args", "config_from_args", "TopoAlignDDP", "prepare_optimizer", "prepare_checkpoint",
    "install", "uninstall", "extra_args_provider",
]


def __getattr__(name: str):
    if name in ("TopoAlignDDP", "prepare_optimizer", "prepare_checkpoint"):
        from . import ddp

        return getattr(ddp, name)
    if name in ("install", "uninstall", "extra_args_provider"):
        from . import megatron_lm as _install

        return getattr(_install, name)
    raise AttributeError(f"module 'topo_integrations.megatron' has no attribute {name!r}")
