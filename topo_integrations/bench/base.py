"""What every benchmarked system shares (bench/trainers.py): the learning-rate schedule, the GPT and
its AdamW, the plain PyTorch loop the systems extend, and the topo-align block and reconciliation
figures of the topo-align systems."""

from __future__ import annotations

import argparse

import torch

from .systems import topo_block

__all__ = ["lr_at_step", "Plain", "gpt", "adamw", "block", "engine_info", "reconcile_info", "version"]


def lr_at_step(step: int, spec: dict) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``
    (train.common.lr_at) or, ``lr_schedule: constant``, ``lr`` from then on (equal budgets)."""
    from ..train.common import lr_at

    if spec.get("lr_schedule", "cosine") == "constant":
        return spec["lr"] * min(1.0, (step + 1) / max(1, spec["warmup_steps"]))

    return lr_at(step, argparse.Namespace(warmup_steps=spec["warmup_steps"], train_steps=spec["steps"],
                                          lr=spec["lr"], min_lr_ratio=spec["min_lr_ratio"]))


def gpt(spec: dict):
    from ..train.model import GPT, GPTConfig

    torch.manual_seed(spec["seed"])
    return GPT(GPTConfig(num_layers=spec["layers"], hidden=spec["hidden"], heads=spec["heads"],
                         seq_length=spec["seq_length"]))


def adamw(params, spec: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.95), weight_decay=spec["weight_decay"])



class Plain:
    """A GPT and AdamW driven by a plain PyTorch loop; subclasses add the exchange."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.model = gpt(spec)
        self.params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.opt = adamw(self.model.parameters(), spec)
        self.net = self.model

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def _clip(self) -> None:
        if self.spec["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec["clip"])

    def step(self, b: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.net(b["tokens"], b["labels"], b["loss_mask"])
        loss.backward()
        self._clip()
        self.opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self, b: dict) -> float:
        self.model.eval()
        out = float(self.model(b["tokens"], b["labels"], b["loss_mask"]))
        self.model.train()
        return out

    def drain(self) -> None:
        pass

    def before_eval(self) -> None:
        pass

    def info(self) -> dict:
        return {}


def version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "?"


def engine_info(st: dict, cfg) -> dict:
    """What the worker reports of a topo-align engine (GroupedReducer, the FSDP2 adapter): its mode,
    SYNC share, reconciliation settings and counts, bytes; ``st`` its ``stats()``, ``cfg`` its config."""
    from ..config import Mode

    total = st["sync_elements"] + st["local_elements"]
    return {"mode": st["mode"], "method": st.get("method"), "method_line": st.get("method_line"),
            "fallback_reason": st.get("fallback_reason"),
            "sync_fraction": st["sync_elements"] / max(1, total), **reconcile_info(cfg),
            "reconciles": (st["optimizer_steps"] // cfg.local.reconcile_interval
                           if st["mode"] == Mode.SELECTIVE else 0),
            "reducer_bytes_total": st["total"]["bytes"], "reducer_steps": st["steps"]}


def reconcile_info(cfg) -> dict:
    """What the byte theory of a reconciliation needs (bench/systems.py), from the engine's effective
    config (``--topo-set`` included, `auto` resolved at the planned group count)."""
    loc = cfg.local
    return {"sync_dtype": cfg.sync.dtype, "reconcile_interval": loc.reconcile_interval,
            "reconcile_dtype": loc.reconcile_dtype,
            "moments_interval": loc.moments_interval, "moments_dtype": loc.moments_dtype,
            "outer_optimizer": loc.outer_momentum > 0 or loc.outer_lr != 1.0}


block = topo_block
"""The ``topo_align`` block of a topo-align system (bench/systems.py ``topo_block``: the theory plans from it too)."""
