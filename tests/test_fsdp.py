"""The FSDP2 adapter (topo_integrations/fsdp/) on 4 gloo ranks (2 faked nodes x 2 ranks), with real
``fully_shard`` and the collective-order check on in every rank.

The ranks start once, in the suite's shared 4-rank world (tests/_world4.py); `_rank_main` runs every
scenario and returns what the test functions assert on. The reference is native HSDP as it comes:
the same model ``fully_shard``-ed on the 2-D mesh of `island_mesh` (replicate = islands, shard = the
island's ranks; FSDP2 reduce-scatters and all-reduces with ``ReduceOp.AVG``, which gloo computes right
in torch 2.13); topo-align shards on the island row of that mesh, so both hold the same shards.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import _world4
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from topo_integrations.config import TopoAlignConfig

pytestmark = pytest.mark.multirank

HOSTNAME_ENV = "TOPO_ALIGN_HOSTNAME"
STEPS = 4
VOCAB = 15
"""Odd on purpose: the embedding's 15 rows shard as 8 + 7 (FSDP2 pads the second shard)."""


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, h):
        return h + self.mlp(self.attn(self.norm(h)))


class Net(nn.Module):
    """Llama-shaped and tiny: embedding, `layers.N` blocks, final norm, head."""

    def __init__(self, d: int = 8, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for b in self.layers:
            h = b(h)
        return self.lm_head(self.norm(h))


def cfg_of(mode: str = "selective", **over) -> TopoAlignConfig:
    return TopoAlignConfig.model_validate({"mode": mode, "topology": {"source": "hostnames"},
                                           "fallback": {"timeout_s": 60.0}}).with_overrides(over)


def build(mesh, *, mp=None, prefetch: bool = False, seed: int = 0) -> Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    kw = {"mp_policy": mp} if mp is not None else {}
    for b in model.layers:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=not prefetch, **kw)
    if prefetch:  # explicit prefetching (torchtitan's), root kept unsharded after forward
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
        model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    return model


def loss_of(model, step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 + 97 * step + 13 * micro + rank)
    x = torch.randint(0, VOCAB, (4, 6), generator=g)
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), ((x * 3 + 1) % VOCAB).reshape(-1))


def shards(model, grads: bool = False) -> torch.Tensor:
    from topo_integrations.fsdp.adapter import local_of

    return torch.cat([local_of(p.grad if grads else p).detach().reshape(-1).float() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def inter_sync_bytes(ta) -> int:
    return ta.stats()["total"]["bytes"]["inter"]["sync"]


def pair(groups, mesh, cfg, *, steps=STEPS, opt=torch.optim.AdamW, accum=None, mp=None, prefetch=False, ref_mp=None,
         via_mesh=False):
    """Native HSDP and topo-align side by side for ``steps`` steps: worst relative gradient error of
    the shards, final relative parameter error, and what the adapter saw. ``accum``: a micro-step
    flag ("gradient_sync" / "all_reduce") set off for the first of two micro-steps; ``via_mesh``:
    apply() gets the 2-D mesh (the groups are discovered again) instead of the groups."""
    from topo_integrations.fsdp import apply

    rank = dist.get_rank()
    ref = build(mesh, mp=ref_mp, prefetch=prefetch)
    mine = build(mesh["shard"], mp=mp, prefetch=prefetch)
    ta = apply(mine, mesh if via_mesh else groups, cfg)
    opts = [opt(m.parameters(), lr=0.05) for m in (ref, mine)]
    grad_rel, quiet = [], []
    for s in range(steps):
        for m, o in zip((ref, mine), opts):
            o.zero_grad(set_to_none=True)
            if accum:
                flag = {"gradient_sync": m.set_requires_gradient_sync, "all_reduce": m.set_requires_all_reduce}[accum]
                flag(False)
                before = inter_sync_bytes(ta)
                loss_of(m, s, rank, micro=1).backward()
                if m is mine:
                    quiet.append(inter_sync_bytes(ta) == before)
                flag(True)
            loss_of(m, s, rank).backward()
        grad_rel.append(rel(shards(mine, grads=True), shards(ref, grads=True)))
        for o in opts:
            o.step()
        ta.after_optimizer_step(opts[1])
    st = ta.stats()
    out = {"grad_rel": grad_rel, "param_rel": rel(shards(mine), shards(ref)), "quiet": quiet, "step": ta.step,
           "hook_calls": st["hook_calls"], "deferred": st["deferred"], "sync_dtype": st["sync_dtype"],
           "mode": st["mode"], "inter": st["total"]["bytes"]["inter"]["sync"],
           "intra": st["total"]["bytes"]["intra"]["sync"],
           "residuals": sorted(ta.engine.wire.residual_state())}
    ta.close()
    return out


# ---------------------------------------------------------------------------- scenarios

def s_exact(rank, groups, mesh):
    """hierarchical (fp32 wire) == native HSDP, with the default and with explicit prefetching (and the
    torchtitan-style call: apply() with the mesh)."""
    return {p: pair(groups, mesh, cfg_of("hierarchical"), prefetch=p == "prefetch", via_mesh=p == "prefetch")
            for p in ("default", "prefetch")}


def s_int8(rank, groups, mesh):
    """The default block (every tensor SYNC on the int8 wire) against native HSDP, with and without
    error feedback (SGD: a parameter is the sum of its steps, so the wire's errors add up in it)."""
    return {ef: pair(groups, mesh, cfg_of(**{"communication.error_feedback": ef}), steps=8, opt=torch.optim.SGD)
            for ef in (True, False)}


def s_accum(rank, groups, mesh):
    """Two micro-steps a step with set_requires_gradient_sync / set_requires_all_reduce off for the first."""
    return {a: pair(groups, mesh, cfg_of("hierarchical"), accum=a, steps=3) for a in ("gradient_sync", "all_reduce")}


def s_bf16(rank, groups, mesh):
    """A bf16 reduce dtype: the island sums in fp32 (the custom reduce-scatter), rounded to bf16 once;
    against native HSDP reducing in fp32 (same bf16 compute)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ref_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return pair(groups, mesh, cfg_of("hierarchical"), steps=2, mp=mp, ref_mp=ref_mp)


def _fingerprints(model) -> torch.Tensor:
    from topo_integrations.fsdp.adapter import local_of
    from topo_integrations.torch.consistency import fingerprint

    return torch.stack([fingerprint(local_of(p)) for p in model.parameters()])


def s_selective(rank, groups, mesh):
    """A LOCAL class (top fraction 0.3, asynchronous reconciliation every 2 steps, Adam, clipping on
    the agreed norm): on every step SYNC shards are equal along every rail, LOCAL shards differ
    between islands between reconciliations; after reconcile() every shard is equal along its rail."""
    from topo_integrations.fsdp import apply

    model = build(mesh["shard"])
    ta = apply(model, groups, cfg_of(**{"sync.top_fraction": 0.3, "sync.dtype": "fp32", "sync.last_n_layers": 1}))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    names = [n for n, _ in model.named_parameters()]
    classes = ta.classify()
    sync_ok, local_differs, norms, losses = [], False, [], []
    for s in range(6):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, s, rank)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(ta.clip_grad_norm_(0.5)))
        opt.step()
        ta.after_optimizer_step(opt)
        fp = _fingerprints(model)
        every = [torch.empty_like(fp) for _ in range(4)]
        dist.all_gather(every, fp)
        partner = every[(rank + 2) % 4]  # my rail partner: the same shard in the other island
        same = [torch.equal(fp[i], partner[i]) for i in range(len(names))]
        sync_ok.append(all(same[i] for i, n in enumerate(names) if ta.classify()[n] == "SYNC"))
        local_differs |= not all(same)
    ta.reconcile(opt)
    fp = _fingerprints(model)
    every = [torch.empty_like(fp) for _ in range(4)]
    dist.all_gather(every, fp)
    out = {"sync_ok": sync_ok, "local_differs": local_differs, "norms": norms, "losses": losses,
           "n_local": sum(c == "LOCAL" for c in classes.values()), "reconciles": ta.stats()["reconciles"],
           "all_same_after": torch.equal(fp, every[(rank + 2) % 4]),
           "reconcile_bytes": ta.stats()["total"]["bytes"]["inter"]["reconcile"]}
    ta.close()
    return out


DCP_CFG = {"int8": {}, "local": {"sync.top_fraction": 0.3, "sync.last_n_layers": 1}}
"""The default block (int8 SYNC: its error-feedback residuals must come back), and a LOCAL class
(anchors, moment anchors, reconciliation counters, importance; reconciled before the save)."""


def s_dcp(rank, groups, mesh):
    """DCP: 2 steps, save (model, optimizer, the engine's state), 2 more steps; a fresh model loaded
    from the checkpoint runs the same 2 steps: bitwise the same shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from topo_integrations.fsdp import apply

    def run(m, ta, o, steps):
        for s in steps:
            o.zero_grad(set_to_none=True)
            loss_of(m, s, rank).backward()
            o.step()
            ta.after_optimizer_step(o)

    def fresh(cfg):
        m = build(mesh["shard"])
        return m, apply(m, groups, cfg), torch.optim.AdamW(m.parameters(), lr=0.05)

    out = {}
    for name, over in DCP_CFG.items():
        path = os.path.join(tempfile.gettempdir(), f"topo-align-fsdp-dcp-{os.environ['MASTER_PORT']}-{name}")
        m, ta, o = fresh(cfg_of(**over))
        run(m, ta, o, range(2))
        ta.reconcile(o)  # `selective` with a LOCAL class: identical replicas before saving (no-op otherwise)
        msd, osd = get_state_dict(m, o)
        dcp.save({"model": msd, "optim": osd, "topo_align": ta.checkpoint_state()}, checkpoint_id=path)
        saved = ta.state_dict()["engine"]
        run(m, ta, o, range(2, 4))
        straight = shards(m)
        ta.close()

        m2, ta2, o2 = fresh(cfg_of(**over))
        msd, osd = get_state_dict(m2, o2)
        state = {"model": msd, "optim": osd, "topo_align": ta2.checkpoint_state()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = ta2.state_dict()["engine"]
        res = {"step_after_load": ta2.step, "local": sum(c == "LOCAL" for c in got["classes"].values()),
               "anchors": len(saved["anchors"]), "reconciles": got["reconciles"],
               "residuals_back": sorted(got["residuals"]) == sorted(saved["residuals"]) and
               all(torch.equal(got["residuals"][k], saved["residuals"][k]) for k in saved["residuals"]),
               "residual_norm": float(sum(v.norm() for v in saved["residuals"].values())),
               "anchors_back": sorted(got["anchors"]) == sorted(saved["anchors"]) and
               all(torch.equal(got["anchors"][f]["flat"], saved["anchors"][f]["flat"]) for f in saved["anchors"])}
        run(m2, ta2, o2, range(2, 4))
        res["bitwise"] = torch.equal(shards(m2), straight)
        ta2.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        out[name] = res
    return out


def s_refusals(rank, groups, mesh):
    from topo_integrations.fsdp import apply

    out = {}

    def refused(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            out[key] = str(exc)

    refused("hsdp", lambda: apply(build(mesh), groups, cfg_of("hierarchical")))
    refused("rail_mesh", lambda: apply(build(mesh["replicate"]), groups, cfg_of("hierarchical")))
    refused("flat", lambda: apply(build(mesh["shard"]), groups, cfg_of("flat")))
    refused("bucket", lambda: apply(build(mesh["shard"]), groups,
                                    cfg_of("hierarchical", **{"communication.bucket_size_mb": 5.0})))
    refused("plain", lambda: apply(Net(), groups, cfg_of("hierarchical")))

    def pending():  # the last micro-step ran with set_requires_all_reduce(False): island sums still held
        model = build(mesh["shard"])
        ta = apply(model, groups, cfg_of("hierarchical"))
        model.set_requires_all_reduce(False)
        loss_of(model, 0, rank).backward()
        try:
            ta.after_optimizer_step()
        except RuntimeError as exc:
            out["pending"] = str(exc)
        ta.close()

    pending()
    return out


def _rank_main(rank, world):
    from topo_integrations.fsdp import island_groups, island_mesh

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    groups = island_groups(cfg_of("hierarchical"))
    mesh = island_mesh(groups)
    res = {"rows": mesh.mesh.tolist()}
    for name, fn in (("refusals", s_refusals), ("exact", s_exact), ("accum", s_accum), ("int8", s_int8),
                     ("bf16", s_bf16), ("selective", s_selective), ("dcp", s_dcp)):
        res[name] = fn(rank, groups, mesh)
        dist.barrier()
    return res


@pytest.fixture(scope="module")
def world(request):
    # _rank_main, in the suite's shared 4-rank world (the collective-order check is on there: conftest)
    return _world4.results(request, "test_fsdp")


# ---------------------------------------------------------------------------- assertions

@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("variant", ["default", "prefetch"])
def test_hierarchical_equals_native_hsdp(world, variant):
    assert world[0]["rows"] == [[0, 1], [2, 3]]
    for res in world:
        r = res["exact"][variant]
        assert r["mode"] == "hierarchical" and r["sync_dtype"] == "float32"
        assert max(r["grad_rel"]) <= 1e-6 and r["param_rel"] <= 1e-6, r
        assert r["hook_calls"] == 3 * STEPS  # one per fully_shard module and backward
        assert r["inter"] > 0 and r["residuals"] == []


@pytest.mark.timeout(_world4.TIMEOUT)
def test_int8_wire_with_error_feedback_stays_close(world):
    for res in world:
        ef, no_ef = res["int8"][True], res["int8"][False]
        assert ef["sync_dtype"] == "int8" and ef["residuals"] and not no_ef["residuals"]
        # one int8 rounding of each sent value and one of the owner's sum, blocks of 256 with one fp32
        # scale (at most 1/254 of the block's largest value each), plus the residual carried from the
        # step before: a few percent of the gradient's norm (measured 1.4-2.5 %)
        assert max(ef["grad_rel"]) <= 0.05, ef["grad_rel"]
        # error feedback sends what rounding dropped at the next step, so the parameters (SGD: the
        # sum of the steps) stay closer to the exact run than without it
        assert ef["param_rel"] <= 2e-3 and ef["param_rel"] < no_ef["param_rel"], (ef["param_rel"], no_ef["param_rel"])


@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("flag", ["gradient_sync", "all_reduce"])
def test_gradient_accumulation(world, flag):
    for res in world:
        r = res["accum"][flag]
        assert max(r["grad_rel"]) <= 1e-6 and r["param_rel"] <= 1e-6, r
        assert r["quiet"] == [True] * 3  # nothing crossed islands on the first micro-step
        assert r["step"] == 3
        # set_requires_gradient_sync(False): FSDP2 reduces nothing, no hook; set_requires_all_reduce(False):
        # the hook keeps the island sum (one deferred call per module and micro-step)
        assert r["deferred"] == (9 if flag == "all_reduce" else 0)
        assert r["hook_calls"] == (18 if flag == "all_reduce" else 9)


@pytest.mark.timeout(_world4.TIMEOUT)
def test_bf16_reduce_dtype_sums_in_fp32(world):
    for res in world:
        r = res["bf16"]
        # the engine reduce-scattered inside the island (the custom reduce-scatter) and across it
        assert r["intra"] > 0 and r["inter"] > 0
        # one bf16 rounding of an fp32 sum (2^-9 relative per element) against native fp32 reduction
        assert max(r["grad_rel"]) <= 2 ** -8, r["grad_rel"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_selective_local_class_invariants(world):
    for res in world:
        r = res["selective"]
        assert r["n_local"] > 0 and r["local_differs"]
        assert all(r["sync_ok"]), r["sync_ok"]
        assert r["all_same_after"] and r["reconciles"] >= 3 and r["reconcile_bytes"] > 0
        assert r["losses"][-1] < r["losses"][0]
    assert all(res["selective"]["norms"] == world[0]["selective"]["norms"] for res in world)


@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("cfg", list(DCP_CFG))
def test_dcp_resume_is_bitwise(world, cfg):
    for res in world:
        r = res["dcp"][cfg]
        assert r["step_after_load"] == 2 and r["residuals_back"]
        if cfg == "int8":
            assert r["residual_norm"] > 0
        else:
            assert r["local"] > 0 and r["anchors"] > 0 and r["anchors_back"] and r["reconciles"] >= 2
        assert r["bitwise"]


@pytest.mark.timeout(_world4.TIMEOUT)
def test_refusals_name_what_is_wrong(world):
    adapter = "is not supported by the FSDP2 adapter (topo_integrations.fsdp)"
    r = world[0]["refusals"]
    assert r["hsdp"] == (
        f"topo_align: fully_shard module fsdp0 (FSDPNet) on a 2-D (HSDP) mesh {adapter}: FSDP2 then all-reduces "
        "across replicas itself and calls the all-reduce hook after that; shard on the island: "
        "fully_shard(..., mesh=island_mesh(groups)['shard'])")
    assert r["rail_mesh"] == (
        "topo_align: fully_shard module fsdp0 (FSDPNet) is sharded over global ranks [0, 2], but this rank's "
        "island is [0, 1]; shard with fully_shard(..., mesh=island_mesh(groups)['shard'])")
    assert r["flat"] == (
        f"topo_align: mode = 'flat' {adapter}: the model is sharded inside each island, so the cross-island step "
        "must be the all-reduce of each shard over its rail, which is what 'hierarchical' with an fp32 wire does "
        "(native HSDP's reduction); use mode 'hierarchical' (or 'selective'), or fully_shard(..., "
        "mesh=island_mesh(groups)), the 2-D mesh, without topo-align")
    assert r["bucket"] == (
        f"topo_align: communication.bucket_size_mb = 5.0 {adapter}: FSDP2 reduces one bucket per fully_shard "
        "module (its reduce-scatter output); choose the buckets by the modules you fully_shard and remove the key")
    assert r["plain"] == (
        f"topo_align: a model without fully_shard modules (Net) {adapter}: the adapter hooks FSDP2's "
        "reduce-scatters; call fully_shard(...) on the model first")
    assert r["pending"] == (
        "topo_align: an optimizer step with island-only gradients pending (fsdp0, fsdp1, fsdp2): the last "
        "micro-step's backward must run with set_requires_all_reduce(True)")
