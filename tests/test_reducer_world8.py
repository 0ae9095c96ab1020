"""The reducer on 8 gloo ranks (one world for the module): groups of 2 (4 nodes) and of 4 (2 nodes),
an unequal layout refused, and a short selective run checking invariant 1 on every step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from topo_integrations.reducer.groups import HOSTNAME_ENV, gather_hostnames_topology
from topo_integrations.topology import PlanError, plan_groups

from test_reducer_collectives import assert_collectives, collective_checks
from test_reducer_modes import cfg_of, flat_params, make, same_on, train

pytestmark = pytest.mark.multirank

UNEQUAL = ["a"] * 4 + ["b"] * 2 + ["c"] * 2


def _rank_main(rank, world):
    from topo_integrations.reducer import GroupedReducer, build_groups, discover_plan

    res = {}
    cfg = cfg_of()
    for name, per_node in (("g2", 2), ("g4", 4)):
        os.environ[HOSTNAME_ENV] = f"node{rank // per_node}"
        g = build_groups(discover_plan(cfg), timeout_s=60)
        res[name] = collective_checks(g, 3 + per_node, ef_steps=50 if per_node == 4 else 0)
        # selective, blocking reconciliation every 3 steps, invariant 1 checked on every step
        model = make(11)
        red = GroupedReducer(model, cfg_of(sync__last_n_layers=1, sync__top_fraction=0.1,
                                           local__reconcile_interval=3, local__async_reconcile=False),
                             groups=g)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, red, opt, rank, 0, 9, verify=True)
        res[name]["sel_all_same_after_reconcile"] = same_on(list(range(world)), flat_params(model))
        res[name]["sel_inter_bytes"] = red.stats()["total"]["bytes"]["inter"]
        red.close()
        dist.barrier()
    os.environ[HOSTNAME_ENV] = UNEQUAL[rank]
    try:
        discover_plan(cfg)
        res["unequal"] = None
    except PlanError as exc:
        res["unequal"] = str(exc)
    return res


@pytest.fixture(scope="module")
def world8():
    from topo_integrations.testing import run_world

    return run_world(8, _rank_main, timeout=280, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,L,K", [("g2", 2, 4), ("g4", 4, 2)])
def test_collectives_8_ranks(world8, layout, L, K):
    results = [res[layout] for res in world8]
    for c in results:
        assert (c["intra_size"], c["inter_size"]) == (L, K)
    assert_collectives(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["g2", "g4"])
def test_selective_8_ranks(world8, layout):
    for res in world8:
        assert res[layout]["sel_all_same_after_reconcile"]  # step 9 is a reconciliation step
        assert res[layout]["sel_inter_bytes"]["sync"] > 0 and res[layout]["sel_inter_bytes"]["reconcile"] > 0


@pytest.mark.timeout(300)
def test_unequal_8_refused(world8):
    want = None
    try:
        plan_groups(gather_hostnames_topology(UNEQUAL))
    except PlanError as exc:
        want = str(exc)
    assert want and "1 x 4, 2 x 2" in want
    assert all(res["unequal"] == want for res in world8)
