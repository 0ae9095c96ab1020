"""The runtime hooks of the Megatron-LM integration: the optimizer and checkpoint calls of
``megatron.training.training`` rebound (`install_runtime`), and the record of every rebound name
(`patch`, `uninstall`).

Below both megatron_lm.py (`install()`: the flags and the model, then `install_runtime`) and ddp.py
(a `TopoAlignDDP` built by Megatron-LM through the source patch's ``--ddp-impl`` calls
`install_runtime` itself); it knows the chunks by `optimizer.is_topo_chunk`, not by their class.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import torch

from .flags import RESOLVED_ATTR
from .optimizer import is_topo_chunk, prepare_checkpoint, prepare_optimizer

__all__ = ["install_runtime", "uninstall", "is_installed", "patch", "import_training", "saved"]

log = logging.getLogger("topo_align")

saved: dict[tuple[Any, str], Any] = {}
"""Every rebound (module, name) -> its stock value, for `uninstall`."""


def is_installed() -> bool:
    """Whether `install` or `install_runtime` has rebound anything (and `uninstall` not undone it)."""
    return bool(saved)


def patch(module, name: str, value) -> None:
    """Rebind ``module.name`` to ``value``, remembering the stock value once (for `uninstall`)."""
    key = (module, name)
    if key not in saved:
        saved[key] = getattr(module, name)
    setattr(module, name, value)


def import_training():
    """Megatron-LM's ``megatron.training`` arguments and training modules, or an ImportError saying
    where to get them."""
    try:
        from megatron.training import arguments, training
    except ImportError as exc:
        raise ImportError(
            "topo_align: megatron.training (Megatron-LM's training code) cannot be imported "
            f"({exc}); put a Megatron-LM checkout (tag core_v0.16.1 or compatible) on PYTHONPATH"
        ) from exc
    return arguments, training


def install_runtime() -> None:
    """Only the optimizer and checkpoint hooks (`TopoAlignDDP` calls this itself when Megatron-LM
    built it through the source patch's ``--ddp-impl``)."""
    _, training = import_training()
    if (training, "get_megatron_optimizer") in saved:
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
        if any(is_topo_chunk(m) and m.topo_active for m in _chunks(model)) and optimizer is not None:
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
        chunks = [m for m in _chunks(ddp_model) if is_topo_chunk(m) and m.topo_active]
        load_dir = getattr(training.get_args(), "load", None)
        if chunks and load_dir and isinstance(out, tuple) and out and isinstance(out[0], int) and out[0] > 0:
            path = _state_path(load_dir, out[0])
            if os.path.exists(path):
                states = torch.load(path, map_location="cpu", weights_only=False)
                for m, sd in zip(_chunks(ddp_model), states):
                    if is_topo_chunk(m) and sd:
                        m.load_topo_state_dict(sd)
            else:
                log.warning("topo_align: %s not found; the plugin state (step count, classes, residuals) "
                            "starts fresh", path)
        return out

    patch(training, "get_megatron_optimizer", get_megatron_optimizer)
    patch(training, "save_checkpoint", save_checkpoint)
    patch(training, "load_checkpoint", load_checkpoint)


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
    for (module, name), value in list(saved.items()):
        setattr(module, name, value)
    saved.clear()


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _state_path(root: str, iteration: int) -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(root, f"iter_{iteration:07d}", "topo_align", f"rank{rank}.pt")
