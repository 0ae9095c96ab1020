"""GroupedReducer on 4 gloo ranks (2 faked nodes x 2 ranks): modes, invariants, bytes, state.

The ranks start once, in the suite's shared 4-rank world (tests/_world4.py);
`_rank_main` runs every scenario and returns what the test
functions assert on.
"""

from __future__ import annotations

import io
import logging
import math
import os

import _world4
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from topo_integrations.config import TopoAlignConfig

pytestmark = pytest.mark.multirank

HOSTNAME_ENV = "TOPO_ALIGN_HOSTNAME"


# ---------------------------------------------------------------------------- models and data

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Tiny(nn.Module):
    """GPT-shaped toy: embedding, `layers.N` blocks, head; `spare` gets a gradient only sometimes."""

    def __init__(self, d=8, vocab=16, n_layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n_layers)])
        self.lm_head = nn.Linear(d, vocab)
        self.spare = nn.Linear(d, d)

    def forward(self, x, use_spare=False):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        if use_spare:
            h = h + self.spare(h)
        return self.lm_head(h)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(10_000 + 97 * step + rank)
    x = torch.randint(0, 16, (4, 6), generator=g)
    return x, (x * 3 + 1) % 16


def loss_of(model, step, rank, use_spare=False):
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(model(x, use_spare).reshape(-1, 16), y.reshape(-1))


def make(seed=0, n_layers=3):
    torch.manual_seed(seed)
    return Tiny(n_layers=n_layers)


# The mechanism tests below count bytes and class changes for value reconciliation with the moments
# every time and no promotion (the 0.1.0 `local` defaults); s_defaults runs the schema's defaults.
MECHANISM_LOCAL = {"reconcile_dtype": "fp32", "moments_interval": 1, "moments_dtype": "fp32",
                   "promote_drift_fraction": 0.0}


def cfg_of(**kw) -> TopoAlignConfig:
    # sync.dtype fp32: these scenarios compare SYNC with the exact mean; top_fraction 0.15: a LOCAL
    # class for the local.* keys to act on (the schema defaults, every tensor SYNC on the int8 wire
    # at 2 groups, are run by the schema-defaults scenario)
    block = {"mode": "selective", "topology": {"source": "hostnames"}, "local": dict(MECHANISM_LOCAL),
             "sync": {"dtype": "fp32", "top_fraction": 0.15},
             "communication": {"bucket_size_mb": 64.0}, "fallback": {"timeout_s": 60.0}}
    for dotted, v in kw.items():
        node = block
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return TopoAlignConfig.model_validate(block)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def same_on(ranks, t: torch.Tensor) -> bool:
    allt = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(allt, t)
    return all(torch.equal(allt[r], allt[ranks[0]]) for r in ranks)


def train(model, red, opt, rank, start, stop, *, verify=False, on_step=None):
    """Steps [start, stop): forward/backward/finish/step/after; optional per-step checks."""
    for s in range(start, stop):
        opt.zero_grad(set_to_none=True)
        loss_of(model, s, rank, use_spare=(s % 3 == 0 and rank % 2 == 0)).backward()
        red.finish_grad_sync()
        if on_step is not None:
            on_step(s, "grads")
        opt.step()
        red.after_optimizer_step(opt)
        if verify:
            red.verify_consistency()
        if on_step is not None:
            on_step(s, "after")


# ---------------------------------------------------------------------------- scenarios

def s_grads_match_reference(rank, world, groups):
    """flat and hierarchical gradients == dist.all_reduce mean of the local gradients (mixed dtypes),
    with no_sync accumulation and a parameter that gets no gradient on some ranks."""
    from topo_integrations.torch import GroupedReducer

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(5)
            self.a = nn.Parameter(torch.randn(37, 5, generator=g))
            self.b = nn.Parameter(torch.randn(1000, generator=g).to(torch.float16))
            self.c = nn.Parameter(torch.randn(4099, generator=g).to(torch.bfloat16))
            self.d = nn.Parameter(torch.randn(3, generator=g))  # no gradient on odd ranks

        def loss(self, step):
            g = torch.Generator().manual_seed(500 + 10 * step + rank)
            out = 0
            for name in ("a", "b", "c") + (("d",) if rank % 2 == 0 else ()):
                p = getattr(self, name)
                out = out + (p.float() * torch.randn(p.shape, generator=g)).sum() + 0.5 * (p.float() ** 2).sum()
            return out

    out = {}
    variants = {"flat": ("flat", {}), "hierarchical": ("hierarchical", {}),
                "hier_no_overlap": ("hierarchical", {"communication__overlap": False}),
                "hier_no_hooks": ("hierarchical", {"register_hooks": False})}
    for variant, (mode, kw) in variants.items():
        kw = dict(kw)
        hooks = kw.pop("register_hooks", True)
        m = Mixed()
        red = GroupedReducer(m, cfg_of(mode=mode, communication__bucket_size_mb=0.01, **kw), groups=groups,
                             register_hooks=hooks)
        ref = Mixed()
        # two micro-batches: the first inside no_sync
        with red.no_sync():
            m.loss(0).backward()
        m.loss(1).backward()
        red.finish_grad_sync()
        ref.loss(0).backward()
        ref.loss(1).backward()
        worst = 0.0
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            want = (q.grad.float() if q.grad is not None else torch.zeros(q.shape))
            dist.all_reduce(want)
            want /= world
            got = p.grad.float()
            if p.dtype == torch.float32:
                worst = max(worst, float((got - want).norm() / want.norm()))
            else:  # reduced in fp32, rounded once to the parameter dtype
                fi = torch.finfo(p.dtype)
                ulp = (fi.eps * want.abs()).clamp_min(fi.tiny * fi.eps) + 1e-6 * want.abs().max()
                worst = max(worst, float(((got - want.to(p.dtype).float()).abs() / ulp).max()) * 1e-6)
        out[variant] = {"worst": worst, "d_grad_set": m.d.grad is not None,
                     "n_buckets": len(red.stats()["buckets"]["sync"]),
                     "from_hooks": red.stats()["launched_from_hooks"], "same": same_on(range(world), torch.cat(
                         [p.grad.float().reshape(-1) for p in m.parameters()]))}
        red.close()
    return out


def s_selective_invariants(rank, world, groups):
    """30+ steps of selective, blocking: invariant 1 each step, classes refresh, analytic inter bytes."""
    from topo_integrations.torch import GroupedReducer

    model = make()
    cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.2, local__reconcile_interval=4,
                 local__async_reconcile=False, importance__method="fisher", importance__refresh_interval=8,
                 importance__ema_decay=0.5)
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    L = groups.intra_size
    rows = []
    classes_seen = []
    drift = []

    def on_step(s, phase):
        st = red.stats()
        if phase == "grads":
            rows.append({"sync_el": st["sync_elements"], "local_el": st["local_elements"]})
            classes_seen.append(red.classify())
        else:
            rows[-1]["inter"] = sum(st["step"]["bytes"]["inter"].values())
            rows[-1]["inter_sync"] = st["step"]["bytes"]["inter"]["sync"]
            rows[-1]["inter_reconcile"] = st["step"]["bytes"]["inter"]["reconcile"]
            if (s + 1) % 4 != 0:
                local = [p for n, p in model.named_parameters() if not red.is_sync(n)]
                if local:
                    v = torch.cat([p.detach().reshape(-1) for p in local])
                    drift.append(not same_on(list(range(world)), v))

    train(model, red, opt, rank, 0, 34, verify=True, on_step=on_step)
    # analytic inter bytes: fp32 shard of the SYNC bucket every step + at reconciliation steps the
    # fp32 1/L slice of LOCAL params + their Adam exp_avg and exp_avg_sq (3 tensors per element).
    expect = []
    for s, r in enumerate(rows, start=1):
        e = math.ceil(r["sync_el"] / L) * 4
        if s % 4 == 0:
            e += math.ceil(3 * r["local_el"] / L) * 4
        expect.append(e)
    changes = [i for i in range(1, len(classes_seen)) if classes_seen[i] != classes_seen[i - 1]]
    return {"measured": [r["inter"] for r in rows], "expected": expect, "class_changes": changes,
            "drift": any(drift), "sync_el": rows[0]["sync_el"], "local_el": rows[0]["local_el"],
            "stats_keys": sorted(red.stats()), "final": flat_params(model)}


def s_top_fraction_one_equals_hierarchical(rank, world, groups):
    from topo_integrations.torch import GroupedReducer

    finals = {}
    for name, cfg in (("hier", cfg_of(mode="hierarchical")),
                      ("sel1", TopoAlignConfig.model_validate({  # no local.* keys: nothing is LOCAL
                          "mode": "selective", "topology": {"source": "hostnames"},
                          "sync": {"dtype": "fp32", "top_fraction": 1.0},
                          "communication": {"bucket_size_mb": 64.0}, "fallback": {"timeout_s": 60.0}}))):
        model = make(3)
        red = GroupedReducer(model, cfg, groups=groups)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, red, opt, rank, 0, 8)
        finals[name] = flat_params(model)
        red.close()
    return {"equal": torch.equal(finals["hier"], finals["sel1"])}


def s_fp16_wire_bytes(rank, world, groups):
    """sync.dtype fp16 (+4-byte scale) and local fp16: analytic bytes per step on both tiers."""
    from topo_integrations.torch import GroupedReducer

    model = make(4)
    cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.0, sync__dtype="fp16", local__dtype="fp16",
                 local__reconcile_interval=3, local__async_reconcile=False)
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    train(model, red, opt, rank, 0, 6, verify=True,
          on_step=lambda s, ph: got.append(red.stats()["step"]["bytes"]) if ph == "after" else None)
    st = red.stats()
    return {"bytes": got, "sync_el": st["sync_elements"], "local_el": st["local_elements"]}


def s_async(rank, world, groups):
    """Asynchronous reconciliation: staleness <= interval, final forced reconcile -> all identical
    (parameters and the Adam moments of LOCAL parameters)."""
    from topo_integrations.torch import GroupedReducer

    model = make(6)
    H = 3
    cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1, local__reconcile_interval=H,
                 local__async_reconcile=True, importance__refresh_interval=1000)
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, red, opt, rank, 0, 20, verify=True)
    before = not same_on(list(range(world)), flat_params(model))
    red.reconcile(opt)
    red.verify_consistency()
    moments = torch.cat([opt.state[p][k].reshape(-1) for n, p in model.named_parameters()
                         for k in ("exp_avg", "exp_avg_sq") if p in opt.state])
    return {"staleness": red.max_staleness, "H": H, "differed_before": before,
            "params_same": same_on(list(range(world)), flat_params(model)),
            "moments_same": same_on(list(range(world)), moments)}


def s_delta_reconcile(rank, world, groups):
    """reconcile_dtype bf16 (deltas with error feedback), moments every 2nd reconciliation and an outer
    Nesterov step, against fp32 value averaging: invariants on every step, every parameter and moment
    identical after reconcile(), and the reconciliation bytes on the slow tier."""
    from topo_integrations.torch import GroupedReducer

    out = {}
    for name, kw in (("fp32", {}), ("bf16", {"local__reconcile_dtype": "bf16", "local__moments_interval": 2,
                                            "local__outer_momentum": 0.5}),
                     ("int8", {"local__reconcile_dtype": "int8", "local__moments_interval": 2,
                               "local__outer_momentum": 0.5}),
                     ("bf16m", {"local__reconcile_dtype": "bf16", "local__moments_interval": 2,
                                "local__moments_dtype": "bf16", "local__outer_momentum": 0.5})):
        model = make(12)
        cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1, local__reconcile_interval=2,
                     local__async_reconcile=True, importance__refresh_interval=1000, **kw)
        red = GroupedReducer(model, cfg, groups=groups)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # drain after each step: an asynchronous average's bytes are booked when its collectives ran
        train(model, red, opt, rank, 0, 12, verify=True, on_step=lambda s, ph: ph == "after" and red.engine.drain())
        before = red.stats()["total"]["bytes"]["inter"]["reconcile"]
        red.reconcile(opt)
        moments = torch.cat([opt.state[p][k].reshape(-1) for p in model.parameters()
                             for k in ("exp_avg", "exp_avg_sq")])
        out[name] = {"bytes": before, "same": same_on(list(range(world)), flat_params(model)),
                     "moments_same": same_on(list(range(world)), moments), "staleness": red.max_staleness,
                     "reconciles": red.engine.reconciler.reconciles,
                     "finite": bool(torch.isfinite(flat_params(model)).all())}
        red.close()
    return out


def s_state_round_trip(rank, world, groups):
    """Stop after step k (async reconcile in flight), restore into fresh objects, continue: bitwise
    equal to the uninterrupted run; also with delta reconciliation (anchor, outer momentum, residuals)."""
    return {"values": _round_trip(rank, groups, _rt_cfg()),
            "delta": _round_trip(rank, groups, _rt_cfg(local__reconcile_dtype="bf16", local__moments_interval=2,
                                                       local__outer_momentum=0.5)),
            # the moment anchor is set at step 6, saved at 9 and used at 12
            "moments16": _round_trip(rank, groups, _rt_cfg(local__reconcile_dtype="bf16", local__moments_interval=2,
                                                           local__moments_dtype="bf16"))}


def _rt_cfg(**extra) -> TopoAlignConfig:
    return cfg_of(sync__last_n_layers=1, sync__top_fraction=0.15, local__reconcile_interval=3,
                  local__async_reconcile=True, importance__refresh_interval=6, importance__ema_decay=0.5, **extra)


def _round_trip(rank, groups, cfg, total=14, k=9, n_layers=3):
    from topo_integrations.torch import GroupedReducer

    def fresh():
        model = make(8, n_layers)
        red = GroupedReducer(model, cfg, groups=groups)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, red, opt

    m, r, o = fresh()
    train(m, r, o, rank, 0, total)
    straight = flat_params(m)
    r.close()

    m, r, o = fresh()
    train(m, r, o, rank, 0, k)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": o.state_dict(), "reducer": r.state_dict()}, buf)
    had_pending = r.state_dict()["engine"]["pending"] is not None
    r.close()
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    m2, r2, o2 = fresh()
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["opt"])
    r2.load_state_dict(sd["reducer"])
    train(m2, r2, o2, rank, k, total)
    resumed = flat_params(m2)
    r2.close()
    return {"bitwise": torch.equal(straight, resumed), "had_pending": had_pending}


def s_defaults(rank, world, groups):
    """The `local.*` defaults under a LOCAL class (sync.top_fraction 0.15, bf16 SYNC wire: bf16 LOCAL
    wire, reconcile every 2 steps, int8 deltas, moments every 4th reconciliation, drift promotion up
    to 0.15 of the elements): invariant 1 on every step, classes change only at reconciliation steps
    and only LOCAL -> SYNC within the budget, everything identical after reconcile(), and a bitwise
    resume across a promotion. Then the schema's defaults as shipped (`auto` at 2 groups: every
    tensor SYNC on the int8 wire): invariant 1 on every step, no reconciliation, the int8 residuals
    and a bitwise resume with them in the state."""
    from topo_integrations.torch import GroupedReducer

    cfg = TopoAlignConfig.model_validate({"mode": "selective", "topology": {"source": "hostnames"},
                                          "sync": {"top_fraction": 0.15, "dtype": "bf16"},
                                          "fallback": {"timeout_s": 60.0}})
    model = make(14, n_layers=8)  # 3 LOCAL blocks under the default last_n_layers 5
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = [red.classify()]
    train(model, red, opt, rank, 0, 16, verify=True,
          on_step=lambda s, ph: seen.append(red.classify()) if ph == "after" else None)
    changed_at = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    moved = {n: (seen[0][n], seen[-1][n]) for n in seen[0] if seen[0][n] != seen[-1][n]}
    numel = {n: p.numel() for n, p in model.named_parameters()}
    promoted_share = sum(numel[n] for n in moved) / sum(numel.values())
    inter = red.stats()["total"]["bytes"]["inter"]
    red.reconcile(opt)
    moments = torch.cat([opt.state[p][k].reshape(-1) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")])
    out = {"changed_at": changed_at, "moved": moved, "promoted_share": promoted_share,
           "reconcile_bytes": inter["reconcile"], "same": same_on(list(range(world)), flat_params(model)),
           "moments_same": same_on(list(range(world)), moments), "interval": cfg.local.reconcile_interval,
           "budget": cfg.local.promote_drift_fraction}
    red.close()
    out["round_trip"] = _round_trip(rank, groups, cfg, total=12, k=5, n_layers=8)
    # the shipped defaults: invariant 1 on every step (SYNC identical everywhere with the int8 rail
    # hop and its two-part residuals) and a bitwise resume with those residuals in the state.
    shipped = TopoAlignConfig.model_validate({"mode": "selective", "topology": {"source": "hostnames"},
                                              "fallback": {"timeout_s": 60.0}})
    model = make(15, n_layers=8)
    red = GroupedReducer(model, shipped, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, red, opt, rank, 0, 8, verify=True)
    res = red.engine.wire.residual_state()
    # int8 residuals: the payload padded to whole 256-blocks per rail member plus the owner's chunk
    out["sync8_residuals"] = {k: v.numel() for k, v in res.items() if k.startswith("sync/") and v.abs().sum() > 0}
    st = red.stats()
    out["shipped"] = {"sync_dtype": str(red.engine.sync_dtype), "local_elements": st["local_elements"],
                      "reconcile_bytes": st["total"]["bytes"]["inter"]["reconcile"],
                      "same": same_on(list(range(world)), flat_params(model))}
    red.close()
    out["sync8_round_trip"] = _round_trip(rank, groups, shipped, total=10, k=4, n_layers=8)
    return out


def s_streaming(rank, world, groups):
    """local.stream_fragments (issue 31): one fragment of the LOCAL set a step. Invariants on every
    step, each fragment's bytes on its own steps (drained per step), every fragment reconciled every
    interval, everything identical after reconcile(), bitwise resume mid-cycle; and promotion over a
    window of 2 with demotion (streaming too): invariants and a bitwise resume."""
    from topo_integrations.reducer.reconcile.reconcile import fragments
    from topo_integrations.torch import GroupedReducer

    out = {}
    H = 4
    for name, k in (("whole", 1), ("stream4", 4), ("stream2", 2)):
        cfg = cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1, local__reconcile_interval=H,
                     local__stream_fragments=k, local__reconcile_dtype="int8", local__moments_interval=2,
                     local__async_reconcile=True, importance__refresh_interval=1000)
        model = make(21, n_layers=6)
        red = GroupedReducer(model, cfg, groups=groups)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        per_step, last = [], [0]

        def book(s, ph):
            if ph == "after":
                red.engine.drain()
                tot = red.stats()["total"]["bytes"]["inter"]["reconcile"]
                per_step.append(tot - last[0])
                last[0] = tot
        train(model, red, opt, rank, 0, 16, verify=True, on_step=book)
        e = red.engine
        parts = fragments(e.local_names(), e.numels, k)
        red.reconcile(opt)
        moments = torch.cat([opt.state[p][m].reshape(-1) for p in model.parameters()
                             for m in ("exp_avg", "exp_avg_sq")])
        out[name] = {"per_step": per_step, "fragments": [len(f) for f in parts], "staleness": red.max_staleness,
                     "counts": dict(e.reconciler.frag_reconciles),
                     "same": same_on(list(range(world)), flat_params(model)),
                     "moments_same": same_on(list(range(world)), moments)}
        red.close()
    out["round_trip"] = _round_trip(rank, groups, _rt_cfg(local__stream_fragments=3, local__reconcile_dtype="int8",
                                                          local__moments_interval=2, local__moments_dtype="bf16"),
                                    total=16, k=10)
    demote = dict(local__promote_window=2, local__demote=True, local__promote_drift_fraction=0.2,
                  local__stream_fragments=2, local__reconcile_interval=2)
    model = make(22, n_layers=6)
    red = GroupedReducer(model, cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1, **demote), groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    train(model, red, opt, rank, 0, 24, verify=True)
    d = red.engine.drift
    out["demote"] = {"promoted": list(d.promoted), "demoted": list(d.demoted)}
    red.close()
    out["demote_round_trip"] = _round_trip(rank, groups, cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1,
                                                                **demote), total=14, k=7, n_layers=6)
    return out


def s_importance(rank, world, groups):
    """magnitude and hutchinson importance: classes change only right after a reconciliation."""
    from topo_integrations.torch import GroupedReducer

    out = {}
    for method in ("magnitude", "hutchinson"):
        model = make(9)
        cfg = cfg_of(sync__last_n_layers=0, sync__always_sync=[], sync__top_fraction=0.3,
                     local__reconcile_interval=2, local__async_reconcile=True, importance__method=method,
                     importance__refresh_interval=4)
        closure = (lambda: loss_of(model, 999, rank)) if method == "hutchinson" else None
        red = GroupedReducer(model, cfg, groups=groups, loss_closure=closure)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen = [red.classify()]
        train(model, red, opt, rank, 0, 12, verify=True, on_step=lambda s, ph: seen.append(red.classify())
              if ph == "after" else None)
        changed_at = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]  # i = optimizer steps done
        out[method] = {"changed_at": changed_at, "n_sync": sum(c == "SYNC" for c in seen[-1].values())}
        red.close()
    try:
        GroupedReducer(make(), cfg_of(importance__method="hutchinson"), groups=groups)
        out["no_closure"] = None
    except ValueError as exc:
        out["no_closure"] = str(exc)
    return out


def s_agreement(rank, world, groups):
    from topo_integrations.torch import GroupedReducer

    model = make()
    red = GroupedReducer(model, cfg_of(sync__last_n_layers=1, sync__top_fraction=0.0), groups=groups)
    train(model, red, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0, 1)  # LOCAL now group-wise
    n2 = red.global_grad_norm_sq(torch.tensor(float(rank + 1)))
    ov = [red.agree_overflow(rank == 2), red.agree_overflow(False)]
    # A LOCAL parameter changed on one rank only: verify_consistency names it.
    name = next(n for n, c in red.classify().items() if c == "LOCAL")
    msg = None
    if rank == 3:
        with torch.no_grad():
            dict(model.named_parameters())[name].add_(1.0)
    try:
        red.verify_consistency()
    except Exception as exc:  # noqa: BLE001
        msg = f"{type(exc).__name__}: {exc}"
    red.close()
    return {"norm_sq": float(n2), "overflow": ov, "msg": msg, "name": name}


def s_fallback(rank, world):
    """Single node: selective falls back to flat, logged once via the `topo_align` logger."""
    from topo_integrations.reducer import discover_plan
    from topo_integrations.torch import GroupedReducer

    records = []

    class H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    lg = logging.getLogger("topo_align")
    h = H()
    lg.addHandler(h)
    os.environ[HOSTNAME_ENV] = "single"
    cfg = cfg_of()
    model = make()
    red = GroupedReducer(model, cfg, plan=discover_plan(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, red, opt, rank, 0, 3, verify=True)
    lg.removeHandler(h)
    err = None
    try:
        GroupedReducer(make(), cfg_of(fallback__on_flat_topology="error"), groups=red.groups)
    except ValueError as exc:
        err = str(exc)
    st = red.stats()
    red.close()
    # one-tier groups: no rails; the collectives still work (intra = the DP group, one hop skipped)
    from topo_integrations.reducer.wire.collectives import hierarchical_all_reduce, reconcile_average

    g = red.groups
    x = torch.randn(101, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref)
    ref /= world
    y = hierarchical_all_reduce(x.clone(), g)
    one_tier = {
        "inter": g.inter,
        "sizes": (g.intra_size, g.inter_size),
        "rel": float((y - ref).norm() / ref.norm()),
        "rec_noop": torch.equal(reconcile_average(x.clone(), g), x),
    }
    return {"mode": red.mode, "logs": [m for m in records if "falls back" in m], "error": err,
            "dp_bytes": st["total"]["bytes"]["dp"]["sync"], "one_tier": one_tier}


def s_timeout(rank, world, groups_unused):
    """A collective that cannot complete ends in CollectiveError within the group timeout."""
    import datetime
    import time

    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.reducer.wire.collectives import hierarchical_all_reduce

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    g = build_groups(discover_plan(cfg_of()), timeout_s=2.0)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == 3:  # absent from the collective below, alive, until every other rank has given up
        store.wait([f"reducer_modes/timeout/{r}" for r in range(3)], datetime.timedelta(seconds=60))
        return {"skipped": True}
    t0 = time.monotonic()
    try:
        hierarchical_all_reduce(torch.ones(64), g)
        out = {"error": None}
    except Exception as exc:  # noqa: BLE001
        out = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    store.set(f"reducer_modes/timeout/{rank}", "1")
    return out


def _rank_main(rank, world):
    from topo_integrations.reducer import build_groups, discover_plan

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    cfg = cfg_of()
    groups = build_groups(discover_plan(cfg), timeout_s=60)
    import time

    res = {"seconds": {}}
    for name, fn in (("grads", s_grads_match_reference), ("selective", s_selective_invariants),
                     ("tf1", s_top_fraction_one_equals_hierarchical), ("fp16bytes", s_fp16_wire_bytes),
                     ("async", s_async), ("delta", s_delta_reconcile), ("state", s_state_round_trip),
                     ("importance", s_importance), ("defaults", s_defaults), ("streaming", s_streaming),
                     ("agree", s_agreement)):
        t0 = time.perf_counter()
        res[name] = fn(rank, world, groups)
        dist.barrier()
        res["seconds"][name] = round(time.perf_counter() - t0, 2)
    res["fallback"] = s_fallback(rank, world)
    dist.barrier()
    res["timeout"] = s_timeout(rank, world, groups)
    return res


@pytest.fixture(scope="module")
def world(request):
    return _world4.results(request, "test_reducer_modes")  # _rank_main, in the suite's shared 4-rank world


# ---------------------------------------------------------------------------- assertions

@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("mode", ["flat", "hierarchical", "hier_no_overlap", "hier_no_hooks"])
def test_gradients_equal_all_reduce_mean(world, mode):
    for res in world:
        r = res["grads"][mode]
        assert r["worst"] <= 1e-6
        assert r["d_grad_set"] and r["same"]
        assert r["n_buckets"] >= 2  # small buckets
        if mode not in ("flat", "hierarchical"):
            assert r["from_hooks"] == 0
    if mode in ("flat", "hierarchical"):
        # overlap: buckets launch during backward as they fill (in order: on odd ranks the first
        # bucket holds `d`, which gets no gradient there, so everything waits for finish_grad_sync)
        assert world[0]["grads"][mode]["from_hooks"] >= 1 and world[1]["grads"][mode]["from_hooks"] == 0


@pytest.mark.timeout(_world4.TIMEOUT)
def test_selective_invariants_and_analytic_inter_bytes(world):
    r0 = world[0]["selective"]
    assert len(r0["measured"]) >= 30
    for res in world:
        r = res["selective"]
        assert r["measured"] == r["expected"]
        assert r["class_changes"] and all(c % 8 == 0 for c in r["class_changes"])  # only after refresh steps
    assert any(res["selective"]["drift"] for res in world)  # groups really drift between reconciliations
    assert 0 < r0["sync_el"] < r0["sync_el"] + r0["local_el"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_top_fraction_one_equals_hierarchical(world):
    assert all(res["tf1"]["equal"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_fp16_wire_bytes_per_tier(world):
    L = 2
    for res in world:
        r = res["fp16bytes"]
        for s, b in enumerate(r["bytes"], start=1):
            assert b["inter"]["sync"] == math.ceil(r["sync_el"] / L) * 2 + 4  # fp16 shard + 4-byte scale
            assert b["intra"]["local"] == math.ceil(r["local_el"] / L) * L * 2 + 4
            assert b["inter"]["reconcile"] == (math.ceil(r["local_el"] / L) * 4 if s % 3 == 0 else 0)
            # SYNC intra: reduce-scatter input + all-gather output, fp32, padded
            assert b["intra"]["sync"] == 2 * math.ceil(r["sync_el"] / L) * L * 4


@pytest.mark.timeout(_world4.TIMEOUT)
def test_async_reconcile_staleness_and_final_identity(world):
    for res in world:
        r = res["async"]
        assert 1 <= r["staleness"] <= r["H"]
        assert r["params_same"] and r["moments_same"]
    assert any(res["async"]["differed_before"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_state_round_trip_bitwise(world):
    for res in world:
        for variant in ("values", "delta", "moments16"):
            assert res["state"][variant]["had_pending"], variant
            assert res["state"][variant]["bitwise"], variant


@pytest.mark.timeout(_world4.TIMEOUT)
def test_delta_reconciliation_bf16_int8_moments_interval_moments_dtype_outer_momentum(world):
    """6 reconciliations in 12 steps (H = 2, asynchronous). fp32: values + both Adam moments every time
    (3 units of LOCAL parameter bytes each). bf16 deltas: the first one averages values in fp32 (no
    anchor yet, 1 unit), then deltas at 0.5 units; moments (2 units) at every 2nd: 1 + 5 * 0.5 + 3 * 2 =
    9.5 of 18 units. With ``moments_dtype`` bf16 too the moments' first average is exact (2 units) and
    sets their anchor, the next two send deltas (1 unit each): 3.5 + 4 = 7.5 units. The explicit
    reconcile() makes parameters and moments identical everywhere."""
    for res in world:
        f, b, i8, bm = (res["delta"][k] for k in ("fp32", "bf16", "int8", "bf16m"))
        for r in (f, b, i8, bm):
            assert r["same"] and r["moments_same"] and r["finite"]
            assert r["staleness"] == 1 and r["reconciles"] == 7
        assert b["bytes"] == pytest.approx(f["bytes"] * 9.5 / 18, rel=0.02), (b["bytes"], f["bytes"])
        assert bm["bytes"] == pytest.approx(f["bytes"] * 7.5 / 18, rel=0.02), (bm["bytes"], f["bytes"])
        # int8 deltas: each rank's slice (n elements, a unit is 4n bytes) padded to whole 256-element
        # blocks per rail member (K = 2), one byte each plus a 4-byte scale per block; the tiny model
        # makes the padding dominate (n = 160 -> 512)
        n = f["bytes"] // (18 * 4)
        padded = -(-n // 512) * 512
        assert i8["bytes"] == 4 * n * (1 + 6) + 5 * (padded + 4 * padded // 256), (i8["bytes"], f["bytes"])


@pytest.mark.timeout(_world4.TIMEOUT)
def test_streaming_reconciliation_spreads_the_bytes_and_resumes_bitwise(world):
    for res in world:
        r = res["streaming"]
        whole, s4, s2 = r["whole"], r["stream4"], r["stream2"]
        for x in (whole, s4, s2):
            assert x["same"] and x["moments_same"]
            assert 1 <= x["staleness"] <= 1  # a correction lands one step after its snapshot
        # Bytes (drained right after each step, index i = optimizer step i + 1): without streaming at
        # every 4th step; fragment f of k is due where step % 4 == (f + 1) * 4 // k % 4, i.e. with 4
        # fragments fragment i % 4 at index i (if it holds a tensor), with 2 at the odd indices.
        busy = lambda x: [i for i, b in enumerate(x["per_step"]) if b]  # noqa: E731
        assert busy(whole) == [3, 7, 11, 15], whole["per_step"]
        assert busy(s4) == [i for i in range(16) if s4["fragments"][i % 4]], (s4["per_step"], s4["fragments"])
        assert busy(s2) == [i for i in range(16) if i % 2 == 1 and s2["fragments"][0 if i % 4 == 1 else 1]], \
            (s2["per_step"], s2["fragments"])
        assert sum(1 for n in s4["fragments"] if n) >= 3
        assert max(s4["per_step"]) < 0.6 * max(whole["per_step"]), (s4["per_step"], whole["per_step"])
        # 4 asynchronous reconciliations of each fragment that holds a tensor, then reconcile() runs all
        assert s4["counts"] == {f: 5 if n else 1 for f, n in enumerate(s4["fragments"])}, s4["counts"]
        assert r["round_trip"]["had_pending"] and r["round_trip"]["bitwise"]
        assert r["demote_round_trip"]["bitwise"]
        assert r["demote"]["promoted"]
    assert all(res["streaming"]["demote"] == world[0]["streaming"]["demote"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_schema_defaults_keep_the_invariants_and_resume_bitwise(world):
    for res in world:
        r = res["defaults"]
        assert r["interval"] == 2 and r["budget"] == 0.15
        assert r["moved"] and all(v == ("LOCAL", "SYNC") for v in r["moved"].values()), r["moved"]
        assert 0 < r["promoted_share"] <= r["budget"]
        assert all(s % r["interval"] == 0 for s in r["changed_at"]), r["changed_at"]
        assert r["reconcile_bytes"] > 0 and r["same"] and r["moments_same"]
        assert r["round_trip"]["bitwise"]
        assert r["shipped"] == {"sync_dtype": "torch.int8", "local_elements": 0, "reconcile_bytes": 0, "same": True}
        assert r["sync8_round_trip"]["bitwise"] and r["sync8_residuals"], r["sync8_residuals"]
        assert all(n % 256 == 0 for n in r["sync8_residuals"].values()), r["sync8_residuals"]
    assert all(res["defaults"]["moved"] == world[0]["defaults"]["moved"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("method", ["magnitude", "hutchinson"])
def test_importance_classes_change_only_after_reconciliation(world, method):
    for res in world:
        r = res["importance"][method]
        assert all(s % 4 == 0 for s in r["changed_at"])  # refresh steps are reconciliation steps
        assert r["n_sync"] >= 1
        if method == "hutchinson":  # Hessian scores move: classes do change, at refresh steps only
            assert r["changed_at"]
    assert "needs a loss closure" in world[0]["importance"]["no_closure"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_agreement_helpers_and_consistency_error(world):
    for rank, res in enumerate(world):
        r = res["agree"]
        assert r["norm_sq"] == pytest.approx((1 + 2 + 3 + 4) / 4)
        assert r["overflow"] == [True, False]
        assert r["msg"].startswith("ConsistencyError")
        assert repr(r["name"]) in r["msg"] and "inside group 1" in r["msg"] and "DP positions 2 and 3" in r["msg"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_single_node_falls_back_to_flat_logged_once(world):
    for res in world:
        r = res["fallback"]
        assert r["mode"] == "flat" and len(r["logs"]) == 1 and "one island holds all 4 ranks" in r["logs"][0]
        assert "fallback.on_flat_topology = 'error'" in r["error"]
        assert r["dp_bytes"] > 0
        assert r["one_tier"]["inter"] is None and r["one_tier"]["sizes"] == (4, 1)
        assert r["one_tier"]["rel"] <= 1e-6 and r["one_tier"]["rec_noop"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_collective_timeout_is_an_error_not_a_hang(world):
    for rank, res in enumerate(world[:3]):
        r = res["timeout"]
        assert r["error"] and r["error"].startswith("CollectiveError"), r
        assert "intra group" in r["error"] or "inter group" in r["error"]
        assert r["seconds"] < 30
