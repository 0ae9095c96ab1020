"""The DDP comm hook (topo_integrations/torch/ddp_hook.py) on 4 gloo ranks (2 faked nodes x 2 ranks),
with real ``DistributedDataParallel`` and the collective-order check on in every rank.

The ranks start once, in the suite's shared 4-rank world (tests/_world4.py);
`_rank_main` runs every scenario and returns what the test
functions assert on.
"""

from __future__ import annotations

import gc
import os
import weakref

import _world4
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from topo_integrations.config import TopoAlignConfig

pytestmark = pytest.mark.multirank

HOSTNAME_ENV = "TOPO_ALIGN_HOSTNAME"
STEPS = 8
BUCKET_CAP_MB = 0.0005
"""About 130 fp32 elements per DDP bucket: the toy model spreads over several buckets."""


class Toy(nn.Module):
    """GPT-shaped: embedding, `layers.N` residual blocks (norm, linear, tanh), head; every parameter
    gets a gradient unless ``skip`` leaves a block out."""

    def __init__(self, d=8, vocab=16, n_layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh())
                                    for _ in range(n_layers))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x, skip: int | None = None):
        h = self.embed(x)
        for i, block in enumerate(self.layers):
            h = h if i == skip else h + block(h)
        return self.lm_head(h)


def make(seed=0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def loss_of(model, step: int, rank: int, micro: int = 0, skip: int | None = None):
    g = torch.Generator().manual_seed(10_000 + 97 * step + 13 * micro + rank)
    x = torch.randint(0, 16, (4, 6), generator=g)
    return nn.functional.cross_entropy(model(x, skip).reshape(-1, 16), ((x * 3 + 1) % 16).reshape(-1))


def cfg_of(mode: str, **local) -> TopoAlignConfig:
    return TopoAlignConfig.model_validate({
        "mode": mode, "topology": {"source": "hostnames"}, "fallback": {"timeout_s": 60.0},
        # fp32 SYNC wire: the hook's buckets are DDP's, so a lossy wire's rounding (fp16: one scale per
        # bucket; error-feedback residuals per bucket) may differ from GroupedReducer's by design
        "sync": {"last_n_layers": 1, "top_fraction": 0.1, "dtype": "fp32"},
        "local": {"reconcile_interval": 2, "async_reconcile": True, **local},
        "importance": {"refresh_interval": 4}, "communication": {"bucket_size_mb": 0.001}})


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# ---------------------------------------------------------------------------- scenarios

def s_exact(rank, groups):
    """flat and hierarchical hook == DDP's own all-reduce, with no_sync accumulation on odd steps;
    `unused`: find_unused_parameters with block 1 skipped on rank 0 at even steps (DDP puts zeros)."""
    from topo_integrations.torch import TopoAlignHookState, topo_align_hook

    out = {}
    for mode in ("flat", "hierarchical", "unused"):
        unused = mode == "unused"
        ref, mine = (DDP(make(), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=unused) for _ in range(2))
        state = TopoAlignHookState(mine, cfg_of("hierarchical" if unused else mode), groups=groups)
        mine.register_comm_hook(state, topo_align_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, mine)]
        rel = []
        for s in range(STEPS):
            for m, opt in zip((ref, mine), opts):
                opt.zero_grad(set_to_none=True)
                if s % 2:
                    with m.no_sync():
                        loss_of(m, s, rank, micro=1).backward()
                loss_of(m, s, rank, skip=1 if unused and rank == 0 and s % 2 == 0 else None).backward()
            ga, gb = (torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (mine, ref))
            rel.append(float((ga - gb).norm() / gb.norm()))  # invariant 3: relative error of the gradient
            for opt in opts:
                opt.step()
            state.after_optimizer_step(opts[1])
        out[mode] = {"grad_rel": max(rel), "param_rel": float((flat(mine) - flat(ref)).norm() / flat(ref).norm()),
                     "buckets": state.stats()["ddp_buckets"], "mode": state.mode}
        state.close()
    return out


def _grouped_clip(model, red, max_norm):
    """GroupedReducer's clipping as the bench trainer does it (the hook's clip_grad_norm_ in numbers)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = red.global_grad_norm_sq(torch.stack([g.double().pow(2).sum() for g in grads]).sum()).sqrt()
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1:
        torch._foreach_mul_(grads, scale)
    return norm


def s_selective(rank, groups):
    """selective: the hook and GroupedReducer give the same parameters step by step (async
    reconciliation, fp32 LOCAL wire, bf16 moment wire, class refresh at step 4, clipping on the
    agreed norm, a state round trip in flight); the invariants hold on every step."""
    from topo_integrations.torch import ConsistencyError, GroupedReducer, TopoAlignHookState, topo_align_hook

    # fp32 LOCAL wire: a 16-bit one rounds each sum once, by the chunk's owner, with error feedback
    # there (lossy_wire.py); the owner of an element follows the bucket layout, which is DDP's here
    # and GroupedReducer's there, so their rounding histories differ by design (as for SYNC, above).
    cfg = cfg_of("selective", dtype="fp32")
    model = make()
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    grouped = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, s, rank).backward()
        red.finish_grad_sync()
        _grouped_clip(model, red, 0.5)
        opt.step()
        red.after_optimizer_step(opt)
        grouped.append(flat(model).clone())
    red.close()

    ddp = DDP(make(), bucket_cap_mb=BUCKET_CAP_MB)
    state = TopoAlignHookState(ddp, cfg, groups=groups)
    ddp.register_comm_hook(state, topo_align_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    local = [n for n, c in state.classify().items() if c == "LOCAL"]
    same, worst, local_differs, norms, errors, class_steps = [], 0.0, False, [], [], set()
    for s in range(STEPS):
        classes = state.classify()
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, s, rank).backward()
        norms.append(float(state.clip_grad_norm_(0.5)))
        opt.step()
        state.after_optimizer_step(opt)
        if state.classify() != classes:
            class_steps.add(s + 1)
        if s == 2:
            state.load_state_dict(state.state_dict())  # an asynchronous average is in flight
        try:
            state.verify_consistency()
        except ConsistencyError as exc:
            errors.append(str(exc))
        p = flat(ddp)
        same.append(bool(torch.equal(p, grouped[s])))
        worst = max(worst, float((p - grouped[s]).abs().max()))
        mods = dict(ddp.module.named_parameters())
        if local and s % 2 == 0:  # between reconciliations LOCAL replicas of the two islands drift
            t = mods[local[0]].detach().reshape(-1)
            everyone = gathered(t)
            local_differs |= not torch.equal(everyone[0], everyone[2])
    state.reconcile(opt)
    everyone = gathered(flat(ddp))
    st = state.stats()
    out = {"same": same, "worst": worst, "errors": errors, "local_differs": local_differs, "norms": norms,
           "all_same_after": all(torch.equal(e, everyone[0]) for e in everyone), "n_local": len(local),
           "reconciles": st["reconciles"], "class_steps": sorted(class_steps),
           "reconcile_bytes": st["total"]["bytes"]["inter"]["reconcile"]}
    state.close()
    # A dropped model goes with its hook state and engine (the state holds the model weakly: DDP's
    # C++ reducer holds the state, and the collector cannot see a cycle through it).
    refs = (weakref.ref(ddp), weakref.ref(state), weakref.ref(state.engine))
    del ddp, state, opt, st
    gc.collect()
    out["dropped_alive"] = [r() is not None for r in refs]
    # A GroupedReducer dropped without close() goes too (its parameter hooks hold it weakly), and its
    # hooks leave the model that stays.
    kept = make()
    red_ref = weakref.ref(GroupedReducer(kept, cfg, groups=groups))
    gc.collect()
    hooks_left = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in kept.parameters())
    out["dropped_reducer"] = (red_ref() is not None, hooks_left)
    return out


def s_refusals(rank, groups):
    from topo_integrations.torch import TopoAlignHookState

    out = {}
    try:
        TopoAlignHookState(make(), cfg_of("hierarchical"), groups=groups)
    except TypeError as exc:
        out["not_ddp"] = str(exc)
    # DDP over ranks 0 and 1 only, the topology groups over all four: refused before any collective
    # (a hook reducing over other ranks than DDP's would mix two data-parallel worlds).
    sub = dist.new_group([0, 1])  # every rank takes part in creating a group
    if rank < 2:
        try:
            TopoAlignHookState(DDP(make(), process_group=sub), cfg_of("hierarchical"), groups=groups)
        except ValueError as exc:
            out["wrong_group"] = str(exc)
    return out


def _rank_main(rank, world):
    from topo_integrations.reducer import build_groups, discover_plan

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    groups = build_groups(discover_plan(cfg_of("selective")), timeout_s=60)
    res = {}
    for name, fn in (("exact", s_exact), ("selective", s_selective), ("refusals", s_refusals)):
        res[name] = fn(rank, groups)
        dist.barrier()
    return res


@pytest.fixture(scope="module")
def world(request):
    # _rank_main, in the suite's shared 4-rank world (the collective-order check is on there: conftest)
    return _world4.results(request, "test_ddp_hook")


# ---------------------------------------------------------------------------- assertions

@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("mode", ["flat", "hierarchical", "unused"])
def test_hook_equals_ddp_allreduce(world, mode):
    for res in world:
        r = res["exact"][mode]
        assert r["mode"] == ("hierarchical" if mode == "unused" else mode)
        assert len(r["buckets"]) > 1, r["buckets"]  # several DDP buckets, is_last on one
        assert r["grad_rel"] <= 1e-6 and r["param_rel"] <= 1e-6, r


@pytest.mark.timeout(_world4.TIMEOUT)
def test_selective_hook_equals_grouped_reducer_bitwise(world):
    for res in world:
        r = res["selective"]
        assert all(r["same"]), (r["same"], r["worst"])
        assert r["reconciles"] >= STEPS // 2
        assert r["reconcile_bytes"] > 0


@pytest.mark.timeout(_world4.TIMEOUT)
def test_selective_invariants_every_step(world):
    for res in world:
        r = res["selective"]
        assert r["n_local"] > 0 and r["local_differs"]
        assert r["errors"] == []  # SYNC identical everywhere, LOCAL inside the island, classes agree
        assert r["all_same_after"]
        # classes move (drift promotion, refresh) at reconciliation steps only, and they do move here
        assert r["class_steps"] and all(s % 2 == 0 for s in r["class_steps"]), r["class_steps"]
    assert all(res["selective"]["norms"] == world[0]["selective"]["norms"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_a_dropped_model_takes_its_hook_state_and_engine(world):
    for res in world:
        assert res["selective"]["dropped_alive"] == [False, False, False]
        assert res["selective"]["dropped_reducer"] == (False, 0)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_refusals_name_what_is_wrong(world):
    assert world[0]["refusals"]["not_ddp"].startswith("TopoAlignHookState needs a "
                                                      "torch.nn.parallel.DistributedDataParallel model, got Toy")
    for res in world[:2]:
        assert res["refusals"]["wrong_group"] == (
            "topo_align: DDP reduces over global ranks [0, 1], the topology groups span [0, 1, 2, 3]; "
            "build DDP with process_group covering the same ranks")
