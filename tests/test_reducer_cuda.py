"""The CUDA path of the reducer: the dispatcher's communication stream, CUDA-aware futures, event
timing. The one file to run when a GPU is at hand (``bash scripts/test.sh tests/test_reducer_cuda.py``).

* ``test_cuda_streams_path`` (one GPU is enough): 4 gloo ranks share the GPU (gloo accepts CUDA
  tensors), so the stream/event path and device-side scaling run, with ``monitor.check_collectives``.
* ``test_nccl_peer_that_never_calls_is_named_within_the_timeout`` (two GPUs): the deadline watch on
  NCCL (future done at enqueue, event polled, communicators aborted, named error within the timeout).
* ``test_nccl_dispatcher_two_ranks`` (two GPUs): 2 ranks on NCCL, one GPU each: hierarchical equals
  NCCL's own all-reduce, the futures carry the communication stream's events, timings are device
  times, and every rank issued the same collectives (the check). NCCL refuses two ranks on one GPU.
Skipped without CUDA (and the NCCL test without two GPUs).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rank_main(rank, world):
    import torch.distributed as dist

    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.torch import GroupedReducer

    from test_reducer_modes import HOSTNAME_ENV, cfg_of, flat_params, make, same_on

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    os.environ["TOPO_ALIGN_CHECK_COLLECTIVES"] = "1"
    g = build_groups(discover_plan(cfg_of()), timeout_s=120)
    out = {}
    for mode in ("hierarchical", "selective"):
        model = make(1).cuda()
        ref = make(1).cuda()
        red = GroupedReducer(model, cfg_of(mode=mode, sync__last_n_layers=1, sync__top_fraction=0.1,
                                           local__reconcile_interval=2, communication__bucket_size_mb=0.001),
                             groups=g)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        worst = 0.0
        for s in range(6):
            opt.zero_grad(set_to_none=True)
            x_loss = loss_of_cuda(model, s, rank)
            x_loss.backward()
            red.finish_grad_sync()
            if mode == "hierarchical" and s == 0:
                loss_of_cuda(ref, s, rank).backward()
                for p, q in zip(model.parameters(), ref.parameters()):
                    want = q.grad.clone()
                    dist.all_reduce(want)
                    want /= world
                    worst = max(worst, float((p.grad - want).norm() / want.norm().clamp_min(1e-30)))
            opt.step()
            red.after_optimizer_step(opt)
            red.verify_consistency()
        red.reconcile(opt)
        red.verify_consistency()
        out[mode] = {"worst": worst, "same": same_on(list(range(world)), flat_params(model).cuda())}
        red.close()
    out["auto"] = _method_auto_cuda(rank, world, g)
    return out


def _method_auto_cuda(rank, world, g):
    """`method: auto` on CUDA: the compute of steps 2-5 timed between events on the training stream,
    less its waits for the communication stream (the host never blocks on a bucket there)."""
    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.torch import GroupedReducer

    from test_reducer_modes import flat_params, make, same_on

    model = make(1).cuda()
    cfg = TopoAlignConfig.model_validate({"mode": "selective", "method": "auto", "topology": {"source": "hostnames"},
                                          "communication": {"bucket_size_mb": 0.001}, "fallback": {"timeout_s": 60.0}})
    red = GroupedReducer(model, cfg, groups=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(6):
        opt.zero_grad(set_to_none=True)
        loss_of_cuda(model, s, rank).backward()
        red.finish_grad_sync()
        opt.step()
        red.after_optimizer_step(opt)
    m = red.engine.method
    res = {"method": m.method, "samples": list(m.samples), "line": m.events[0].get("line") if m.events else None,
           "timing_off": red.engine.dispatcher.device_waits is None,
           "same": same_on(list(range(world)), flat_params(model).cuda())}
    red.close()
    return res


def loss_of_cuda(model, step, rank):
    from test_reducer_modes import batch

    x, y = batch(step, rank)
    x, y = x.cuda(), y.cuda()
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))


@pytest.mark.timeout(300)
def test_cuda_streams_path():
    from topo_integrations.testing import run_world

    res = run_world(4, _rank_main, timeout=280, env={"OMP_NUM_THREADS": "1"})
    for r in res:
        assert r["hierarchical"]["worst"] <= 1e-5
        assert r["hierarchical"]["same"] and r["selective"]["same"]
        a = r["auto"]
        assert a["method"] == res[0]["auto"]["method"] is not None and a["timing_off"], a
        assert len(a["samples"]) == 4 and all(t > 0 for t in a["samples"]), a  # device times, not enqueueing
    assert "(timed over steps 2-5, on the device)" in res[0]["auto"]["line"], res[0]["auto"]


def _nccl_main(rank, world):
    import torch.distributed as dist

    from topo_integrations.reducer import build_groups
    from topo_integrations.reducer.engine import Engine, EngineTensors
    from topo_integrations.reducer.plan.planning import gather_hostnames_topology
    from topo_integrations.reducer.schedule.dispatch import CommBucket
    from topo_integrations.topology import plan_groups

    from test_reducer_modes import cfg_of

    os.environ["TOPO_ALIGN_CHECK_COLLECTIVES"] = "1"
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    # Two "nodes" of one GPU each: islands of one, a rail of two (the slow tier).
    plan = plan_groups(gather_hostnames_topology(["n0", "n1"]))
    g = build_groups(plan, timeout_s=120)
    out = {}
    for mode in ("hierarchical", "selective"):
        cfg = cfg_of(mode=mode, sync__last_n_layers=0, sync__top_fraction=0.0, sync__always_sync=[])
        e = Engine(cfg, g, EngineTensors(["a", "b"], [1000, 24], layers={"a": None, "b": None}), device=dev)
        x = torch.randn(1000, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
        want = x.clone()
        dist.all_reduce(want)
        want /= world
        fut = e.reduce(CommBucket("a", x), "SYNC")
        e.sync_done()
        e.all_submitted()
        got = e.wait(fut)
        torch.cuda.current_stream().synchronize()
        out[mode] = {"rel": float((got - want).norm() / want.norm()), "is_out": got.data_ptr() == x.data_ptr()}
        e.after_step(None)
        st = e.stats()
        out[mode]["seconds"] = sum(sum(v.values()) for v in st["total"]["seconds"].values())
        e.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_dispatcher_two_ranks():
    from topo_integrations.testing import run_world

    res = run_world(2, _nccl_main, timeout=280, env={"OMP_NUM_THREADS": "1"}, backend="nccl")
    for r in res:
        for mode in ("hierarchical", "selective"):
            assert r[mode]["rel"] <= 1e-6 and r[mode]["is_out"], r
            assert r[mode]["seconds"] > 0, r


def _nccl_fault_main(rank, world):
    """Rank 1 never calls the step's SYNC reduction: on NCCL rank 0's future completes at enqueue,
    the schedule's watcher finds the event past ``fallback.timeout_s``, names it and aborts."""
    import time

    from topo_integrations.reducer import build_groups
    from topo_integrations.reducer.engine import Engine, EngineTensors
    from topo_integrations.reducer.plan.planning import gather_hostnames_topology
    from topo_integrations.reducer.schedule.dispatch import CommBucket
    from topo_integrations.reducer.watch.errors import CollectiveError
    from topo_integrations.topology import plan_groups

    from test_reducer_modes import cfg_of

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    plan = plan_groups(gather_hostnames_topology(["n0", "n1"]))
    g = build_groups(plan, timeout_s=5)
    cfg = cfg_of(mode="hierarchical", fallback__timeout_s=5)
    e = Engine(cfg, g, EngineTensors(["a"], [1000], layers={"a": None}), device=dev)
    if rank == 1:
        time.sleep(20)
        return {"skipped": True}
    x = torch.ones(1000, device=dev)
    t0 = time.perf_counter()
    fut = e.reduce(CommBucket("a", x), "SYNC")
    enqueued = fut.done()
    try:
        e.wait(fut)
        e.call(lambda: None, "control after the stuck bucket")
        return {"error": None}
    except CollectiveError as exc:
        return {"error": str(exc), "after_s": time.perf_counter() - t0, "enqueued_done": enqueued}


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_peer_that_never_calls_is_named_within_the_timeout():
    from topo_integrations.testing import run_world

    res = run_world(2, _nccl_fault_main, timeout=100, env={"OMP_NUM_THREADS": "1"}, backend="nccl")
    r = res[0]
    assert r["enqueued_done"] and r["error"] is not None, r
    assert "did not complete within fallback.timeout_s = 5s" in r["error"] and "inter" in r["error"], r
    assert r["after_s"] <= 5 + 1.5, r
