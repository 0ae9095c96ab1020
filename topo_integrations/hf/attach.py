"""The adapter on a model Accelerate prepared, seen the same way on every path (docs/hf.md).

:class:`Attached` holds what ``prepare()`` built: on the DeepSpeed path the engine's
``topo_align`` (``DeepSpeedTopo``), on DDP the comm hook's ``TopoAlignHookState``, on FSDP2
``TopoAlignFSDP``; each owns one reducer ``Engine``. It gives the Trainer callback and the
accelerate patch one vocabulary: the figures logged (``figures``), the start line (``start_line``),
the calls after a step, clipping, reconciliation, and the per-rank state saved beside a Trainer
checkpoint (DeepSpeed saves its own inside ``save_checkpoint``). :func:`attached` finds the record
of a model by the model itself or the module it wraps (``DistributedDataParallel.module``,
``DeepSpeedEngine.module``).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Attached", "attached", "register", "live", "STATE_DIR", "FIGURE_KEYS"]

log = logging.getLogger("topo_align")

STATE_DIR = "topo_align"
"""Folder of a Trainer checkpoint holding the engine state, one ``rank<N>.pt`` per rank."""

FIGURE_KEYS = ("topo_align/method", "topo_align/sync_share", "topo_align/slow_tier_bytes_per_step",
               "topo_align/slow_tier_bytes", "topo_align/reconciles", "topo_align/steps")

SLOW_TIERS = ("inter", "dp")
"""Tiers that cross the slow links: the rail (``inter``) and, in `flat`, the whole data-parallel group."""

_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, Attached]" = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class Attached:
    path: str
    """"deepspeed", "ddp" or "fsdp2"."""
    label: str
    """The path as the start line names it ("Accelerate DDP (MULTI_CPU)")."""
    adapter: Any
    model: nn.Module
    optimizer: Any = None
    """The torch optimizer whose steps are counted (DDP, FSDP2); DeepSpeed counts its own."""
    notes: list = field(default_factory=list)

    @property
    def engine(self):
        return self.adapter.engine

    # ------------------------------------------------------------------ what a step needs

    def after_optimizer_step(self, optimizer=None) -> None:
        """DDP and FSDP2: count the step, reconcile when due (an optimizer step post-hook calls it)."""
        if self.path != "deepspeed":
            self.adapter.after_optimizer_step(optimizer if optimizer is not None else self.optimizer)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm every rank agrees on, and the gradients clipped to it (`selective`)."""
        return self.adapter.clip_grad_norm_(max_norm)

    def reconcile(self) -> None:
        """Identical replicas now (all ranks call it): before a checkpoint or an evaluation."""
        if not self.engine.selective:
            return
        if self.path == "deepspeed":
            self.model.topo_reconcile()
        else:
            self.adapter.reconcile(self.optimizer)

    # ------------------------------------------------------------------ what users see

    def figures(self) -> dict:
        """Totals since the start: method, SYNC share, slow-tier bytes, reconciliations, steps."""
        e = self.engine
        st = e.stats()
        slow = sum(sum(st["total"]["bytes"].get(t, {}).values()) for t in SLOW_TIERS)
        return {"topo_align/method": str(st["mode"]), "topo_align/sync_share": float(st["sync_fraction"]),
                "topo_align/slow_tier_bytes": int(slow), "topo_align/reconciles": int(st["reconciles"]),
                "topo_align/steps": int(e.step)}

    def start_line(self) -> str:
        """One line: topo-align is active, on which path, and what it chose."""
        e = self.engine
        g = e.groups
        head = f"topo-align: active on {self.label}, {g.dp_size} rank{'s' if g.dp_size != 1 else ''}"
        if not g.hierarchical:
            reason = getattr(self.adapter, "fallback_reason", None) or g.plan.reason
            return f"{head}: one tier ({reason}); mode {e.mode}: one flat all-reduce"
        head += f" = {g.inter_size} islands x {g.intra_size}"
        if e.selective:
            cfg = e.cfg
            local = "" if e.sync_fraction() >= 1.0 else (
                f", LOCAL reconciled every {cfg.local.reconcile_interval} steps"
                f"{' (asynchronously)' if cfg.local.async_reconcile else ''}")
            what = f"mode selective: SYNC {100 * e.sync_fraction():.1f}% of elements on a " \
                   f"{str(e.sync_dtype).removeprefix('torch.')} wire{local}"
        else:
            what = f"mode {e.mode}: slow-tier wire {e.cfg.communication.inter_dtype}"
        return f"{head}; {what}; plan: {g.plan.reason}"

    # ------------------------------------------------------------------ state beside a checkpoint

    @property
    def saves_beside(self) -> bool:
        """DDP and FSDP2 keep the engine state in a folder of the Trainer checkpoint; DeepSpeed's
        ``save_checkpoint`` writes it itself."""
        return self.path != "deepspeed"

    def state_file(self, checkpoint_dir: str) -> str:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return os.path.join(checkpoint_dir, STATE_DIR, f"rank{rank}.pt")

    def save(self, checkpoint_dir: str) -> str | None:
        """This rank's engine state into ``checkpoint_dir/topo_align/rank<N>.pt`` (no collective)."""
        if not self.saves_beside:
            return None
        path = self.state_file(checkpoint_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.adapter.state_dict(), path)
        return path

    def load(self, checkpoint_dir: str) -> bool:
        """Restore this rank's engine state from a checkpoint folder; False when it holds none."""
        if not self.saves_beside:
            return False
        path = self.state_file(checkpoint_dir)
        if not os.path.isfile(path):
            return False
        self.adapter.load_state_dict(torch.load(path, weights_only=True))
        return True


def _keys(model: nn.Module) -> list[nn.Module]:
    out = [model]
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            out += _keys(inner)
    return out


def register(att: Attached) -> Attached:
    for m in _keys(att.model):
        _REGISTRY[m] = att
    return att


def attached(model) -> Attached | None:
    """The record of ``model`` (prepared, or the module it wraps), None when topo-align is not on it."""
    if not isinstance(model, nn.Module):
        return None
    for m in _keys(model):
        att = _REGISTRY.get(m)
        if att is not None:
            return att
    return None


def live() -> list[Attached]:
    """Every record whose model is alive, once each."""
    seen, out = set(), []
    for att in list(_REGISTRY.values()):
        if id(att) not in seen:
            seen.add(id(att))
            out.append(att)
    return out
