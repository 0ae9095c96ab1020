"""Rank-side adapter cases of scripts/gpu_check.py: every adapter on 4 ranks (2 islands x 2).

Run by scripts/gpu_world.py on NCCL (one GPU per rank), on gloo with CUDA tensors (the ranks share the
GPUs), or on gloo and CPU (the suite's check of this code, tests/test_gpu_check.py). The models,
configs and loops are the suite's own (tests/test_reducer_modes.py, tests/test_ddp_hook.py,
topo_integrations/deepspeed/harness.py, tests/test_megatron_ddp.py). A case returns ``(status,
detail)``. ``monitor.check_collectives`` is on for every case (``TOPO_ALIGN_CHECK_COLLECTIVES=1``, set
by the driver): a rank that issued other collectives than its peers ends the case in an error.
"""

from __future__ import annotations

TOL = 1e-6
"""Hierarchical equals flat (the framework's own all-reduce) within this relative error."""


def _verdict(ok: bool, detail: str) -> tuple[str, str]:
    return ("PASS" if ok else "FAIL"), detail


# -- GroupedReducer and the DDP comm hook (tests/test_reducer_modes.py, tests/test_ddp_hook.py) -----

def _flat_grad_err(model, ref, world: int) -> float:
    """Relative error of ``model``'s reduced gradients against ``ref``'s all-reduced mean."""
    import torch
    import torch.distributed as dist

    num = den = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        # (a parameter the loss does not reach, e.g. the toy's `spare`, has no gradient on any rank)
        want = q.grad.clone() if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(want)
        want /= world
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        num += float((got.double() - want.double()).pow(2).sum())
        den += float(want.double().pow(2).sum())
    return (num / max(den, 1e-60)) ** 0.5 if den else float(torch.inf)


def _torch_case(case: str, rank: int, dev) -> tuple[str, str]:
    import test_ddp_hook as hook_t
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.torch import GroupedReducer, TopoAlignHookState, topo_align_hook

    import test_reducer_modes as modes_t

    world = dist.get_world_size()
    mode = case.rsplit("-", 1)[1]

    def loss(model, step):
        x, y = modes_t.batch(step, rank)
        return torch.nn.functional.cross_entropy(model(x.to(dev)).reshape(-1, 16), y.to(dev).reshape(-1))

    if case.startswith("grouped-reducer"):
        model, ref = modes_t.make(1).to(dev), modes_t.make(1).to(dev)
        # `default`: the shipped config (every tensor SYNC on the int8 wire: all-to-all, owner sum, all-gather)
        # `auto`: method auto, which times steps 2-5 (on CUDA between events on the training stream) and chooses
        cfg = TopoAlignConfig.model_validate({"mode": "selective", "topology": {"source": "hostnames"},
                                              **({"method": "auto"} if mode == "auto" else {})}) \
            if mode in ("default", "auto") else modes_t.cfg_of(mode=mode, sync__last_n_layers=1, sync__top_fraction=0.1,
                                                     local__reconcile_interval=2, communication__bucket_size_mb=0.001)
        red = GroupedReducer(model, cfg)
        finish, after, verify, reconcile, close = (red.finish_grad_sync, red.after_optimizer_step,
                                                   red.verify_consistency, red.reconcile, red.close)
    else:
        ddp_kw = {"device_ids": [dev.index]} if dev.type == "cuda" else {}
        model, ref = DDP(hook_t.make().to(dev), bucket_cap_mb=hook_t.BUCKET_CAP_MB, **ddp_kw), hook_t.make().to(dev)
        state = TopoAlignHookState(model, hook_t.cfg_of(mode))
        model.register_comm_hook(state, topo_align_hook)
        finish, after, verify, reconcile, close = (lambda: None), state.after_optimizer_step, \
            state.verify_consistency, state.reconcile, state.close
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    worst = 0.0
    try:
        for step in range(6):
            opt.zero_grad(set_to_none=True)
            loss(model, step).backward()
            finish()
            if mode == "hierarchical":
                # the flat reference: the same parameters, this rank's gradient, one all-reduce
                with torch.no_grad():
                    for p, q in zip(model.parameters(), ref.parameters()):
                        q.copy_(p)
                ref.zero_grad(set_to_none=True)
                loss(ref, step).backward()
                worst = max(worst, _flat_grad_err(model, ref, world))
            opt.step()
            after(opt)
            verify()  # invariants 1 and 2: SYNC identical on all ranks, LOCAL inside each island
        reconcile(opt)
        verify()
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        same = modes_t.same_on(list(range(world)), flat)
        if mode == "auto":
            m = red.engine.method
            chosen = [None] * world
            dist.all_gather_object(chosen, m.method)
            samples = list(m.samples)
    finally:
        close()
    if mode == "auto":
        ok = same and chosen[0] is not None and len(set(chosen)) == 1 and len(samples) == 4 and min(samples) > 0
        return _verdict(ok, f"chose {chosen[0]} on every rank {len(set(chosen)) == 1}, compute per step "
                            f"{', '.join(f'{t * 1e3:.2f}' for t in samples)} ms (timed on the {dev.type}), "
                            f"replicas identical {same}")
    if mode == "hierarchical":
        return _verdict(worst <= TOL and same, f"grad rel err vs flat all-reduce {worst:.2e} (<= {TOL:g}), "
                                               f"replicas identical {same}")
    return _verdict(same, f"invariants held on 6 steps, identical after reconcile {same}")


# -- DeepSpeed ZeRO 0-3 (topo_integrations/deepspeed/harness.py) -----------------------------------

def _deepspeed_case(case: str, rank: int, dev) -> tuple[str, str]:
    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H

    if dev.type == "cpu":
        H.prepare_cpu()
    stage, mode = int(case.split("-")[1].removeprefix("zero")), case.rsplit("-", 1)[1]

    def engine(cfg):
        model = H.Net()
        eng, _, _, _ = tds.initialize(model=model, optimizer=H.make_optimizer("adamw", model.parameters()), config=cfg)
        return eng

    import deepspeed.utils.groups as dg

    try:
        if mode == "hierarchical":
            stock = engine(H.ds_config(stage, clip=0.05))
            H.train(stock, 4)
            top = engine(H.ds_config(stage, clip=0.05, topo=H.topo_block("hierarchical")))
            H.train(top, 4)
            err = H.rel_err(H.flat_params(top), H.flat_params(stock))
            return _verdict(err <= TOL, f"params after 4 AdamW steps vs stock ZeRO-{stage}: rel err {err:.2e} "
                                        f"(<= {TOL:g})")
        recs: list = []
        # ZeRO-1/2: overlap_comm and buckets smaller than the model, so the SYNC rail chunks go from
        # DeepSpeed's reduction stream during backward (deepspeed/rail.py), the CUDA path of that overlap.
        zero = {"overlap_comm": True, "reduce_bucket_size": 2000} if stage in (1, 2) else {}
        top = engine(H.ds_config(stage, clip=0.05, topo=H.topo_block("selective", sync={"top_fraction": 0.2}),
                                 zero_optimization=zero))
        H.train(top, 8, check=H.selective_checker(recs))
        keys = ("sync_equal", "island_equal", "norm_agree", "overflow_agree")
        bad = [(r["step"], k) for r in recs for k in keys if not r[k]]
        bad += [(r["step"], "all_equal_after_reconcile") for r in recs if r["reconciled"]
                and not r["all_equal_after_reconcile"]]
        done = sum(bool(r["reconciled"]) for r in recs)
        return _verdict(not bad and done > 0, f"invariants on 8 steps, {done} reconciliations; broken: {bad[:3]}")
    finally:
        dg.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global (tests/test_deepspeed_multirank.py)


# -- Megatron DDP and distributed optimizer (tests/test_megatron_ddp.py) -------------------------------

def _megatron_case(case: str, rank: int, dev) -> tuple[str, str]:
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron import cpu_compat
    from topo_integrations.megatron.testing import TinyGPT

    if dev.type == "cpu" and not cpu_compat.apply():
        return "FAIL", "--device cpu with CUDA present: megatron-core's CPU layer stays off on a GPU machine"
    import test_megatron_ddp as mddp

    dist_opt, mode = case.split("-")[1] == "distopt", case.rsplit("-", 1)[1]
    spec = TinyGPT()
    if mode == "hierarchical":
        hier = TopoAlignConfig.model_validate({"mode": "hierarchical"})
        res = mddp._grad_checks(rank, hier, {case: (spec, dist_opt, True, None)})[case]
        worst = max(res["errs"])
        ok = worst <= TOL and res["active"] and res["swapped"] == res["n_groups"]
        return _verdict(ok, f"main_grad rel err vs stock DDP {worst:.2e} (<= {TOL:g}), {res['swapped']}/"
                            f"{res['n_groups']} bucket groups swapped")
    sel = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "top_fraction": 0.15},
        "local": {"reconcile_interval": 4, "async_reconcile": False}})
    recs = mddp._selective_run(rank, spec, sel, dist_opt=dist_opt, steps=8)["recs"]
    keys = ("sync_all_same", "local_same_in_group", "norm_same", "skip_same", "classes_same", "buckets_same")
    bad = [(i, k) for i, r in enumerate(recs) for k in keys if not r[k]]
    bad += [(i, "all_same") for i, r in enumerate(recs) if r["reconciled"] and not r["all_same"]]
    return _verdict(not bad, f"invariants on 8 steps (SYNC identical on all ranks, LOCAL per island, all after "
                             f"each reconciliation); broken: {bad[:3]}")


RUNNERS = {"torch": _torch_case, "deepspeed": _deepspeed_case, "megatron": _megatron_case}
