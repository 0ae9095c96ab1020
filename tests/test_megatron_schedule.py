"""One schedule per process: several engines issue through one order, one trace, one watch.

4 gloo ranks (2 virtual nodes x 2), ``monitor.check_collectives`` on:

* Megatron: two model chunks (as virtual-pipeline chunks are: one `TopoAlignDDP` each, one
  `GroupSet`, one Megatron optimizer over both), the second with expert buffers, ``selective`` with
  asynchronous reconciliation and ``--overlap-grad-reduce`` (the dispatcher's thread). Every engine
  shares one schedule and one issuing thread; the fingerprints of every engine are compared at every
  step and are not empty; invariants hold on every step for both chunks.
* Two `GroupedReducer` s on two distinct sets of communicators (as the Megatron expert engine has when
  its data-parallel group differs): attached to one schedule, their collectives interleave in one
  fingerprinted order and the check still passes; a divergence injected on one rank is caught.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.multirank]

WORLD = 4


def _gather(v):
    import torch.distributed as dist

    out = [torch.empty_like(v) for _ in range(WORLD)]
    dist.all_gather(out, v)
    return out


def _invariants(chunk) -> dict:
    cls = chunk.topo_param_classes()
    named = list(chunk.module.named_parameters())
    sv = torch.cat([p.detach().reshape(-1) for n, p in named if cls[n] == "SYNC"])
    lv = torch.cat([p.detach().reshape(-1) for n, p in named if cls[n] == "LOCAL"] or [torch.zeros(1)])
    gs, gl = _gather(sv), _gather(lv)
    return {"sync_all_same": all(torch.equal(gs[0], x) for x in gs),
            "local_same_in_group": torch.equal(gl[0], gl[1]) and torch.equal(gl[2], gl[3])}


def _megatron(rank):
    import threading

    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from topo_integrations import TopoAlignConfig
    from topo_integrations.megatron.ddp import TopoAlignDDP
    from topo_integrations.megatron.groups import GroupSet
    from topo_integrations.megatron.optimizer import prepare_optimizer
    from topo_integrations.megatron.testing import TinyGPT, batch_for, build_gpt, init_parallel
    from topo_integrations.reducer.schedule import dispatch

    compared = []
    real = dispatch.compare

    def spy(traces, *, step):
        compared.append(sum(len(t) for t in traces.values()))
        return real(traces, step=step)

    dispatch.compare = spy
    cfg = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "top_fraction": 0.1},
        "local": {"reconcile_interval": 2, "async_reconcile": True},
        "fallback": {"timeout_s": 60}, "monitor": {"check_collectives": True}})
    init_parallel(1)
    specs = [TinyGPT(seed=11), TinyGPT(seed=12, expert_like=("layers.0.mlp",))]
    group_set = GroupSet()
    chunks = []
    for spec in specs:
        m, c = build_gpt(spec)
        ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=20000)
        ddp = TopoAlignDDP(c, ddp_cfg, m, topo_align=cfg, topo_groups=group_set)
        c.finalize_model_grads_func = finalize_model_grads
        c.no_sync_func = ddp.no_sync
        chunks.append(ddp)
    opt = prepare_optimizer(get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), chunks,
                                                   use_gloo_process_groups=False), chunks)
    engines = [e for ch in chunks for e in ch.topo_engines]
    out = {"engines": len(engines), "schedules": len({id(e.dispatcher.sched) for e in engines}),
           "expert_groups": sum(len(ch.expert_parallel_bucket_groups) for ch in chunks), "recs": []}
    spec = specs[0]
    pos = torch.arange(spec.seq_length).unsqueeze(0).expand(spec.micro_batch_size, spec.seq_length)
    for step in range(6):
        opt.zero_grad()
        for ch in chunks:  # one chunk after the other, as an interleaved schedule's program order does
            ch.zero_grad_buffer()
            batches = iter([batch_for(spec, rank, step, mb) for mb in range(spec.num_microbatches)])

            def fwd(it, model):
                toks = next(it)
                return model(toks[:, :-1], pos, None, labels=toks[:, 1:]), \
                    lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

            get_forward_backward_func()(forward_step_func=fwd, data_iterator=batches, model=[ch],
                                        num_microbatches=spec.num_microbatches, seq_length=spec.seq_length,
                                        micro_batch_size=spec.micro_batch_size, forward_only=False)
        opt.step()
        out["recs"].append([_invariants(ch) for ch in chunks])
    out["threads"] = sum(t.name == "topo_align_dispatch" for t in threading.enumerate())
    out["compared"] = compared
    for ch in chunks:
        ch.topo_close()
    return out


def _two_reducers(rank):
    import torch.nn as nn

    from topo_integrations import GroupedReducer, TopoAlignConfig
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.reducer.schedule.order import CollectiveOrderError

    cfg = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "always_sync": [], "top_fraction": 0.0},
        "local": {"reconcile_interval": 2, "async_reconcile": True}, "communication": {"bucket_size_mb": 0.001},
        "fallback": {"timeout_s": 60}, "monitor": {"check_collectives": True}})
    plan = discover_plan(cfg)
    ga, gb = build_groups(plan, timeout_s=60), build_groups(plan, timeout_s=60)  # two communicator sets
    torch.manual_seed(0)
    ma, mb = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    ra = GroupedReducer(ma, cfg, groups=ga)
    ga.schedule.attach(gb)  # what GroupSet.share_schedule does for the expert groups
    rb = GroupedReducer(mb, cfg, groups=gb)
    oa, ob = torch.optim.SGD(ma.parameters(), lr=0.1), torch.optim.SGD(mb.parameters(), lr=0.1)
    out = {"same": ra.engine.dispatcher.sched is rb.engine.dispatcher.sched, "comms": set()}
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        ma(x).pow(2).mean().backward()
        mb(x).pow(2).mean().backward()
        ra.finish_grad_sync()
        rb.finish_grad_sync()
        oa.step()
        ob.step()
        tr = ra.engine.dispatcher.trace
        out["comms"] |= {f.comm for f in list(tr._items)}
        ra.after_optimizer_step(oa)
        rb.after_optimizer_step(ob)
    # a divergence in the shared trace (one rank issued one more collective) is caught
    mb(torch.ones(2, 8)).sum().backward()
    rb.finish_grad_sync()
    if rank == 1:
        ra.engine.dispatcher.trace.add(gb.describe(gb.intra), gb.intra_ranks, "all_reduce(extra)", torch.float32, 1)
    try:
        rb.after_optimizer_step(ob)
        out["diverged"] = None
    except CollectiveOrderError as exc:
        out["diverged"] = str(exc)
    out["comms"] = sorted(out["comms"])
    return out


def _rank_main(rank, world):
    from topo_integrations.megatron import cpu_compat
    from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    cpu_compat.apply()
    return {"megatron": _megatron(rank), "reducers": _two_reducers(rank)}


@pytest.fixture(scope="module")
def world():
    from topo_integrations.testing import run_world

    return run_world(WORLD, _rank_main, timeout=280, env={"OMP_NUM_THREADS": "1"})


def test_megatron_chunks_share_one_schedule_and_one_thread(world):
    for r in world:
        m = r["megatron"]
        assert m["engines"] >= 2 and m["schedules"] == 1 and m["threads"] == 1, m
        assert m["expert_groups"] > 0


def test_megatron_fingerprints_of_every_engine_are_compared_every_step(world):
    for r in world:
        compared = r["megatron"]["compared"]
        # every engine closes every step with a comparison; the first engine's holds the step's traffic
        assert len(compared) >= 6 * 2 and sum(c > 0 for c in compared) >= 6, compared


def test_megatron_invariants_every_step_for_both_chunks(world):
    for r in world:
        for step, recs in enumerate(r["megatron"]["recs"]):
            for rec in recs:
                assert rec["sync_all_same"] and rec["local_same_in_group"], (step, recs)


def test_two_communicator_sets_share_one_schedule_and_one_trace(world):
    for r in world:
        rr = r["reducers"]
        assert rr["same"]
        # the one trace holds the collectives of both communicator sets (distinct group handles,
        # same names: the trace tells them apart by issue position, every rank alike)
        assert any(c.startswith("intra group") for c in rr["comms"])
        assert any(c.startswith("intra_low") for c in rr["comms"])
        assert rr["diverged"] is not None and "all_reduce(extra)" in rr["diverged"], rr["diverged"]
