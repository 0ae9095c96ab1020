#!/usr/bin/env python
"""Convergence evidence: model quality of `selective` (and `hierarchical`) against `flat`.

Trains the same model from the same seed on the same global batches under `flat` (the reference),
`hierarchical` and `selective` with a one-factor-at-a-time grid around the default config, on two
tasks, with the framework-free GroupedReducer on gloo ranks in virtual nodes (faked with
TOPO_ALIGN_HOSTNAME), laid out by `--layout` ISLANDSxRANKS: 2x2 (4 ranks, the default), 4x2 or 8x1
(8 ranks). The global batch is the same in every layout (each rank takes 1/world of it), so a layout
changes only how many replicas train between reconciliations and how big each one's share is:

  gpt     the launch scripts' model (topo_integrations.train.model.GPT, 8 layers, hidden 64) on the
          bundled byte-level corpus (the Python standard library's sources,
          topo_integrations.train.data); metric: validation loss (lower is better).
  digits  a residual MLP (8 blocks) on scikit-learn's `load_digits` (ships inside the package);
          metric: accuracy on a held-out 30 % split (higher is better).

Every run of a task shares one world (the ranks start once per task and seed, the runs follow one
another), so the wall time is the training, not process start-up.

  .venv/bin/python scripts/convergence.py --grid full --seeds 0 1 --out runs/convergence
  .venv/bin/python scripts/convergence.py --report runs/convergence   # tables + PNGs into docs/
  .venv/bin/python scripts/convergence.py --layout 8x1 --grid islands --tasks gpt --seeds 0 --out runs/isl

The final metric of every run is measured after a blocking reconciliation (what a checkpoint save
does), so `selective` is judged on the model a user would keep. Curves in between show the mean
over the replicas of the metric of each rank's own replica.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HOSTNAME_ENV = "TOPO_ALIGN_HOSTNAME"
WORLD = 4  # ranks of the default layout (2x2); a task's global batch is its micro_batch x WORLD

# --layout: islands x ranks per island. 8x1 (islands of one rank) plans two levels for `selective`
# only (topology/planner.py): LOCAL tensors are then each rank's own between reconciliations.
LAYOUTS = {"2x2": (2, 2), "4x2": (4, 2), "8x1": (8, 1)}


def layout_of(name: str) -> tuple[int, int]:
    """(world, ranks per island) of a layout name such as ``4x2``."""
    if name not in LAYOUTS:
        raise ValueError(f"--layout {name!r}; expected one of {', '.join(LAYOUTS)}")
    islands, per = LAYOUTS[name]
    return islands * per, per

# The `local` defaults of 0.1.x: the tables of docs/convergence.md measured with 0.1.0 used them
# (`--base 0.1` puts them under every selective run's overrides to reproduce those tables).
BASE_0_1 = {"sync.dtype": "fp32", "sync.top_fraction": 0.15, "local.reconcile_interval": 4, "local.dtype": "fp16",
            "local.reconcile_dtype": "fp32", "local.moments_interval": 1, "local.moments_dtype": "fp32",
            "local.promote_drift_fraction": 0.0}

# The defaults between issue 15 and issue 25 (`--base issue15`): docs/convergence.md's "Fewer
# slow-tier bytes" table measured its first row and every variant on top of them.
BASE_ISSUE15 = {"sync.dtype": "fp32", "sync.top_fraction": 0.15, "local.reconcile_dtype": "bf16",
                "local.moments_dtype": "fp32"}

# The defaults of issue 25 before `local.moments_dtype` (`--base fp32-moments`): the `sync8` and
# `moments16` rows of that table were measured on them.
BASE_FP32_MOMENTS = {"sync.dtype": "bf16", "sync.top_fraction": 0.15, "local.moments_dtype": "fp32"}

# The SYNC defaults before `auto` (bf16, 0.15), pinned at every layout (`--base two-group`): the
# "Many islands" rows of the default before `auto`, the reconciliation ablation and the `moments16`
# rows were measured on them. Every base pins a `sync.top_fraction` below 1: the `local.*` keys of
# its grids act only on a LOCAL class (the engine refuses them where every tensor is SYNC).
TWO_GROUP = {"sync.dtype": "bf16", "sync.top_fraction": 0.15}

TASKS = {
    # steps: enough for the curves to flatten on 2 CPU cores (see docs/convergence.md).
    "gpt": {"steps": 100, "eval_every": 10, "lr": 3e-3, "warmup": 20, "micro_batch": 8},
    "digits": {"steps": 200, "eval_every": 20, "lr": 2e-3, "warmup": 10, "micro_batch": 16},
    "gpt16": {"steps": 400, "eval_every": 50, "lr": 3e-3, "warmup": 20, "micro_batch": 8},
}
# micro_batch is per rank at WORLD ranks: the global batch (micro_batch x WORLD) stays fixed in
# every layout, so flat trains on the same batches whatever the layout.

# DiLoCo's outer optimizer (Nesterov on the reconciled delta; arXiv 2311.08105, 2509.10439: lr 0.7,
# momentum 0.9), on top of the defaults.
DILOCO_OUTER = {"local.outer_lr": 0.7, "local.outer_momentum": 0.9}


def local_h_grid() -> list[tuple[str, str, dict]]:
    """Issue 38 item 3: the LOCAL class `method: auto` picked on a slow link until item 5 (bf16 SYNC
    wire, top 15 % SYNC, H from the link) at H = 16 and 64, and what each DiLoCo piece buys on top
    of it: the outer Nesterov step (the literature's lr 0.7 / momentum 0.9, and a milder lr 1 /
    momentum 0.5), streaming fragments (4), and the int8 pseudo-gradient wire against fp32."""

    out = [("flat", "flat", {})]
    for h in (16, 64):
        base = {"sync.dtype": "bf16", "sync.top_fraction": 0.15,  # `auto`'s LOCAL candidate until item 5
                "local.reconcile_interval": h}
        out += [(f"H {h}: average (int8 deltas)", "selective", dict(base)),
                (f"H {h}: + outer lr 0.7, momentum 0.9", "selective", {**base, **DILOCO_OUTER}),
                (f"H {h}: + outer lr 1, momentum 0.5", "selective",
                 {**base, "local.outer_lr": 1.0, "local.outer_momentum": 0.5}),
                (f"H {h}: + 4 streaming fragments", "selective", {**base, "local.stream_fragments": 4}),
                (f"H {h}: fp32 reconciliation", "selective", {**base, "local.reconcile_dtype": "fp32"})]
    return out


LEAN = {"sync.dtype": "int8", "sync.top_fraction": 0.05, "sync.last_n_layers": 1, "local.promote_drift_fraction": 0.0}
"""A LOCAL class that leaves most elements LOCAL on the 8-layer GPT: the last layer and the top 5 %
SYNC on the int8 wire, no drift promotion (about the SYNC share of the last 5 of 96 layers)."""


def local_lean_grid() -> list[tuple[str, str, dict]]:
    """Issue 38 item 3, next: `local-h` found the candidate's SYNC class holding 83-86 % of the 8-layer
    GPT's elements (its last 5 layers, the top 15 %, promotions), so it saved no bytes. Here the
    candidate on the int8 SYNC wire, and a lean SYNC class (LEAN), alone and with the mild outer
    step (lr 1, momentum 0.5) that cost nothing at H = 16, at H = 16 and 64."""
    out = [("flat", "flat", {})]
    for h in (16, 64):
        out += [(f"H {h}: candidate on the int8 SYNC wire", "selective",
                 {"sync.dtype": "int8", "sync.top_fraction": 0.15, "local.reconcile_interval": h}),
                (f"H {h}: lean SYNC class", "selective", {**LEAN, "local.reconcile_interval": h}),
                (f"H {h}: lean + outer lr 1, momentum 0.5", "selective",
                 {**LEAN, "local.reconcile_interval": h, "local.outer_lr": 1.0, "local.outer_momentum": 0.5})]
    return out


def lean_candidate_grid(with_flat: bool) -> list[tuple[str, str, dict]]:
    """Issue 38 item 5: the lean SYNC class (LEAN) on the 16-layer GPT, as `method: auto` would run it:
    at H = 16 in one reconciliation, at H = 64 in 4 streaming fragments (sim/choose.py,
    STREAM_FROM_H); flat only where asked (it is layout-independent: one layout's flat serves all)."""
    out = [("flat", "flat", {})] if with_flat else []
    return out + [("lean, H 16", "selective", {**LEAN, "local.reconcile_interval": 16}),
                  ("lean, H 64, 4 fragments", "selective",
                   {**LEAN, "local.reconcile_interval": 64, "local.stream_fragments": 4})]


def grid(kind: str) -> list[tuple[str, str, dict]]:
    """(run name, mode, config overrides) of a grid. `full`: one factor at a time around the defaults."""
    runs = [("flat", "flat", {}), ("hierarchical", "hierarchical", {}), ("selective-default", "selective", {})]
    if kind in ("deep", "deep-key", "deep-bf16", "deep-final", "deep-gap", "deep-drift"):
        return deep_grid(kind)
    if kind == "candidate":  # the deep model's quality-safe config, on the shallow tasks before it becomes default
        return [("candidate default", "selective", dict(CANDIDATE))]
    if kind == "candidate-probe":  # one factor at a time back to the 0.1 default, where the candidate costs
        return [(f"candidate, {k}={v}", "selective", {**CANDIDATE, k: v}) for k, v in (
            ("local.promote_drift_fraction", 0.0), ("local.dtype", "fp16"), ("local.reconcile_dtype", "fp32"),
            ("local.moments_interval", 1), ("local.reconcile_interval", 4))]
    if kind == "probe":
        return [runs[0], runs[2]]
    if kind == "islands":  # issue 31: flat, the default and the default + DiLoCo's outer optimizer
        return [runs[0], runs[2], ("outer lr 0.7, momentum 0.9", "selective", dict(DILOCO_OUTER))]
    if kind == "default":  # the default alone (flat is the same in every layout: measured once)
        return [runs[2]]
    if kind == "reconcile-ablation":  # issue 31 item 3: streaming fragments; promotion over 2 intervals + demotion
        return [("stream_fragments 2", "selective", {"local.stream_fragments": 2}),
                ("promote_window 2 + demote", "selective", {"local.promote_window": 2, "local.demote": True})]
    if kind == "many-islands":  # issue 31: the int8 SYNC wire pays for the SYNC class past 2 islands
        s8 = {"sync.dtype": "int8", "sync.top_fraction": 0.15}
        return [("sync int8", "selective", s8),
                ("sync int8 + top_fraction 0.3", "selective", {**s8, "sync.top_fraction": 0.3})]
    if kind == "many-islands-wide":  # issue 31: the int8 wire buys a SYNC class of most of the model
        return [("sync int8 + top_fraction 0.5", "selective", {"sync.dtype": "int8", "sync.top_fraction": 0.5})]
    if kind == "many-islands-all":  # issue 31: every tensor SYNC on the int8 wire (auto from 4 groups on)
        return [("sync int8 + top_fraction 1", "selective", {"sync.dtype": "int8", "sync.top_fraction": 1.0})]
    if kind == "outer-probe":  # issue 31: an outer step above 1 (no momentum), and reconciling every step
        return [("outer lr 1.5", "selective", {**TWO_GROUP, "local.outer_lr": 1.5}),
                ("outer lr 2", "selective", {**TWO_GROUP, "local.outer_lr": 2.0}),
                ("reconcile_interval 1", "selective", {**TWO_GROUP, "local.reconcile_interval": 1})]
    if kind == "local-h":  # issue 38 item 3: the LOCAL candidate of `method: auto` at long H, piece by piece
        return local_h_grid()
    if kind == "local-lean":  # issue 38 item 3: a LOCAL class that leaves most elements LOCAL
        return local_lean_grid()
    if kind in ("lean-candidate", "lean-candidate-noflat"):  # issue 38 item 5: the lean class on the 16-layer GPT
        return lean_candidate_grid(kind == "lean-candidate")
    if kind == "islands-outer":  # issue 31: the outer optimizer alone (flat/default measured before)
        return [("outer lr 0.7, momentum 0.9", "selective", dict(DILOCO_OUTER))]
    if kind == "wire16":  # issue 25: the SYNC class on a 16-bit wire with error feedback (run with --base issue15)
        return [runs[2], ("sync.dtype=bf16", "selective", {"sync.dtype": "bf16"})]
    if kind == "wire8":  # issue 25: reconciliation deltas on the int8 wire, alone and with a 16-bit SYNC wire
        i8 = {"local.reconcile_dtype": "int8"}
        return [("reconcile_dtype=int8", "selective", i8),
                ("sync bf16 + reconcile int8", "selective", {**i8, "sync.dtype": "bf16"}),
                ("sync bf16 + reconcile int8 + moments/8", "selective",
                 {**i8, "sync.dtype": "bf16", "local.moments_interval": 8})]
    if kind == "sync8":  # issue 25: the SYNC class on the int8 wire, alone and with half as many reconciliations
        s8 = {"sync.dtype": "int8"}
        return [("sync.dtype=int8", "selective", s8),
                ("sync int8 + reconcile_interval 4", "selective", {**s8, "local.reconcile_interval": 4})]
    if kind == "moments16":  # issue 25: the Adam moments' average on a 16-bit delta wire
        return [("moments_dtype=bf16", "selective", {"local.moments_dtype": "bf16"})]
    if kind in ("key", "ci"):
        return runs if kind == "key" else [runs[0], runs[2]]
    if kind != "full":
        raise ValueError(f"--grid {kind!r}; expected 'full', 'key', 'ci', 'deep', 'islands' or 'probe'")
    for v in (0.0, 0.05, 0.5):
        runs.append((f"top_fraction={v}", "selective", {"sync.top_fraction": v}))
    for v in (0, 2):
        runs.append((f"last_n_layers={v}", "selective", {"sync.last_n_layers": v}))
    for v in (1, 16):
        runs.append((f"reconcile_interval={v}", "selective", {"local.reconcile_interval": v}))
    # Classes are first ranked by parameter magnitude and re-ranked by the configured method every
    # refresh_interval (default 200) steps; refresh every 40 steps so the method matters in a short run.
    for m in ("fisher", "hutchinson", "magnitude"):
        runs.append((f"importance={m},refresh=40", "selective",
                     {"importance.method": m, "importance.refresh_interval": 40}))
    runs.append(("async=off", "selective", {"local.async_reconcile": False}))
    # The corner where selective should lose: nothing SYNC but the head, rare reconciliation.
    corner = {"sync.top_fraction": 0.0, "sync.last_n_layers": 0, "local.reconcile_interval": 16}
    runs.append(("corner(top=0,last=0,H=16)", "selective", corner))
    runs.append(("corner+promote_drift=0.15", "selective", {**corner, "local.promote_drift_fraction": 0.15}))
    return runs


LOCAL_SGD = {"sync.top_fraction": 0.0, "sync.last_n_layers": 0, "sync.always_sync": []}


DELTA = {"local.reconcile_dtype": "bf16"}
# The deep GPT's quality-safe config (docs/convergence.md, "The deep model").
CANDIDATE = {**DELTA, "local.reconcile_interval": 2, "local.moments_interval": 4, "local.dtype": "bf16",
             "local.promote_drift_fraction": 0.15}


def deep_grid(kind: str = "deep") -> list[tuple[str, str, dict]]:
    """The choices issue #15 asks evidence for, on the deep GPT: the reconcile interval, delta
    reconciliation on a bf16 wire (with the moments averaged less often, with and without an outer
    momentum), the LOCAL wire, which tensors stay SYNC; `deep-key` is flat, the old default, plain
    local SGD (nothing SYNC) as the floor, and the candidate defaults."""
    key = [
        ("flat", "flat", {}),
        ("selective-default", "selective", {}),
        ("local-sgd H=4", "selective", dict(LOCAL_SGD)),
    ]
    candidates = [
        ("H=2, delta bf16, moments/4", "selective",
         {**DELTA, "local.reconcile_interval": 2, "local.moments_interval": 4}),
        ("H=1, delta bf16, moments/8", "selective",
         {**DELTA, "local.reconcile_interval": 1, "local.moments_interval": 8}),
    ]
    chosen = ("H=2, delta bf16, moments/4, local bf16", "selective",
              {**DELTA, "local.reconcile_interval": 2, "local.moments_interval": 4, "local.dtype": "bf16"})
    if kind == "deep-key":
        return key + candidates
    if kind == "deep-bf16":  # the LOCAL wire: bf16 keeps each element's exponent, the FP16 grid a bucket's
        return [chosen, ("local.dtype=bf16", "selective", {"local.dtype": "bf16"})]
    if kind == "deep-final":
        return [key[0], chosen]
    drift = ("chosen + drift promotion 0.15", "selective", dict(CANDIDATE))  # = chosen + promotion 0.15
    if kind == "deep-drift":
        return [drift]
    if kind == "deep-gap":  # around the chosen config: what closes the last percent, what the lean set costs
        c = chosen[2]
        return [
            ("chosen + moments every reconciliation", "selective", {**c, "local.moments_interval": 1}),
            ("chosen + top_fraction 0.3", "selective", {**c, "sync.top_fraction": 0.3}),
            drift,
            ("chosen, top_fraction 0, last_n_layers 2", "selective",
             {**c, "sync.top_fraction": 0.0, "sync.last_n_layers": 2}),
        ]
    return candidates + [
        ("local.dtype=fp32", "selective", {"local.dtype": "fp32"}),
        ("last_n_layers=8", "selective", {"sync.last_n_layers": 8}),
        ("H=4, delta bf16, outer momentum 0.5", "selective", {**DELTA, "local.outer_momentum": 0.5}),
    ]


def make_cfg(mode: str, overrides: dict):
    from topo_integrations.config import TopoAlignConfig

    block = {"mode": mode, "topology": {"source": "hostnames"}, "communication": {"bucket_size_mb": 1.0},
             "fallback": {"timeout_s": 300.0}}
    cfg = TopoAlignConfig.model_validate(block)
    return cfg.with_overrides(overrides) if overrides else cfg


# ---------------------------------------------------------------------------- tasks

class GPTTask:
    """Byte-level GPT on the bundled standard-library corpus; metric: validation loss."""

    name, metric, higher_is_better = "gpt", "val_loss", False

    def __init__(self, seed: int, corpus_bytes: int = 1 << 19, val_seqs: int = 64, num_layers: int = 8,
                 world: int = WORLD):
        import torch

        from topo_integrations.train.data import ByteTokenizer, collect_stdlib_corpus
        from topo_integrations.train.model import GPTConfig

        self.cfg = GPTConfig(num_layers=num_layers, hidden=64, heads=4, seq_length=64)
        docs = collect_stdlib_corpus(max_bytes=corpus_bytes)
        eod = ByteTokenizer.eod
        ids: list[int] = []
        cut = None
        for i, (_, data) in enumerate(docs):
            if cut is None and len(ids) >= 0.95 * corpus_bytes:
                cut = len(ids)  # validation = the last documents (no document is split)
            ids.extend(data)
            ids.append(eod)
        toks = torch.tensor(ids, dtype=torch.long)
        cut = cut if cut is not None else int(0.95 * len(ids))
        self.train, self.valid = toks[:cut], toks[cut:]
        L = self.cfg.seq_length
        g = torch.Generator().manual_seed(12345)  # the validation windows never depend on the run seed
        starts = torch.randint(0, len(self.valid) - L - 1, (val_seqs,), generator=g)
        self.val_x = torch.stack([self.valid[s:s + L] for s in starts.tolist()])
        self.val_y = torch.stack([self.valid[s + 1:s + L + 1] for s in starts.tolist()])
        self.seed, self.world = seed, world

    def model(self):
        from topo_integrations.train.model import GPT
        return GPT(self.cfg)

    def batch(self, step: int, rank: int, micro: int):
        """Rank ``rank``'s share of the global batch of ``step`` (the same for every mode)."""
        import torch
        L = self.cfg.seq_length
        g = torch.Generator().manual_seed(1_000_003 * self.seed + step)
        starts = torch.randint(0, len(self.train) - L - 1, (micro * self.world,), generator=g)[
            rank * micro : (rank + 1) * micro
        ]
        x = torch.stack([self.train[s:s + L] for s in starts.tolist()])
        y = torch.stack([self.train[s + 1:s + L + 1] for s in starts.tolist()])
        return x, y

    def loss(self, model, x, y):
        return model(x, y)

    def evaluate(self, model, rank: int) -> dict:
        """This rank's share of the validation windows: (sum of losses, count)."""
        import torch
        n = len(self.val_x) // self.world
        with torch.no_grad():
            loss = model(self.val_x[rank * n:(rank + 1) * n], self.val_y[rank * n:(rank + 1) * n])
        return {"sum": float(loss) * n, "n": n}


class DigitsTask:
    """Residual MLP on scikit-learn's load_digits; metric: held-out accuracy (30 %, stratified)."""

    name, metric, higher_is_better = "digits", "accuracy", True

    def __init__(self, seed: int, world: int = WORLD):
        import numpy as np
        import torch
        from sklearn.datasets import load_digits

        d = load_digits()
        X = torch.tensor(d.data / 16.0, dtype=torch.float32)
        y = torch.tensor(d.target, dtype=torch.long)
        rng = np.random.default_rng(0)  # the split never depends on the run seed
        test_idx = []
        for c in range(10):
            idx = np.flatnonzero(d.target == c)
            rng.shuffle(idx)
            test_idx.extend(idx[: int(round(0.3 * len(idx)))].tolist())
        mask = torch.zeros(len(y), dtype=torch.bool)
        mask[test_idx] = True
        self.Xtr, self.ytr, self.Xte, self.yte = X[~mask], y[~mask], X[mask], y[mask]
        self.seed, self.world = seed, world

    def model(self):
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.norm = nn.LayerNorm(d)
                self.fc = nn.Linear(d, d)

            def forward(self, x):
                return x + nn.functional.gelu(self.fc(self.norm(x)))

        class ResMLP(nn.Module):
            # `layers.N` so layer detection finds the blocks; `output_layer` matches always_sync.
            def __init__(self, d=64, n=8):
                super().__init__()
                self.stem = nn.Linear(64, d)
                self.layers = nn.ModuleList(Block(d) for _ in range(n))
                self.norm = nn.LayerNorm(d)
                self.output_layer = nn.Linear(d, 10)

            def forward(self, x):
                h = self.stem(x)
                for b in self.layers:
                    h = b(h)
                return self.output_layer(self.norm(h))

        return ResMLP()

    def batch(self, step: int, rank: int, micro: int):
        import torch
        g = torch.Generator().manual_seed(1_000_003 * self.seed + step)
        idx = torch.randint(0, len(self.ytr), (micro * self.world,), generator=g)[rank * micro:(rank + 1) * micro]
        return self.Xtr[idx], self.ytr[idx]

    def loss(self, model, x, y):
        import torch.nn.functional as F
        return F.cross_entropy(model(x), y)

    def evaluate(self, model, rank: int) -> dict:
        """This rank's share of the held-out split: (correct, count)."""
        import torch
        n = math.ceil(len(self.yte) / self.world)
        x, y = self.Xte[rank * n:(rank + 1) * n], self.yte[rank * n:(rank + 1) * n]
        with torch.no_grad():
            correct = int((model(x).argmax(-1) == y).sum())
        return {"sum": float(correct), "n": len(y)}


class DeepGPTTask(GPTTask):
    """The same corpus and metric with a deeper, thinner GPT (16 layers x 64): last 5 layers + 15 %
    is about a quarter of the elements, so most of the model is LOCAL (issue #15's quality case)."""

    name = "gpt16"

    def __init__(self, seed: int, world: int = WORLD):
        super().__init__(seed, num_layers=16, world=world)


def make_task(name: str, seed: int, world: int = WORLD):
    return {"gpt": GPTTask, "gpt16": DeepGPTTask, "digits": DigitsTask}[name](seed, world=world)


# ---------------------------------------------------------------------------- one run on every rank

def _agreed_metric(task, model, rank) -> float:
    import torch
    import torch.distributed as dist
    r = task.evaluate(model, rank)
    t = torch.tensor([r["sum"], float(r["n"])], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def train_one(rank: int, task, groups, mode: str, overrides: dict, *, steps: int, eval_every: int, lr: float,
              warmup: int, micro: int, seed: int) -> dict:
    """Train one configuration from ``seed``; returns curves and final metric (same on every rank)."""
    import torch
    import torch.distributed as dist

    from topo_integrations.torch import GroupedReducer

    torch.manual_seed(seed)
    model = task.model()
    cfg = make_cfg(mode, overrides)
    holder = {}

    def hvp_loss():
        # Hutchinson needs a double backward; the fused CPU attention kernels have none, the math one has.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return task.loss(model, *holder["batch"])

    closure = hvp_loss if cfg.importance.method == "hutchinson" else None
    red = GroupedReducer(model, cfg, groups=groups, loss_closure=closure)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    curve, train_curve = [], []
    t0 = time.perf_counter()
    ema = None
    for s in range(steps):
        # linear warm-up, cosine decay to 10 %
        f = (
            (s + 1) / warmup
            if s < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
        )
        for gr in opt.param_groups:
            gr["lr"] = lr * f
        x, y = task.batch(s, rank, micro)
        holder["batch"] = (x, y)
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, x, y)
        loss.backward()
        red.finish_grad_sync()
        # Clip at 1.0 on the norm every rank agrees on (invariant 2 of docs/design.md).
        sq = sum(p.grad.detach().float().pow(2).sum() for p in model.parameters() if p.grad is not None)
        norm = float(red.global_grad_norm_sq(sq.reshape(1)).sqrt())
        if norm > 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / norm)
        opt.step()
        red.after_optimizer_step(opt)
        lv = float(loss.detach())
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        if (s + 1) % eval_every == 0 and s + 1 < steps:
            curve.append((s + 1, _agreed_metric(task, model, rank)))
            t = torch.tensor([ema], dtype=torch.float64)
            dist.all_reduce(t)
            train_curve.append((s + 1, float(t) / dist.get_world_size()))
    red.reconcile(opt)  # what a checkpoint save does: judge the model a user keeps
    red.verify_consistency()
    final = _agreed_metric(task, model, rank)
    curve.append((steps, final))
    st = red.stats()
    red.close()
    inter = st["total"]["bytes"]["inter"]
    return {"final": final, "curve": curve, "train_curve": train_curve, "wall_s": time.perf_counter() - t0,
            "mode": st["mode"], "sync_elements": st["sync_elements"], "local_elements": st["local_elements"],
            "inter_bytes": sum(inter.values()) + sum(st["total"]["bytes"]["dp"].values()),
            "drift": {k: st["drift"][k] for k in ("history", "promoted", "max")}}


def _rank_main(rank: int, world: int, task_name: str, seed: int | list[int], runs: list, params: dict,
               layout: str = "2x2") -> list[dict]:
    """Every run of ``runs`` from ``seed`` (or from each seed of a list, one after another in this
    world: the ranks start once)."""
    import torch
    torch.set_num_threads(1)
    os.environ[HOSTNAME_ENV] = f"node{rank // layout_of(layout)[1]}"
    from topo_integrations.reducer import build_groups, discover_plan
    # Planned for `selective`: with islands of one rank only that mode keeps two levels; flat runs
    # on the data-parallel group and hierarchical on the same groups whatever the plan.
    plan = discover_plan(make_cfg("selective", {}))
    if not plan.hierarchical:
        raise RuntimeError(f"layout {layout}: the plan is flat ({plan.reason})")
    groups = build_groups(plan, timeout_s=300)
    out = []
    for s in (seed if isinstance(seed, list) else [seed]):
        task = make_task(task_name, s, world=world)
        for name, mode, overrides in runs:
            r = train_one(rank, task, groups, mode, overrides, seed=s, **params)
            out.append({"task": task_name, "seed": s, "layout": layout, "name": name, "configured_mode": mode,
                        "overrides": overrides, **r})
    return out


def run_grid(task_name: str, seed: int | list[int], runs: list, *, steps: int | None = None, timeout: float = 3600,
             layout: str = "2x2") -> list[dict]:
    from topo_integrations.testing import run_world
    p = dict(TASKS[task_name])
    world, _ = layout_of(layout)
    global_batch = p["micro_batch"] * WORLD
    if global_batch % world:
        raise ValueError(f"layout {layout}: {task_name}'s global batch {global_batch} does not split over "
                         f"{world} ranks")
    params = {"steps": steps or p["steps"], "eval_every": p["eval_every"], "lr": p["lr"], "warmup": p["warmup"],
              "micro": global_batch // world}
    if steps:
        params["eval_every"] = max(1, steps // 5)
    res = run_world(world, _rank_main, task_name, seed, runs, params, layout, timeout=timeout,
                    env={"OMP_NUM_THREADS": "1"})
    return res[0]


# ---------------------------------------------------------------------------- report

LOSS_TASKS = ("gpt", "gpt16")


def rel_gap(task: str, run: float, ref: float) -> float:
    """Quality loss vs flat: relative loss increase (gpt, gpt16) or accuracy drop in points (digits)."""
    return (run - ref) / ref * 100 if task in LOSS_TASKS else (ref - run) * 100


def layout_title(layout: str) -> str:
    islands, per = LAYOUTS.get(layout, (0, 0))
    return f"{layout}: {islands} islands x {per} rank{'s' if per > 1 else ''}, {islands * per} gloo ranks"


def report(results: list[dict], img_dir: Path) -> str:
    """Markdown tables (and PNG curves into ``img_dir``) of every run, grouped by layout and task
    (results written before `--layout` existed are 2x2)."""

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    layouts = list(dict.fromkeys(r.get("layout", "2x2") for r in results))
    for layout, task in ((lay, t) for lay in layouts for t in ("gpt", "gpt16", "digits")):
        rs = [r for r in results if r["task"] == task and r.get("layout", "2x2") == layout]
        if not rs:
            continue
        seeds = sorted({r["seed"] for r in rs})
        names = list(dict.fromkeys(r["name"] for r in rs))
        unit = "val loss" if task in LOSS_TASKS else "accuracy %"
        gap = "loss vs flat, %" if task in LOSS_TASKS else "accuracy drop vs flat, points"
        lines += [f"### {task} ({layout_title(layout)})", "",
                  f"| run | {unit} (per seed) | mean | {gap} | SYNC share | slow-tier payload/step |"
                  " max drift | wall s |", "|---|---|---|---|---|---|---|---|"]
        ref = {s: next(r["final"] for r in rs if r["name"] == "flat" and r["seed"] == s) for s in seeds
               if any(r["name"] == "flat" and r["seed"] == s for r in rs)}
        for n in names:
            rr = [r for r in rs if r["name"] == n]
            scale = 1 if task in LOSS_TASKS else 100
            digits = 4 if task in LOSS_TASKS else 2
            vals = ", ".join(f"{r['final'] * scale:.{digits}f}" for r in rr)
            mean = statistics.mean(r["final"] for r in rr) * scale
            gaps = [rel_gap(task, r["final"], ref[r["seed"]]) for r in rr if r["seed"] in ref]
            g = (f"{statistics.mean(gaps):+.2f}" + (f" (±{(max(gaps) - min(gaps)) / 2:.2f})" if len(gaps) > 1 else "")
                 if gaps else "– (no flat run of these seeds)")
            r0 = rr[0]
            share = r0["sync_elements"] / (r0["sync_elements"] + r0["local_elements"])
            steps = r0["curve"][-1][0]
            hist = r0["drift"]["history"]
            drift = max(h[1] for h in hist) if hist else None
            lines.append(
                f"| {n} | {vals} | {mean:.{4 if task in LOSS_TASKS else 2}f} | {g} | {share:.2f} "
                f"| {r0['inter_bytes'] / steps / 1024:.1f} KiB"
                f" | {'' if drift is None else f'{drift:.2e}'} | {statistics.mean(r['wall_s'] for r in rr):.0f} |"
            )
        lines.append("")
        # curves: one panel for the mode comparison, one per grid factor
        panels = {"modes": ["flat", "hierarchical", "selective-default"]}
        for n in names:
            key = "corner" if n.startswith("corner") else n.split("=")[0].split("(")[0].split(",")[0]
            if n not in panels["modes"]:
                panels.setdefault(key, ["flat", "selective-default"]).append(n)
        cols = min(4, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax, (title, members) in zip(axes.flat, panels.items()):
            for n in members:
                rr = [r for r in rs if r["name"] == n and r["seed"] == seeds[0]]
                if not rr:
                    continue
                xs, ys = zip(*rr[0]["curve"])
                ys = [y * (1 if task in LOSS_TASKS else 100) for y in ys]
                ax.plot(xs, ys, label=n, lw=1.4 if n != "flat" else 2.4, alpha=0.9)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(unit)
            ax.legend(fontsize=6)
            if task in LOSS_TASKS:
                ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
            else:
                ax.set_ylim(bottom=max(ax.get_ylim()[0], 80))
        fig.suptitle(f"{task}: {unit}, seed {seeds[0]}, {layout_title(layout)}, 2-core CPU", fontsize=10)
        fig.tight_layout()
        png = img_dir / (f"convergence_{task}.png" if layout == "2x2" else f"convergence_{task}_{layout}.png")
        fig.savefig(png, dpi=90)
        plt.close(fig)
        lines += [f"![{task} curves](img/{png.name})", ""]
    if len(layouts) > 1:
        lines += layouts_table(results)
    return "\n".join(lines)


def runs_of(results: list[dict], task: str, layout: str, name: str) -> list[dict]:
    """The runs of one configuration, by seed (results written before `--layout` existed are 2x2)."""
    return sorted((r for r in results if r["task"] == task and r.get("layout", "2x2") == layout
                   and r["name"] == name), key=lambda r: r["seed"])


def flat_of(results: list[dict], task: str, layout: str) -> tuple[dict[int, float], str | None]:
    """``({seed: flat's final metric}, the layout it ran on)``: flat of ``layout``, else of the first
    layout that ran it (flat trains on the same global batches in every layout)."""
    layouts = sorted({r.get("layout", "2x2") for r in results}, key=lambda k: LAYOUTS.get(k, (0, 0)))
    for lay in [layout] + [k for k in layouts if k != layout]:
        flat = {r["seed"]: r["final"] for r in runs_of(results, task, lay, "flat")}
        if flat:
            return flat, lay
    return {}, None


def signed_gaps(task: str, runs: list[dict], flat: dict[int, float]) -> list[float]:
    """Per seed with a flat run: loss, the relative increase in % (positive = worse); accuracy, the
    difference in points (negative = worse)."""
    return [rel_gap(task, r["final"], flat[r["seed"]]) * (1 if task in LOSS_TASKS else -1) + 0.0 for r in runs
            if r["seed"] in flat]


def ablation_table(results: list[dict], names: list[str]) -> list[str]:
    """docs/convergence.md's "Reconciliation ablation" table: the runs ``names`` per task and layout,
    with the gap to flat of the same seeds (flat of another layout where this one has none)."""
    layouts = sorted({r.get("layout", "2x2") for r in results}, key=lambda k: LAYOUTS.get(k, (0, 0)))
    lines = ["| task | layout | run | metric (per seed) | vs flat, mean (per seed) | SYNC share "
             "| slow-tier payload/step |", "|---|---|---|---|---|---|---|"]
    for task in ("gpt16", "gpt", "digits"):
        loss = task in LOSS_TASKS
        for lay in layouts:
            flat, _ = flat_of(results, task, lay)
            for name in names:
                rr = runs_of(results, task, lay, name)
                if not rr:
                    continue
                scale, nd = (1, 4) if loss else (100, 2)
                gaps = signed_gaps(task, rr, flat)
                each = ", ".join(f"{x:+.2f}" for x in gaps)
                g = f"{statistics.mean(gaps):+.2f}{'%' if loss else ' points'} ({each})" if gaps else "–"
                r0 = rr[0]
                share = r0["sync_elements"] / (r0["sync_elements"] + r0["local_elements"])
                vals = ", ".join(f"{r['final'] * scale:.{nd}f}" for r in rr)
                pay = r0["inter_bytes"] / r0["curve"][-1][0] / 1024
                lines.append(f"| {task} | {lay} | {name} | {vals} | {g} | {share:.2f} | {pay:.1f} KiB |")
    return lines


def layouts_table(results: list[dict]) -> list[str]:
    """One table over every layout (docs/convergence.md, "Many islands"): per task and run, each
    layout's per-seed metric, mean, gap to flat of the same layout and seeds (mean, per seed), the SYNC
    share at the end and the slow-tier payload per step of seed 0's run."""
    layouts = sorted({r.get("layout", "2x2") for r in results}, key=lambda k: LAYOUTS.get(k, (0, 0)))
    lines = ["### All layouts", "", "| task | layout | run | metric (per seed) | mean | vs flat, mean (per seed): "
             "loss %, accuracy points "
             "| SYNC share | slow-tier payload/step |", "|---|---|---|---|---|---|---|---|"]
    for task in ("gpt16", "gpt", "digits"):
        loss = task in LOSS_TASKS
        # flat first, then the runs in the order they ran
        names = sorted(dict.fromkeys(r["name"] for r in results if r["task"] == task), key=lambda n: n != "flat")
        for name in names:
            for lay in layouts:
                rr = runs_of(results, task, lay, name)
                if not rr:
                    continue
                flat, other = flat_of(results, task, lay)
                other = f" (flat of {other})" if other != lay else ""
                scale, nd = (1, 4) if loss else (100, 2)
                vals = ", ".join(f"{r['final'] * scale:.{nd}f}" for r in rr) + ("" if loss else " %")
                mean = statistics.mean(r["final"] for r in rr) * scale
                gaps = signed_gaps(task, rr, flat)
                unit = " %" if loss else " points"
                if name == "flat":
                    g = "0"
                elif gaps:
                    g = f"{statistics.mean(gaps):+.2f}{unit}" + (
                        f" ({', '.join(f'{x:+.2f}' for x in gaps)})" if len(gaps) > 1 else "") + other
                else:
                    g = "– (no flat run of these seeds)"
                r0 = rr[0]
                share = r0["sync_elements"] / (r0["sync_elements"] + r0["local_elements"])
                pay = r0["inter_bytes"] / r0["curve"][-1][0] / 1024
                lines.append(f"| {task} | {lay} | {name} | {vals} | {mean:.{nd}f} | {g} | {share:.2f} "
                             f"| {pay:.1f} KiB |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["gpt", "digits"], choices=sorted(TASKS))
    ap.add_argument("--grid", default="full",
                    choices=["full", "key", "ci", "deep", "deep-key", "deep-bf16", "deep-final", "deep-gap",
                             "deep-drift", "candidate", "candidate-probe", "probe", "wire16", "wire8", "sync8",
                             "moments16", "islands", "islands-outer", "default", "reconcile-ablation",
                             "many-islands", "many-islands-wide", "many-islands-all",
                             "outer-probe", "local-h", "local-lean", "lean-candidate",
                             "lean-candidate-noflat"])
    ap.add_argument("--layout", default="2x2", choices=sorted(LAYOUTS),
                    help="islands x ranks per island (virtual nodes): 2x2 on 4 ranks, 4x2 and 8x1 on 8")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--key-seeds", nargs="*", type=int, default=[],
                    help="extra seeds that run only the key configurations (flat, hierarchical, selective-default)")
    ap.add_argument("--steps", type=int, default=None, help="override the task's step count")
    ap.add_argument("--shared-world", action="store_true",
                    help="run all seeds of a task in one world (the ranks start once; results.json is "
                         "written per task instead of per seed)")
    ap.add_argument("--out", default="runs/convergence", help="folder for results.json")
    ap.add_argument("--report", metavar="DIR", nargs="+", help="only write the report of DIR/results.json (merged)")
    ap.add_argument("--img-dir", default="docs/img")
    ap.add_argument("--base", choices=["current", "0.1", "issue15", "fp32-moments", "two-group"], default="current",
                    help="defaults under the overrides of every selective run: this release's, 0.1.x's "
                         "(reproduces the tables measured with 0.1.0), those between issues 15 and 25, or "
                         "issue 25's before local.moments_dtype, or the SYNC defaults before auto (bf16, "
                         "0.15) at every layout")
    args = ap.parse_args(argv)
    if args.report:
        res = [r for d in args.report for r in json.loads((Path(d) / "results.json").read_text())]
        print(report(res, Path(args.img_dir)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    if args.shared_world:  # all seeds of a task in one world
        jobs = [(t, list(args.seeds), args.grid) for t in args.tasks]
        jobs += [(t, list(args.key_seeds), "key") for t in args.tasks if args.key_seeds]
    else:
        jobs = [(t, s, args.grid) for s in args.seeds for t in args.tasks]
        jobs += [(t, s, "key") for s in args.key_seeds for t in args.tasks]
    for task, seed, kind in jobs:
        t0 = time.perf_counter()
        runs = grid(kind)
        base = {"0.1": BASE_0_1, "issue15": BASE_ISSUE15, "fp32-moments": BASE_FP32_MOMENTS,
                "two-group": TWO_GROUP}.get(args.base)
        if base:
            runs = [(n, m, {**base, **o} if m == "selective" else o) for n, m, o in runs]
        n_seeds = len(seed) if isinstance(seed, list) else 1
        rs = run_grid(task, seed, runs, steps=args.steps, layout=args.layout, timeout=3600 * n_seeds)
        results += rs
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{task} seed {seed} grid {kind} layout {args.layout}: {len(rs)} runs in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        for r in rs:
            print(f"  {r['name']:<32} {r['final']:.4f}  ({r['wall_s']:.0f} s)", flush=True)
    print(report(results, Path(args.img_dir)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
