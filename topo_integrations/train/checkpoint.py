"""Per-rank checkpoints with an atomic "latest" pointer, for the entry points that own their state.

Layout under ``<run>/checkpoints/``::

    step_0000050/rank_00000.pt ... rank_NNNNN.pt     one file per rank (model, optimizer, reducer)
    latest                                           text: the step of the newest complete checkpoint

A checkpoint counts only once ``latest`` names it, and ``latest`` is rewritten (by rename) only after
every rank has written its file, so a run killed at any moment resumes from a complete checkpoint and
loses at most ``--save-interval`` steps. Each rank saves its own state because with topo-align's
``selective`` mode replicas in different groups legitimately differ between reconciliations;
resuming needs the same world size. The DeepSpeed entry point uses DeepSpeed's own
``save_checkpoint``/``load_checkpoint`` instead.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["latest_step", "save", "load", "ResumeError"]


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed from (missing, or written by a different world size)."""


def _step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:07d}")


def latest_step(ckpt_dir: str) -> int | None:
    try:
        with open(os.path.join(ckpt_dir, "latest"), encoding="utf-8") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def save(ckpt_dir: str, step: int, state: dict[str, Any], *, keep: int = 2) -> None:
    """Write this rank's ``state`` for ``step`` and, once all ranks have, point ``latest`` at it.

    Communication: 1. every rank writes its own file (no communication); 2. a barrier over the
    default group; 3. rank 0 renames ``latest`` into place and prunes all but ``keep`` checkpoints.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    d = _step_dir(ckpt_dir, step)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"rank_{rank:05d}.pt")
    torch.save({**state, "step": step, "world_size": world}, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{step}\n")
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))
        steps = sorted(int(n[5:]) for n in os.listdir(ckpt_dir) if n.startswith("step_") and n[5:].isdigit())
        for old in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(_step_dir(ckpt_dir, old), ignore_errors=True)
    dist.barrier()


def load(ckpt_dir: str, step: int) -> dict[str, Any]:
    """This rank's state of checkpoint ``step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(_step_dir(ckpt_dir, step), f"rank_{rank:05d}.pt")
    if not os.path.isfile(path):
        raise ResumeError(f"--resume: {path} is missing; the checkpoint of step {step} was written by a "
                          f"different number of ranks than this run's {world}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("world_size") != world:
        raise ResumeError(f"--resume: checkpoint of step {step} was written by {state.get('world_size')} ranks; "
                          f"this run has {world}; resume with the same number of ranks")
    return state
