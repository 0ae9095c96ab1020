"""CPU harness: real DeepSpeed engines on gloo ranks, for the tests and for users checking an install.

Rank-side helpers only (the ranks are started by ``topo_integrations.testing.run_world``, by
``torchrun`` or by the ``deepspeed`` launcher): a small layered model, per-rank data, DeepSpeed
configs, a training loop that records what the invariants need, and checks across ranks.

Call :func:`prepare_cpu` first in every rank: it selects the CPU accelerator and skips the
``deepspeed_shm_comm`` JIT build (docs/deepspeed.md), so an engine starts in about a second.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import Mode

__all__ = ["prepare_cpu", "released_engines", "Net", "ds_config", "topo_block", "make_optimizer", "train",
           "flat_params", "gather_rows", "rel_err", "virtual_hostname"]


def _engines() -> list:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]


@contextlib.contextmanager
def released_engines():
    """On leaving the block, every DeepSpeed engine built inside it is destroyed (``destroy()``: its
    ZeRO gradient hooks removed, a topo-align engine's threads stopped).

    Why: an engine's gradient hooks live on autograd nodes (C++) and hold the engine, so a dropped
    engine is never collected, with its model and process groups (three gloo threads each); a test
    world building dozens grew to hundreds of idle gloo threads a rank. Use with
    `topo_integrations.testing.released_groups` outside this block. Issues no collective."""
    before = {id(o) for o in _engines()}
    try:
        yield
    finally:
        for eng in _engines():
            if id(eng) not in before:
                eng.destroy()


def prepare_cpu() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from .compat import skip_shm_comm_build

    skip_shm_comm_build()


def virtual_hostname(rank: int, per_node: int = 2) -> str:
    return f"vnode{rank // per_node}"


class Net(nn.Module):
    """embed -> 3 x (Linear, tanh) layers -> head; names follow the `layers.N` convention."""

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 3, d_out: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Linear(d_in, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return ((self.head(h) - y) ** 2).mean()


def batch(rank: int, step: int, micro: int, n: int = 4, d_in: int = 8, d_out: int = 4):
    """Different data on every rank, reproducible from (rank, step, micro)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * step + micro + 1)
    x = torch.randn(n, d_in, generator=g)
    w = torch.linspace(-1, 1, d_in * d_out).reshape(d_in, d_out)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, d_out, generator=g)
    return x, y


def ds_config(stage: int, *, gas: int = 1, clip: float = 0.0, micro: int = 4, topo: dict | None = None,
              **extra) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if clip:
        cfg["gradient_clipping"] = clip
    if topo is not None:
        cfg["topo_align"] = copy.deepcopy(topo)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    return cfg


def topo_block(mode: str, **sections) -> dict:
    block: dict[str, Any] = {"enabled": True, "mode": mode, "topology": {"source": "hostnames"}}
    if mode == Mode.SELECTIVE:
        # fp32 SYNC wire: the tests compare SYNC with DeepSpeed's exact mean
        block["sync"] = {"last_n_layers": 1, "always_sync": ["head"], "top_fraction": 0.0, "dtype": "fp32"}
        block["local"] = {"dtype": "fp32", "reconcile_interval": 4, "async_reconcile": False}
    for k, v in sections.items():
        block.setdefault(k, {})
        if isinstance(v, dict):
            block[k].update(v)
        else:
            block[k] = v
    return block


def make_optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    raise ValueError(f"optimizer kind {kind!r}; expected 'adamw' or 'sgd'")


def flat_params(engine) -> torch.Tensor:
    """All parameters of the engine's module as one fp32 vector (gathered under ZeRO-3)."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().float().reshape(-1).clone() for p in params])
    return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def class_vectors(engine) -> tuple[torch.Tensor, torch.Tensor]:
    st = engine.topo_align
    sync, local = [], []
    for n, p in engine.module.named_parameters():
        (sync if st.sync[n] else local).append(p.detach().float().reshape(-1))
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
    return cat(sync), cat(local)


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """world x numel: every rank's copy of ``t``, on the CPU (NCCL gathers from this rank's GPU)."""
    if dist.get_backend() == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out).cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def train(engine, steps: int, *, start: int = 0, check=None) -> list[float]:
    """Run ``steps`` optimizer steps (gradient accumulation per the config); returns the mean loss
    over all ranks per step. ``check(engine, step)`` runs after every step (invariant checks)."""
    rank = dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for micro in range(gas):
            x, y = batch(rank, step, micro)
            dtype = next(engine.module.parameters()).dtype
            loss = engine(x.to(engine.device, dtype), y.to(engine.device, dtype))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach().float())
        # NCCL reduces only device tensors (scripts/gpu_check.py runs this loop on NCCL too)
        t = torch.tensor([total / gas], device=engine.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
        if check is not None:
            check(engine, step)
    return losses


def selective_checker(records: list):
    """A ``check`` for :func:`train`: per step, whether SYNC params are bitwise equal on all ranks,
    LOCAL params equal inside each island, everything equal after a reconciliation, and the clip
    norm and overflow flag equal on all ranks (invariants 1 and 2 of docs/design.md)."""

    def check(engine, step):
        st = engine.topo_align
        sync, local = class_vectors(engine)
        s_rows, l_rows = gather_rows(sync), gather_rows(local)
        g = st.groups
        isl = torch.tensor([g.group_index])
        islands = gather_rows(isl).reshape(-1).tolist()
        sync_equal = bool((s_rows == s_rows[0]).all())
        island_equal = all(bool((l_rows[r] == l_rows[islands.index(islands[r])]).all()) for r in range(len(islands)))
        reconciled = st.engine.reconciler.all_synced  # a blocking reconciliation ended this step
        all_equal = bool((l_rows == l_rows[0]).all())
        norm = torch.tensor([st.last_clip_norm if st.last_clip_norm is not None else -1.0], dtype=torch.float64)
        norms = gather_rows(norm).reshape(-1)
        ovf = gather_rows(torch.tensor([1.0 if st.last_overflow else 0.0])).reshape(-1)
        local_spread = float((l_rows - l_rows.mean(0)).abs().max()) if l_rows.numel() else 0.0
        records.append({
            "step": step, "sync_equal": sync_equal, "island_equal": island_equal,
            "reconciled": reconciled, "all_equal_after_reconcile": (all_equal if reconciled else None),
            "norm_agree": bool((norms == norms[0]).all()), "norm": float(norms[0]),
            "overflow_agree": bool((ovf == ovf[0]).all()), "local_spread": local_spread,
        })

    return check
