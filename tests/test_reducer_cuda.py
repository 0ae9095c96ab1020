"""The CUDA path of the reducer (side streams, events; SYNC on a high-priority stream).

Runs only where CUDA exists: 4 gloo ranks share one GPU (gloo accepts CUDA tensors), so the streams,
events and device-side scaling are exercised even on a one-GPU machine. Skipped without CUDA.
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
    return out


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
