"""`topology.source: auto` in a real 4-rank gloo job where every rank replays a captured node
(issue 24; TOPO_ALIGN_SYSROOT points each rank at tests/fixtures/nodes/<node>).

One world, many checks (each rank runs them in the same order):
  1. nodeA (2 GPUs, NV4, 2 x 200 Gb/s IB) + nodeB (2 GPUs, NV4, one 100 Gb/s port up): islands are
     the hosts, the leaf tier is set by nodeB's NIC (6 GB/s per GPU, nic-rate), hierarchical;
  2. nodeC + nodeD (NV1 bridges, 20 GB/s, vs 2 x 200 Gb/s, 24 GB/s): within min_tier_ratio -> flat,
     the reason carries the deciding numbers and origins;
  3. the probe through GroupedReducer (one data-parallel group): every tier measured, and the plan
     decided on the measured numbers (on one machine both tiers are loopback, so usually flat);
  4. the probe through the Megatron adapter's group path with two data-parallel groups (TP = 2);
  5. a malformed node on rank 3: every rank raises the same TopologyError naming rank 3;
  6. rank 3 never joins: ranks 0-2 raise TopologyTimeout naming rank 3 within fallback.timeout_s.

`_worker` runs as the last part of the suite's shared 4-rank world (tests/_world4.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import _world4
import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(_world4.TIMEOUT)]

NODES = Path(__file__).resolve().parent / "fixtures" / "nodes"


def _as(rank: int, hosts: tuple[str, str]) -> None:
    os.environ["TOPO_ALIGN_SYSROOT"] = str(NODES / hosts[rank // 2])
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.environ.pop("TOPO_ALIGN_HOSTNAME", None)


def _plan_of(plan) -> dict:
    return {"intra": [list(g) for g in plan.intra_groups], "hier": plan.hierarchical, "reason": plan.reason,
            "inter": (plan.inter_tier, plan.inter_bandwidth_gbps, plan.inter_origin),
            "intra_t": (plan.intra_tier, plan.intra_bandwidth_gbps, plan.intra_origin)}


def _worker(rank: int, world: int) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from topo_integrations import GroupedReducer, TopoAlignConfig
    from topo_integrations.megatron.groups import groups_for_dp_group
    from topo_integrations.reducer import discover_plan
    from topo_integrations.topology import TopologyError
    from topo_integrations.topology.model import TopologyTimeout

    out: dict = {}
    auto = TopoAlignConfig.model_validate({"mode": "hierarchical", "fallback": {"timeout_s": 60}})
    probe = TopoAlignConfig.model_validate({"mode": "hierarchical", "topology": {"probe": True},
                                            "fallback": {"timeout_s": 60}})
    # 1. heterogeneous nodes
    _as(rank, ("nodeA-2x200", "nodeB-1x100"))
    out["hetero"] = _plan_of(discover_plan(auto))
    # 2. tiers within the ratio
    _as(rank, ("nodeC-nv1", "nodeD-nv1"))
    out["flat"] = _plan_of(discover_plan(auto))
    # 3. probe through GroupedReducer
    _as(rank, ("nodeA-2x200", "nodeB-1x100"))
    torch.manual_seed(0)
    red = GroupedReducer(torch.nn.Linear(8, 8), probe)
    out["probe_reducer"] = _plan_of(red.groups.plan)
    # 4. probe through the Megatron adapter's group creation, two DP groups ({0, 2}, {1, 3})
    dp = None
    for ranks in ([0, 2], [1, 3]):
        g = dist.new_group(ranks)
        if rank in ranks:
            dp = g
    out["probe_megatron"] = _plan_of(groups_for_dp_group(probe, dp).plan)
    # 5. a malformed node on rank 3
    os.environ["TOPO_ALIGN_SYSROOT"] = str(NODES / ("bad/ib-rate" if rank == 3 else "nodeA-2x200"))
    try:
        discover_plan(auto)
    except TopologyError as exc:
        out["bad"] = str(exc)
    # 6. rank 3 does not answer
    _as(rank, ("nodeA-2x200", "nodeB-1x100"))
    short = TopoAlignConfig.model_validate({"fallback": {"timeout_s": 3}})
    store = dist.distributed_c10d._get_default_store()
    if rank == 3:  # absent until every other rank has given up on it (no longer than that)
        store.wait([f"discovery_world/timed_out/{r}" for r in range(3)], datetime.timedelta(seconds=60))
        return out
    t0 = time.monotonic()
    try:
        discover_plan(short)
    except TopologyTimeout as exc:
        out["timeout"] = (str(exc), time.monotonic() - t0)
    store.set(f"discovery_world/timed_out/{rank}", "1")
    return out


@pytest.fixture(scope="module")
def world(request):
    return _world4.results(request, "test_discovery_world")


def test_discovery_in_a_replayed_four_rank_job(world):
    res = world
    for r in res:  # every rank returns the same plans
        assert r["hetero"] == res[0]["hetero"] and r["flat"] == res[0]["flat"]
    het = res[0]["hetero"]
    assert het["hier"] and het["intra"] == [[0, 1], [2, 3]]
    assert het["intra_t"] == ("island", 80.0, "nvlink")
    assert het["inter"] == ("leaf", pytest.approx(100 / 8 * 0.96 / 2), "nic-rate")  # nodeB: 1 x 100 Gb/s, 2 GPUs

    flat = res[0]["flat"]
    assert not flat["hier"] and flat["intra"] == [[0, 1, 2, 3]]
    assert flat["reason"] == ("intra tier 'island' (20 GB/s, nvlink) and inter tier 'leaf' (24 GB/s, nic-rate) "
                              "differ by 0.83x < min_tier_ratio 1.3")

    for key in ("probe_reducer", "probe_megatron"):
        for r in res:
            assert r[key] == res[0][key], key
    pr = res[0]["probe_reducer"]
    # On one machine every "tier" is the same loopback: the measured numbers decide, whatever they are.
    assert pr["intra_t"][:1] + pr["intra_t"][2:] == ("island", "measured") and pr["intra_t"][1] > 0
    assert pr["inter"][:1] + pr["inter"][2:] == ("leaf", "measured") and pr["inter"][1] > 0
    assert pr["hier"] == (pr["intra_t"][1] / pr["inter"][1] >= 1.3)
    assert pr["intra"] == ([[0, 1], [2, 3]] if pr["hier"] else [[0, 1, 2, 3]])
    pm = res[0]["probe_megatron"]  # one rank per host in each DP group: flat, but on measured numbers
    assert not pm["hier"] and pm["inter"][0] == "leaf" and pm["inter"][2] == "measured"

    for r in res:
        assert r["bad"].startswith("topo_align: discovery: global rank 3 could not read its node: sysfs-ib:"), r["bad"]
        assert "'fast'; expected '<n> Gb/sec (...)'" in r["bad"]
    for r in res[:3]:
        msg, waited = r["timeout"]
        assert "global rank(s) 3 did not answer within 3 s (fallback.timeout_s)" in msg
        assert 3 <= waited < 10
    assert "timeout" not in res[3]
