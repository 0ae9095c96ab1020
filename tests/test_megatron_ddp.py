"""TopoAlignDDP on the real megatron-core GPTModel, 4 gloo ranks on CPU, 2 virtual nodes x 2.

The ranks are started once (module fixture); the rank function runs every configuration and
returns plain results that the tests below assert on. Virtual nodes: ``TOPO_ALIGN_HOSTNAME`` is
``node0`` for ranks 0-1 and ``node1`` for ranks 2-3 (the reducer's gathered-hostnames source).
"""

from __future__ import annotations

import os

import pytest

from topo_integrations.testing import run_world

pytestmark = pytest.mark.multirank

WORLD = 4
TOL = 1e-6


def _rel_err(top, ref, dist_opt):
    """||top - ref|| / ||ref|| over main_grad elements the reducer must deliver.

    Plain DDP: every element. Distributed optimizer: the elements of this rank's shard of each
    bucket (what the optimizer reads); compared per parameter, so the reference may be plain DDP.
    """
    ref_params = dict(ref.module.named_parameters())
    num = den = 0.0
    for name, p in top.module.named_parameters():
        buf = next(b for b in top.buffers + top.expert_parallel_buffers if p in b.param_index_map)
        s, e, bid = buf.param_index_map[p]
        t_all, q_all = p.main_grad.reshape(-1), ref_params[name].main_grad.reshape(-1)
        if dist_opt:
            # Megatron shards each bucket over the buffer's group (the optimizer instance).
            intra_rank, L = buf.data_parallel_group.rank(), buf.data_parallel_group.size()
            bucket = buf.buckets[bid]
            n = bucket.grad_data.numel() // L
            lo, hi = bucket.offset + intra_rank * n, bucket.offset + (intra_rank + 1) * n
            a, b = max(s, lo), min(e, hi)
            if a >= b:
                continue
            t, q = t_all[a - s:b - s], q_all[a - s:b - s]
        else:
            t, q = t_all, q_all
        num += float((t.double() - q.double()).pow(2).sum())
        den += float(q.double().pow(2).sum())
    return (num / den) ** 0.5


def _grad_checks(rank, topo_cfg, configs, *, ep=None):
    """Reduced main_grad of TopoAlignDDP vs stock Megatron DDP (no distributed optimizer, K=1).

    ``configs``: name -> (spec, distributed optimizer?, overlap_grad_reduce?, config or None for
    ``topo_cfg``). Every reference and plain-DDP model is built under K=1, then the distributed
    optimizer ones under K=2 (each DDP keeps the process groups it was built with).
    """
    from topo_integrations.megatron.ddp import TopoBucketGroup
    from topo_integrations.megatron.testing import build_gpt, init_parallel, run_iteration, wrap_ddp

    kw = {"expert_model_parallel_size": ep} if ep else {}
    pairs = {}
    for K in (1, 2):
        init_parallel(K, **kw)
        for name, (spec, dist_opt, overlap, cfg) in configs.items():
            if K == 1:
                m1, c1 = build_gpt(spec)
                pairs[name] = [wrap_ddp(m1, c1, overlap_grad_reduce=overlap), None]
            if (K == 2) == dist_opt:
                m2, c2 = build_gpt(spec)
                pairs[name][1] = wrap_ddp(m2, c2, topo=cfg or topo_cfg, use_distributed_optimizer=dist_opt,
                                          overlap_grad_reduce=overlap, num_distributed_optimizer_instances=K)
    out = {}
    for name, (spec, dist_opt, overlap, cfg) in configs.items():
        ref, top = pairs[name]
        errs = []
        for step in range(2):  # step 0: first batch (dispatch at finish); step 1: dispatch from hooks
            run_iteration(ref, spec, rank, step)
            run_iteration(top, spec, rank, step)
            errs.append(_rel_err(top, ref, dist_opt))
        out[name] = {
            "errs": errs, "active": top.topo_active, "reason": top.topo_reason,
            "swapped": sum(isinstance(bg, TopoBucketGroup) for bg in top.bucket_groups),
            "n_groups": len(top.bucket_groups), "n_expert_groups": len(top.expert_parallel_bucket_groups),
            "expert_swapped": sum(isinstance(bg, TopoBucketGroup) for bg in top.expert_parallel_bucket_groups),
            "stats": top.topo_stats()["totals"],
        }
    return out


def _gather_vec(v):
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(out, v)
    return out


def _selective_run(rank, spec, cfg, *, dist_opt, steps=30):
    """(``spec.expert_like`` marks some parameters as expert parameters: own buffers and optimizer.)"""
    """30 steps of selective; invariants 1 and 2 checked on every step."""
    import torch
    import torch.distributed as dist

    from topo_integrations.megatron.testing import build_gpt, init_parallel, make_optimizer, run_iteration, wrap_ddp

    K = 2 if dist_opt else 1
    init_parallel(K)
    m, c = build_gpt(spec)
    ddp = wrap_ddp(m, c, topo=cfg, use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=K)
    opt = make_optimizer(ddp, clip_grad=0.3)
    recs = []
    for step in range(steps):
        r = run_iteration(ddp, spec, rank, step, opt)
        cls = ddp.topo_param_classes()
        named = list(ddp.module.named_parameters())
        sv = torch.cat([p.detach().reshape(-1) for n, p in named if cls[n] == "SYNC"])
        lv = torch.cat([p.detach().reshape(-1) for n, p in named if cls[n] == "LOCAL"])
        gs, gl = _gather_vec(sv), _gather_vec(lv)
        # fp32 main params the optimizer steps on (views of the params here; compared anyway)
        agreed = [None] * WORLD
        dist.all_gather_object(agreed, (r["ok"], r["grad_norm"], sorted(cls.items()),
                                        [len(bg.buckets) for bg in ddp.bucket_groups]))
        recs.append({
            "loss": r["loss"],
            "sync_all_same": all(torch.equal(gs[0], x) for x in gs),
            "local_same_in_group": torch.equal(gl[0], gl[1]) and torch.equal(gl[2], gl[3]),
            "all_same": all(torch.equal(gs[0], x) for x in gs) and all(torch.equal(gl[0], x) for x in gl),
            "norm_same": len({(a[0], a[1]) for a in agreed}) == 1,
            "skip_same": len({a[0] for a in agreed}) == 1,
            "classes_same": len({str(a[2]) for a in agreed}) == 1,
            "buckets_same": len({str(a[3]) for a in agreed}) == 1,
            "clipped": r["grad_norm"] is not None and r["grad_norm"] > 0.3,
            "reconciled": ddp.topo_step % cfg.local.reconcile_interval == 0,
            "n_sync": sum(v == "SYNC" for v in cls.values()),
        })
    from topo_integrations.megatron.ddp import TopoBucketGroup

    return {"recs": recs, "stats": ddp.topo_stats()["totals"], "n_params": len(cls),
            "n_sub_optimizers": len(getattr(opt, "chained_optimizers", [opt])),
            "last_refresh": ddp.topo_engines[0].policy.last_refresh,
            "fisher_updates": ddp.topo_engines[0].importance.updates,
            "expert_swapped": sum(isinstance(bg, TopoBucketGroup) for bg in ddp.expert_parallel_bucket_groups)}


def _invariants(ddp, r):
    """Invariants 1 and 2 of this step, agreed over the 4 ranks (plain values)."""
    import torch
    import torch.distributed as dist

    cls = ddp.topo_param_classes()
    named = list(ddp.module.named_parameters())
    parts = {c: [p.detach().reshape(-1) for n, p in named if cls[n] == c] for c in ("SYNC", "LOCAL")}
    sv = torch.cat(parts["SYNC"]) if parts["SYNC"] else torch.zeros(0)
    lv = torch.cat(parts["LOCAL"]) if parts["LOCAL"] else torch.zeros(0)
    gs, gl = _gather_vec(sv), _gather_vec(lv)
    agreed = [None] * WORLD
    dist.all_gather_object(agreed, (r.get("ok"), r.get("grad_norm"), sorted(cls.items())))
    return {"sync_all_same": all(torch.equal(gs[0], x) for x in gs),
            "local_same_in_group": torch.equal(gl[0], gl[1]) and torch.equal(gl[2], gl[3]),
            "all_same": all(torch.equal(gs[0], x) for x in gs) and all(torch.equal(gl[0], x) for x in gl),
            "agreed": len({str(a) for a in agreed}) == 1, "n_sync": sum(v == "SYNC" for v in cls.values()),
            "loss": r["loss"]}


def _auto_many_islands(rank, spec, *, dist_opt):
    """Issue 31: Megatron DDP with the `sync` keys left at `auto` on 4 islands of one rank (the
    engine's group count, not a flag, decides): int8 and every tensor SYNC, so every parameter is
    bitwise equal on every rank after every step (invariant 1) and nothing is reconciled."""
    import torch

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron.testing import build_gpt, init_parallel, make_optimizer, run_iteration, wrap_ddp

    os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank}"
    try:
        K = 4 if dist_opt else 1  # one distributed-optimizer instance per group (one rank each)
        init_parallel(K)
        m, c = build_gpt(spec)
        cfg = TopoAlignConfig.model_validate({"mode": "selective"})  # the defaults: sync keys `auto`
        ddp = wrap_ddp(m, c, topo=cfg, use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=K)
        opt = make_optimizer(ddp, clip_grad=0.3)
        recs = []
        for step in range(6):
            r = run_iteration(ddp, spec, rank, step, opt)
            v = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
            recs.append({"all_same": all(torch.equal(v, x) for x in _gather_vec(v)), "loss": r["loss"]})
        e = ddp.topo_engines[0]
        return {"recs": recs, "dtype": e.cfg.sync.dtype, "top": e.cfg.sync.top_fraction,
                "groups": e.groups.inter_size, "classes": sorted(set(ddp.topo_param_classes().values())),
                "reconcile_bytes": sum(t["bytes"] for t in ddp.topo_stats()["totals"].get("reconcile", {}).values())}
    finally:
        os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank // 2}"


class _Spy:
    """Every torch.distributed collective on a topo_align group handle must be issued inside
    ``collectives.run`` (a thread-local flag set by a wrapper), and all of them from the dispatcher's
    thread when the engine has one (one issuing thread: the ordering rule, reducer/schedule/dispatch.py)."""

    OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_gather",
           "all_to_all_single")

    def __init__(self, ddp):
        import threading

        import torch.distributed as dist

        from topo_integrations.reducer.wire import collectives as C

        self.C, self.dist, self.tl = C, dist, threading.local()
        self.worker = any(e.dispatcher.threaded for e in ddp.topo_engines)
        gs = ddp.topo_group_set.all()
        kinds = ("intra", "inter", "intra_low", "inter_low", "leaf_rail", "spine_rail", "leaf_rail_low",
                 "spine_rail_low", "dp_group")
        self.handles = [h for g in gs for h in (getattr(g, k, None) for k in kinds) if h is not None]
        self.low = [h for g in gs for h in (getattr(g, k, None) for k in kinds if k.endswith("_low")) if h is not None]
        self.outside, self.wrong_thread, self.seen = [], [], 0
        self.saved = {("C", "run"): C.run, ("C", "_all_gather"): C._all_gather,
                      ("C", "_reduce_scatter"): C._reduce_scatter}
        self.saved.update({("dist", op): getattr(dist, op) for op in self.OPS})

    def __enter__(self):
        import threading

        orig_run = self.saved[("C", "run")]

        def run(*a, **k):
            prev = getattr(self.tl, "on", False)
            self.tl.on = True
            try:
                return orig_run(*a, **k)
            finally:
                self.tl.on = prev

        def wrap(fn, name):
            def spied(*a, **k):
                g = k.get("group")
                if g is not None and any(g is h for h in self.handles):
                    self.seen += 1
                    if not getattr(self.tl, "on", False):
                        self.outside.append(name)
                    if self.worker and not threading.current_thread().name.startswith("topo_align_dispatch"):
                        self.wrong_thread.append((name, threading.current_thread().name))
                return fn(*a, **k)
            return spied

        # modules that bound the function by name at import (imported before C.run is replaced, or
        # they would bind the wrapper)
        from topo_integrations.reducer.adaptive import adaptive
        from topo_integrations.reducer.wire import health

        self.C.run = run
        self.bound = [(m, n) for m in (adaptive, health) for n in ("run", "_run") if getattr(m, n, None) is orig_run]
        for m, n in self.bound:
            setattr(m, n, run)
        self.C._all_gather = wrap(self.saved[("C", "_all_gather")], "all_gather")
        self.C._reduce_scatter = wrap(self.saved[("C", "_reduce_scatter")], "reduce_scatter")
        for op in self.OPS:
            setattr(self.dist, op, wrap(self.saved[("dist", op)], op))
        return self

    def __exit__(self, *exc):
        self.C.run = self.saved[("C", "run")]
        for m, n in self.bound:
            setattr(m, n, self.saved[("C", "run")])
        self.C._all_gather = self.saved[("C", "_all_gather")]
        self.C._reduce_scatter = self.saved[("C", "_reduce_scatter")]
        for op in self.OPS:
            setattr(self.dist, op, self.saved[("dist", op)])


def _engine_run(rank, spec, cfg, **kw):
    """`_one_engine_run`, its groups destroyed after it (topo_integrations.testing.released_groups)."""
    from megatron.core import parallel_state

    from topo_integrations.megatron.testing import released_ddps
    from topo_integrations.testing import released_groups

    with released_groups(keep_held_by=(parallel_state,)), released_ddps():
        return _one_engine_run(rank, spec, cfg, **kw)


def _one_engine_run(rank, spec, cfg, *, dist_opt, steps, spy=False, at_step=None, overlap=True):
    """``steps`` optimizer steps with the invariants after each; ``at_step(step, ddp, opt)`` runs
    before a step; then a forced blocking reconciliation (everything equal afterwards). Every step
    also records when its gradient collectives were released (`ReleaseProbe`)."""
    from topo_integrations.megatron.testing import (
        ReleaseProbe,
        build_gpt,
        init_parallel,
        make_optimizer,
        run_iteration,
        wrap_ddp,
    )

    K = 2 if dist_opt else 1
    init_parallel(K)
    m, c = build_gpt(spec)
    ddp = wrap_ddp(m, c, topo=cfg, use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=K,
                   overlap_grad_reduce=overlap)
    opt = make_optimizer(ddp, clip_grad=0.3)
    recs, releases, s = [], [], None
    probe = ReleaseProbe(ddp)
    if spy:
        s = _Spy(ddp).__enter__()
    try:
        for step in range(steps):
            if at_step is not None:
                at_step(step, ddp, opt)
            probe.start()
            r = run_iteration(ddp, spec, rank, step, opt)
            releases.append(probe.step())
            recs.append(_invariants(ddp, r))
        ddp.topo_reconcile(opt)
    finally:
        if s is not None:
            s.__exit__()
    final = _invariants(ddp, {"loss": None})
    e = ddp.topo_engines[0]
    out = {"recs": recs, "releases": releases, "final_all_same": final["all_same"],
           "max_staleness": e.reconciler.max_staleness,
           "reconciles": e.reconciler.reconciles, "promoted": list(e.drift.promoted), "sync_dtype": str(e.sync_dtype),
           "interval": e.reconciler.interval, "classes_version": e.class_version,
           "level": None if e.adaptive is None else e.adaptive.level,
           "hutchinson_refreshes": e.importance.hutchinson_seed, "stats": ddp.topo_stats()["totals"],
           "moments_residuals": sorted(k for k in e.wire.residual_state() if k.startswith("moments/")),
           "method_events": None if e.method is None else [(x["step"], x["method"], x["reconcile_interval"])
                                                           for x in e.method.events]}
    if s is not None:
        out.update(spy_seen=s.seen, spy_outside=s.outside, spy_wrong_thread=s.wrong_thread[:5],
                   worker=s.worker)
    ddp.topo_close()
    return out


def _force_level(name):
    """at_step hook: put every engine's adaptive controller at level ``name`` before step 2."""
    def hook(step, ddp, opt):
        if step != 2:
            return
        for e in ddp.topo_engines:
            ctrl = e.adaptive
            new = ctrl.policy.available.index(name)
            old, ctrl.policy.level = ctrl.policy.level, new
            ctrl._apply(old, new, opt)
    return hook


def _method_auto_run(rank, spec, *, dist_opt, real=False):
    """`method: auto` with DP position 0's verdict fixed: a LOCAL class with H 2 from step 5, the exact
    method again from the re-choice before step 8; whether every parameter is equal right after it.
    ``real``: the real chooser instead, 6 steps (its choice and log line)."""
    from _forced_choice import RECHOICE_STEP, STEPS, auto_block, forced_method_choices, rechoose

    from topo_integrations.config import TopoAlignConfig

    cfg = TopoAlignConfig.model_validate(auto_block())
    if real:
        lines = []

        def keep(step, ddp, opt):
            if step == 5:
                lines.extend(e.method.events[0]["line"] for e in ddp.topo_engines)
        return {**_engine_run(rank, spec, cfg, dist_opt=dist_opt, steps=6, at_step=keep), "lines": lines}
    after: list = []

    def at_step(step, ddp, opt):
        if step == RECHOICE_STEP:
            for e in ddp.topo_engines:
                rechoose(e)
            after.append(_invariants(ddp, {"loss": None})["all_same"])

    with forced_method_choices(("local", 2), ("hierarchical", None)):
        out = _engine_run(rank, spec, cfg, dist_opt=dist_opt, steps=STEPS, at_step=at_step)
    return {**out, "equal_after_rechoice": after}


def _engine_checks(rank, spec):
    from topo_integrations.config import TopoAlignConfig

    base = {"mode": "selective", "sync": {"last_n_layers": 1, "top_fraction": 0.15},
            "local": {"reconcile_interval": 2, "async_reconcile": True}, "importance": {"refresh_interval": 1000}}

    def cfg(**over):
        import copy

        b = copy.deepcopy(base)
        for k, v in over.items():
            b[k] = {**b.get(k, {}), **v} if isinstance(v, dict) else v
        return TopoAlignConfig.model_validate(b)

    out = {}
    out["async_plain"] = _engine_run(rank, spec, cfg(), dist_opt=False, steps=7, spy=True)
    # SYNC = the last layer only: the LOCAL buckets of the earlier layers go during backward
    # (no drift promotion: it would move tensors of any bucket to SYNC)
    out["last_layer_overlap_plain"] = _engine_run(
        rank, spec, cfg(sync={"top_fraction": 0.0}, local={"promote_drift_fraction": 0.0}), dist_opt=False, steps=4)
    out["no_overlap_plain"] = _engine_run(rank, spec, cfg(), dist_opt=False, steps=4, overlap=False)
    out["adaptive_plain"] = _engine_run(rank, spec, cfg(adaptive={"enabled": True, "check_interval": 10_000},
                                                        sync={"dtype": "fp32"}),  # fp16 level: from fp32 only
                                        dist_opt=False, steps=7, at_step=_force_level("fp16"))
    # the controller measuring for real (probe + agreement every 2 steps) while averages are in flight
    out["adaptive_checks_plain"] = _engine_run(rank, spec, cfg(adaptive={"enabled": True, "check_interval": 2}),
                                               dist_opt=False, steps=7, spy=True)
    # the bf16 SYNC wire here, the int8 one (auto at 2 groups) with the distributed optimizer below
    out["drift_plain"] = _engine_run(rank, spec, cfg(local={"promote_drift_fraction": 0.3}, sync={"dtype": "bf16"}),
                                     dist_opt=False, steps=6)
    out["hutchinson_plain"] = _engine_run(
        rank, spec, cfg(importance={"method": "hutchinson", "refresh_interval": 2}, sync={"top_fraction": 0.3}),
        dist_opt=False, steps=5)
    out["method_auto_plain"] = _method_auto_run(rank, spec, dist_opt=False)
    out["method_auto_real"] = _method_auto_run(rank, spec, dist_opt=False, real=True)
    out["async_distopt"] = _engine_run(rank, spec, cfg(), dist_opt=True, steps=7, spy=True)
    out["method_auto_distopt"] = _method_auto_run(rank, spec, dist_opt=True)
    out["adaptive_distopt"] = _engine_run(rank, spec, cfg(adaptive={"enabled": True, "check_interval": 10_000},
                                                          sync={"dtype": "fp32"}),  # fp16 level: from fp32 only
                                          dist_opt=True, steps=7, at_step=_force_level("fp16"))
    # with the int8 SYNC wire set explicitly (the distributed optimizer's rail hop of the SYNC ranges)
    out["drift_distopt"] = _engine_run(rank, spec, cfg(local={"promote_drift_fraction": 0.3}, sync={"dtype": "int8"}),
                                       dist_opt=True, steps=6)
    # issue 31: one fragment of the LOCAL set a step, promotion over 2 intervals with demotion
    out["stream_distopt"] = _engine_run(
        rank, spec, cfg(local={"stream_fragments": 2, "promote_window": 2, "demote": True,
                               "promote_drift_fraction": 0.3}), dist_opt=True, steps=7)
    out["delta_distopt"] = _engine_run(
        rank, spec, cfg(local={"reconcile_dtype": "bf16", "moments_interval": 2, "moments_dtype": "bf16",
                               "outer_momentum": 0.5}),
        dist_opt=True, steps=7)
    return out


def _skip_run(rank, spec, cfg):
    """bf16 + constant loss scale: a NaN in one group's LOCAL gradient must skip the step everywhere."""
    import torch
    import torch.distributed as dist

    from topo_integrations.megatron.testing import build_gpt, init_parallel, make_optimizer, run_iteration, wrap_ddp

    init_parallel(1)
    m, c = build_gpt(spec)
    ddp = wrap_ddp(m, c, topo=cfg, grad_reduce_in_fp32=True)
    opt = make_optimizer(ddp, bf16=True, loss_scale=1.0)
    local = next(p for n, p in ddp.module.named_parameters() if ddp.topo_param_classes()[n] == "LOCAL")

    def poison(d):
        if rank >= 2:  # group 1 only
            local.main_grad.view(-1)[0] = float("nan")

    oks = []
    for step in range(4):
        r = run_iteration(ddp, spec, rank, step, opt, before_step=poison if step == 2 else None)
        oks.append(r["ok"])
    vec = torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()])
    finite = bool(torch.isfinite(vec).all())
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, oks)
    return {"oks": oks, "all_oks": everyone, "finite": finite}


def _checkpoint_run(rank, spec, cfg):
    """Plain-DDP selective: save at a non-reconciliation step, resume in a fresh model, compare."""
    import torch
    import torch.distributed as dist

    from topo_integrations.megatron.ddp import prepare_checkpoint
    from topo_integrations.megatron.testing import build_gpt, init_parallel, make_optimizer, run_iteration, wrap_ddp

    def fresh():
        m, c = build_gpt(spec)
        ddp = wrap_ddp(m, c, topo=cfg)
        return ddp, make_optimizer(ddp, clip_grad=0.3)

    def params(ddp):
        return torch.cat([p.detach().reshape(-1).clone() for p in ddp.module.parameters()])

    init_parallel(1)
    save_after, total = 5, 9  # steps 0..5, save (after 6 steps: not a reconciliation step), steps 6..8
    a, opt_a = fresh()
    for step in range(save_after + 1):
        run_iteration(a, spec, rank, step, opt_a)
    states = prepare_checkpoint([a], opt_a)  # reconciles first
    def snapshot(obj):  # what a checkpoint file holds: a copy, not references to live tensors
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    replica0 = [snapshot(a.module.state_dict()), snapshot(opt_a.state_dict())] if rank == 0 else [None, None]
    states = snapshot(states)
    dist.broadcast_object_list(replica0, src=0)  # every rank resumes from replica 0's files
    after_save_all_same = all(torch.equal(x, params(a)) for x in _gather_vec(params(a)))
    for step in range(save_after + 1, total):
        run_iteration(a, spec, rank, step, opt_a)
    final_a = params(a)

    results = {"after_save_all_same": after_save_all_same}
    for variant in ("with_state", "without_state"):
        b, opt_b = fresh()
        b.module.load_state_dict(replica0[0])
        opt_b.load_state_dict(replica0[1])
        if variant == "with_state":
            b.load_topo_state_dict(states[0])
        for step in range(save_after + 1, total):
            run_iteration(b, spec, rank, step, opt_b)
        results[variant] = torch.equal(params(b), final_a)
    results["state_keys"] = sorted(states[0])
    results["has_residuals"] = any(e["residuals"] for e in states[0]["engines"])
    return results


def _errors(rank, spec):
    """Misconfigurations end in one clear error, on every rank."""
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron.testing import build_gpt, init_parallel, wrap_ddp

    out = {}
    init_parallel(1)
    m, c = build_gpt(spec)
    try:
        wrap_ddp(m, c, topo=TopoAlignConfig.model_validate({"mode": "hierarchical"}), use_distributed_optimizer=True)
        out["distopt_k1"] = None
    except ValueError as exc:
        out["distopt_k1"] = str(exc)
    return out


def _fallbacks(rank, spec, tmpdir):
    """Stock behaviour: no config, mode flat, enabled false, one-node topology."""
    import json

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron.ddp import TopoBucketGroup
    from topo_integrations.megatron.testing import build_gpt, init_parallel, run_iteration, wrap_ddp

    one_node = os.path.join(tmpdir, "one-node.json")
    if rank == 0:
        with open(one_node, "w") as fh:
            json.dump({"format": "topo-align/topology/v1", "name": "one-node", "gpus_per_node": 4,
                       "leaves": [{"name": "leaf0", "hosts": "solo"}]}, fh)
    import torch.distributed as dist

    dist.barrier()
    cases = {
        "no_config": None,
        "flat": TopoAlignConfig.model_validate({"mode": "flat"}),
        "disabled": TopoAlignConfig.model_validate({"enabled": False, "mode": "hierarchical"}),
        "one_node": TopoAlignConfig.model_validate({"mode": "hierarchical",
                                                    "topology": {"source": "file", "file": one_node}}),
    }
    out = {}
    init_parallel(1)
    for name, cfg in cases.items():
        m1, c1 = build_gpt(spec)
        ref = wrap_ddp(m1, c1)
        m2, c2 = build_gpt(spec)
        from topo_integrations.megatron.ddp import TopoAlignDDP

        top = wrap_ddp(m2, c2, topo=cfg, cls=TopoAlignDDP)
        run_iteration(ref, spec, rank, 0)
        run_iteration(top, spec, rank, 0)
        out[name] = {"active": top.topo_active, "reason": top.topo_reason,
                     "swapped": any(isinstance(bg, TopoBucketGroup) for bg in top.bucket_groups),
                     "err": _rel_err(top, ref, False)}
    return out


def _rank_main(rank, world, tmpdir):
    os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank // 2}"
    import time

    from topo_integrations.megatron import cpu_compat

    assert cpu_compat.apply()
    from megatron.core import parallel_state

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron.testing import TinyGPT, released_ddps
    from topo_integrations.testing import released_groups

    spec = TinyGPT()
    res, timings = {}, {}

    def section(name, fn, *args, **kw):
        # Each section's engines and their groups go away with it (megatron-core keeps its current
        # parallel state's groups): idle gloo groups cost CPU (topo_integrations.testing.released_groups).
        t0 = time.time()
        with released_groups(keep_held_by=(parallel_state,), older_too=True), released_ddps():
            res[name] = fn(*args, **kw)
        timings[name] = round(time.time() - t0, 1)

    hier = TopoAlignConfig.model_validate({"mode": "hierarchical"})
    sel_all = TopoAlignConfig.model_validate({"mode": "selective", "sync": {"top_fraction": 1.0, "dtype": "fp32"}})
    sel_none = TopoAlignConfig.model_validate({"mode": "selective", "sync": {"last_n_layers": 0, "always_sync": [],
                                                                             "top_fraction": 0.0}})
    expert_spec = TinyGPT(expert_like=("layers.0.mlp",))
    # Ordered so that megatron-core's parallel state is rebuilt as rarely as possible.
    section("grads", _grad_checks, rank, hier, {
        "plain_sync": (spec, False, False, None),
        "plain_overlap": (spec, False, True, None),
        "distopt_sync": (spec, True, False, None),
        "distopt_overlap": (spec, True, True, None),
        "selective_tf1_plain": (spec, False, True, sel_all),
        "selective_tf1_distopt": (spec, True, True, sel_all),
        "negative_all_local": (spec, False, True, sel_none),
        # expert buffers over the whole data-parallel group (parameters marked allreduce=False)
        "expert_like_plain": (expert_spec, False, True, None),
        "expert_like_distopt": (expert_spec, True, True, None),
    })
    sel = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "top_fraction": 0.15},
        "local": {"reconcile_interval": 4, "async_reconcile": False}, "importance": {"refresh_interval": 8}})
    section("selective_distopt", _selective_run, rank, expert_spec, sel, dist_opt=True)
    moe_spec = TinyGPT(extra={"num_moe_experts": 2, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
                              "add_bias_linear": False, "expert_model_parallel_size": 2})
    section("moe", _grad_checks, rank, hier, {"moe_distopt": (moe_spec, True, True, None)}, ep=2)
    section("engine", _engine_checks, rank, spec)
    section("selective_plain", _selective_run, rank, spec, sel, dist_opt=False)
    section("checkpoint", _checkpoint_run, rank, spec, sel)
    section("checkpoint_async", _checkpoint_run, rank, spec, sel.with_overrides({"local.async_reconcile": True}))
    import torch

    section("skip", _skip_run, rank, TinyGPT(extra={"bf16": True, "params_dtype": torch.bfloat16}), sel)
    section("auto_many_islands", lambda: {d: _auto_many_islands(rank, spec, dist_opt=d) for d in (False, True)})
    section("errors", _errors, rank, spec)
    section("fallbacks", _fallbacks, rank, spec, tmpdir)
    res["timings"] = timings
    return res


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("megatron"))
    # Most of the time goes to importing megatron-core in 4 processes on 2 shared cores.
    results = run_world(WORLD, _rank_main, tmpdir, timeout=900,
                        env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    print("megatron world timings (rank 0, s):", results[0]["timings"])
    return results


GRAD_CASES = ["plain_sync", "plain_overlap", "distopt_sync", "distopt_overlap"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", GRAD_CASES)
def test_hierarchical_main_grad_equals_stock_megatron(world, case):
    for rank, res in enumerate(world):
        r = res["grads"][case]
        assert r["active"], r["reason"]
        assert r["swapped"] == r["n_groups"] > 0
        assert max(r["errs"]) <= TOL, (rank, case, r["errs"])
        assert "inter" in r["stats"]["sync"] and "intra" in r["stats"]["sync"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["selective_tf1_plain", "selective_tf1_distopt"])
def test_selective_with_top_fraction_1_equals_hierarchical(world, case):
    for res in world:
        assert max(res["grads"][case]["errs"]) <= TOL


@pytest.mark.timeout(960)
def test_grad_comparison_detects_group_only_reduction(world):
    # Negative control: everything LOCAL reduces inside the group only, so it differs from stock.
    for res in world:
        assert min(res["grads"]["negative_all_local"]["errs"]) > 1e-3


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["expert_like_plain", "expert_like_distopt"])
def test_hierarchical_expert_buffers(world, case):
    for res in world:
        r = res["grads"][case]
        assert r["n_expert_groups"] > 0 and r["expert_swapped"] == r["n_expert_groups"]
        assert max(r["errs"]) <= TOL, r["errs"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["moe_distopt"])
def test_moe_dense_and_expert_parameters(world, case):
    for res in world:
        r = res["moe"][case]
        assert r["n_expert_groups"] > 0  # expert buffers exist (EP=2)
        # expert data-parallel groups hold one rank per node here: they keep Megatron's reduction
        assert r["expert_swapped"] == 0
        assert r["swapped"] == r["n_groups"] > 0
        assert max(r["errs"]) <= TOL, r["errs"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["selective_distopt", "selective_plain"])
def test_selective_invariants_every_step(world, case):
    recs = [res[case]["recs"] for res in world]
    for rank_recs in recs:
        assert len(rank_recs) == 30
        for step, r in enumerate(rank_recs):
            assert r["sync_all_same"], (step, r)          # invariant 1: SYNC bitwise equal everywhere
            assert r["local_same_in_group"], (step, r)    # invariant 1: LOCAL equal inside each group
            assert r["norm_same"] and r["skip_same"], (step, r)  # invariant 2: clip norm and skip agree
            assert r["classes_same"] and r["buckets_same"], (step, r)
            if r["reconciled"]:
                assert r["all_same"], (step, r)           # invariant 1: everything equal after reconcile
    r0 = recs[0]
    if case == "selective_distopt":  # dense + expert optimizers (chained), expert buffers reduced by us
        assert world[0][case]["n_sub_optimizers"] == 2 and world[0][case]["expert_swapped"] > 0
    assert sum(r["reconciled"] for r in r0) == 7
    assert any(not r["all_same"] for r in r0)  # positive control: LOCAL replicas did drift in between
    assert sum(r["clipped"] for r in r0) >= 5  # clipping was active, so agreement mattered
    # fisher scores were observed from the bucket groups and the classes were re-ranked on them
    # (steps 8, 16, 24; the engine starts from agreed magnitude ranks, which may already be the same set)
    assert world[0][case]["last_refresh"] == 24 and world[0][case]["fisher_updates"] > 0


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["selective_distopt", "selective_plain"])
def test_selective_loss_decreases(world, case):
    losses = [r["loss"] for r in world[0][case]["recs"]]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses


@pytest.mark.timeout(960)
def test_selective_sends_less_across_groups(world):
    for case in ("selective_distopt", "selective_plain"):
        st = world[0][case]["stats"]
        assert st["sync"]["inter"]["bytes"] > 0
        assert "inter" not in st.get("local", {})  # LOCAL gradients never cross the slow tier
        assert st["reconcile"]["inter"]["bytes"] > 0


@pytest.mark.timeout(960)
def test_overflow_skip_agrees_across_groups(world):
    for res in world:
        assert res["skip"]["all_oks"] == [[True, True, False, True]] * WORLD
        assert res["skip"]["finite"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["checkpoint", "checkpoint_async"])
def test_checkpoint_reconciles_and_carries_reducer_state(world, case):
    for res in world:
        ck = res[case]
        assert ck["after_save_all_same"]  # save reconciled: replica 0's files hold every parameter
        assert ck["has_residuals"] and "classes" in ck["state_keys"] and "step" in ck["state_keys"]
        assert ck["with_state"], "resume from replica 0 + plugin state must equal not stopping"
    # Without the plugin state (step counter, classes, residuals) the resumed run differs.
    assert not all(res[case]["without_state"] for res in world)


@pytest.mark.timeout(960)
def test_distributed_optimizer_needs_one_instance_per_group(world):
    for res in world:
        msg = res["errors"]["distopt_k1"]
        assert msg is not None
        assert "num_distributed_optimizer_instances must equal the number of topology groups: it is 1" in msg
        assert "--num-distributed-optimizer-instances 2" in msg


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["no_config", "flat", "disabled", "one_node"])
def test_stock_when_off_flat_or_one_tier(world, case):
    for res in world:
        r = res["fallbacks"][case]
        assert not r["active"] and not r["swapped"]
        assert r["err"] == 0.0  # bit-identical to stock DDP
    if case == "one_node":
        assert "single tier" in world[0]["fallbacks"][case]["reason"] or \
            "holds all" in world[0]["fallbacks"][case]["reason"]


ENGINE_CASES = ["async_plain", "async_distopt", "adaptive_plain", "adaptive_distopt", "drift_plain", "drift_distopt",
                "hutchinson_plain", "delta_distopt", "adaptive_checks_plain", "last_layer_overlap_plain",
                "no_overlap_plain", "stream_distopt"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_features_keep_invariants_every_step(world, case):
    for res in world:
        r = res["engine"][case]
        for step, rec in enumerate(r["recs"]):
            assert rec["sync_all_same"] and rec["local_same_in_group"] and rec["agreed"], (case, step, rec)
        assert r["final_all_same"], case  # forced blocking reconciliation: everything equal
    r0 = world[0]["engine"][case]
    assert any(not rec["all_same"] for rec in r0["recs"]), case  # positive control: LOCAL did drift


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["async_plain", "async_distopt"])
def test_async_reconcile_overlaps_with_staleness_one(world, case):
    for res in world:
        r = res["engine"][case]
        assert r["max_staleness"] == 1  # the correction of step s lands after step s + 1
        assert r["reconciles"] >= 4  # steps 2, 4, 6 asynchronously + the forced one
        assert r["stats"]["reconcile"]["inter"]["bytes"] > 0
        assert "inter" not in r["stats"].get("local", {})


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["async_plain", "async_distopt", "adaptive_checks_plain"])
def test_every_collective_on_topo_groups_goes_through_collectives_run(world, case):
    for res in world:
        r = res["engine"][case]
        assert r["worker"] and r["spy_seen"] > 0
        assert r["spy_outside"] == [], r["spy_outside"][:5]
        assert r["spy_wrong_thread"] == [], r["spy_wrong_thread"]  # one issuing thread: the dispatcher's


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["adaptive_plain", "adaptive_distopt"])
def test_adaptive_level_applies_to_megatron_reduction(world, case):
    for res in world:
        r = res["engine"][case]
        assert r["level"] == "fp16" and r["sync_dtype"] == "torch.float16"
        assert r["interval"] == 8  # the reconcile level (4 x 2) accumulates under fp16


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["drift_plain", "drift_distopt"])
def test_drift_promotion_moves_tensors_to_sync(world, case):
    promoted = {str(res["engine"][case]["promoted"]) for res in world}
    assert len(promoted) == 1 and world[0]["engine"][case]["promoted"]
    r0 = world[0]["engine"][case]["recs"]
    assert r0[-1]["n_sync"] > r0[0]["n_sync"]
    assert world[0]["engine"][case]["sync_dtype"] == ("torch.int8" if case == "drift_distopt" else "torch.bfloat16")


@pytest.mark.timeout(960)
def test_moment_shards_average_on_the_bf16_delta_wire(world):
    """delta_distopt sets local.moments_dtype bf16: after the first exact moment average the
    distributed optimizer's moment shards crossed as deltas with error feedback (residuals kept per
    chunk); fp32 moments (async_distopt) keep none. Invariants: test_engine_features_keep_invariants."""
    for res in world:
        assert res["engine"]["delta_distopt"]["moments_residuals"], res["engine"]["delta_distopt"]
        assert res["engine"]["async_distopt"]["moments_residuals"] == []


@pytest.mark.timeout(960)
def test_hutchinson_refresh_from_the_captured_megatron_loss(world):
    for res in world:
        r = res["engine"]["hutchinson_plain"]
        assert r["hutchinson_refreshes"] >= 2  # refreshes at steps 2 and 4 differentiated the model's loss


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["async_plain", "last_layer_overlap_plain"])
def test_local_buckets_leave_during_backward_with_overlap(world, case):
    """--overlap-grad-reduce: every LOCAL bucket is released before Megatron's finish_grad_sync
    (right after the step's last bucket group with SYNC work), never before a SYNC bucket of the
    step. Step 0 is Megatron's first batch: everything is submitted in finish_grad_sync."""
    for res in world:
        rel = res["engine"][case]["releases"]
        assert rel[0]["local"] > 0 and rel[0]["local_released_before"] == 0, rel[0]
        assert all(r["local"] > 0 for r in rel), rel  # (drift promotion may move some LOCAL to SYNC)
        for step, r in enumerate(rel[1:], start=1):
            assert r["local_released_before"] == r["local"], (case, step, r)
            assert r["local_after_last_sync"], (case, step, r)
    if case == "last_layer_overlap_plain":  # SYNC fills first: the earlier layers' LOCAL buckets go at once
        for res in world:
            rel = res["engine"][case]["releases"][1:]
            assert all(r["local_released_before_last_bucket"] > 0 for r in rel), rel


@pytest.mark.timeout(960)
def test_local_buckets_without_overlap_go_in_finish_grad_sync(world):
    for res in world:
        for r in res["engine"]["no_overlap_plain"]["releases"]:
            assert r["local"] > 0 and r["local_released_before"] == 0 and r["sync_released_before"] == 0, r


@pytest.mark.timeout(960)
def test_distributed_optimizer_shards_leave_during_backward(world):
    """The distributed optimizer carries LOCAL ranges in the island reduce-scatter of a SYNC item:
    no LOCAL item, every item released from the hooks (after the first batch)."""
    for res in world:
        for r in res["engine"]["async_distopt"]["releases"][1:]:
            assert r["local"] == 0 and r["sync"] > 0 and r["sync_released_before"] == r["sync"], r


@pytest.mark.timeout(960)
@pytest.mark.parametrize("dist_opt", [False, True])
def test_auto_sync_at_four_islands(world, dist_opt):
    """The `auto` SYNC keys through Megatron DDP at 4 groups: what the engine took, and invariant 1
    on every parameter on every step (no LOCAL class left to differ)."""
    for res in world:
        got = res["auto_many_islands"][dist_opt]
        assert (got["dtype"], got["top"], got["groups"], got["classes"]) == ("int8", 1.0, 4, ["SYNC"]), got
        assert [r["all_same"] for r in got["recs"]] == [True] * 6, got["recs"]
        assert got["reconcile_bytes"] == 0, got
    losses = [r["loss"] for r in world[0]["auto_many_islands"][dist_opt]["recs"]]
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", ["method_auto_plain", "method_auto_distopt"])
def test_method_auto_switches_and_keeps_invariants(world, case):
    for res in world:
        r = res["engine"][case]
        assert r["method_events"] == [(5, "local", 2), (8, "hierarchical", None)], case
        for step, rec in enumerate(r["recs"]):
            assert rec["sync_all_same"] and rec["local_same_in_group"] and rec["agreed"], (case, step, rec)
        assert r["equal_after_rechoice"] == [True]  # leaving the LOCAL class reconciled first
        assert r["sync_dtype"] == "torch.float32" and r["final_all_same"]
    recs = world[0]["engine"][case]["recs"]
    n_all = recs[0]["n_sync"]
    assert [rec["n_sync"] < n_all for rec in recs] == [False] * 4 + [True] * 4 + [False] * 2
    assert any(not rec["all_same"] for rec in recs[4:8])  # positive control: the LOCAL class drifted


@pytest.mark.timeout(960)
def test_method_auto_real_choice_is_position_0s_on_every_rank(world):
    r0 = world[0]["engine"]["method_auto_real"]
    (step, method, _), = r0["method_events"]
    assert step == 5 and method in ("hierarchical", "int8", "local")
    assert all(res["engine"]["method_auto_real"]["method_events"] == r0["method_events"] for res in world)
    line, = r0["lines"]
    assert line.startswith(f"topo_align: method auto: {method} (") and "figures: 2 groups of 2 ranks" in line
    assert all(res["engine"]["method_auto_real"]["lines"] == [None] for res in world[1:])
