"""The planner on the shipped topologies, its determinism, unequal islands, and its cost at 16,384 ranks."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from topo_integrations.topology import Plan, PlanError, Topology, plan_groups
from topo_integrations.topology.file_source import load_topology_file, topology_from_dict, topology_to_dict

pytestmark = pytest.mark.timeout(120)

CONFIGS = Path(__file__).parents[1] / "configs" / "topologies"


def shape(groups):
    return len(groups), sorted({len(g) for g in groups})


def test_superpod_960_acceptance():
    topo = load_topology_file(CONFIGS / "dgx-a100-superpod-960.json")
    plan = plan_groups(topo, middle_level=True)
    assert plan.hierarchical and plan.middle_level
    assert shape(plan.intra_groups) == (120, [8])
    assert shape(plan.inter_groups) == (8, [120])
    assert shape(plan.leaf_rails) == (48, [20])
    assert shape(plan.spine_rails) == (160, [6])
    # Rail r holds local rank r of every node; a spine rail holds the same rank of every SU.
    assert plan.inter_groups[3] == tuple(range(3, 960, 8))
    assert plan.leaf_rails[0] == tuple(range(0, 160, 8))
    assert plan.spine_rails[0] == (0, 160, 320, 480, 640, 800)
    assert (plan.intra_tier, plan.inter_tier, plan.tier_ratio) == ("island", "leaf", pytest.approx(230 / 24))


def test_superpod_2to1_spine_is_the_slow_tier():
    topo = load_topology_file(CONFIGS / "dgx-a100-superpod-960-2to1.json")
    plan = plan_groups(topo)
    assert plan.inter_tier == "spine" and plan.inter_bandwidth_gbps == 12.0
    leaf = plan_groups(topo, group_by="leaf")
    assert leaf.hierarchical and shape(leaf.intra_groups) == (6, [160]) and leaf.tier_ratio == 2.0
    one_to_one = plan_groups(load_topology_file(CONFIGS / "dgx-a100-superpod-960.json"), group_by="leaf")
    assert not one_to_one.hierarchical and "differ by 1.00x < min_tier_ratio 1.3" in one_to_one.reason


@pytest.mark.parametrize("name,group_by,hier,intra,inter", [
    ("dgx-h100-1024.json", "island", True, (128, [8]), (8, [128])),
    ("bridged-pairs-8x4.json", "island", True, (16, [2]), (2, [16])),
    ("virtual-2x2.json", "island", True, (2, [2]), (2, [2])),
    ("virtual-4x1.json", "island", False, (1, [4]), (4, [1])),
    ("virtual-2leaf.json", "leaf", True, (2, [2]), (2, [2])),
    ("virtual-2leaf.json", "island", False, (1, [4]), (4, [1])),
])
def test_shipped_topologies(name, group_by, hier, intra, inter):
    plan = plan_groups(load_topology_file(CONFIGS / name), group_by=group_by)
    assert plan.hierarchical is hier
    assert shape(plan.intra_groups) == intra and shape(plan.inter_groups) == inter


def test_virtual_layouts_match_the_emulator_contract():
    v = load_topology_file(CONFIGS / "virtual-2x2.json")
    assert list(v.hosts) == ["node0", "node1"] and v.world_size == 4
    assert (v.tiers["island"].bandwidth_gbps, v.tiers["island"].latency_us) == (0.25, 50.0)
    assert (v.tiers["leaf"].bandwidth_gbps, v.tiers["leaf"].latency_us) == (0.0125, 500.0)
    two = load_topology_file(CONFIGS / "virtual-2leaf.json")
    assert {k: len(r) for k, r in two.leaves.items()} == {"leaf0": 2, "leaf1": 2}
    assert two.tiers["spine"].oversubscription == 2.0


def test_plan_is_deterministic_and_round_trips():
    topo = load_topology_file(CONFIGS / "dgx-a100-superpod-960-2to1.json")
    a, b = plan_groups(topo, middle_level=True), plan_groups(topo, middle_level=True)
    assert a.dumps() == b.dumps()
    assert Plan.from_json(a.to_json()) == a
    again = topology_from_dict(topology_to_dict(topo))
    assert plan_groups(again, middle_level=True).dumps() == a.dumps()


def test_unequal_islands_refused_naming_sizes():
    topo = Topology.from_hosts([("a", 8), ("b", 8), ("c", 4)], name="t")
    with pytest.raises(PlanError) as err:
        plan_groups(topo)
    assert str(err.value) == (
        "t: islands have unequal sizes (2 x 8, 1 x 4 ranks; e.g. 'c' has 4); hierarchical and selective need "
        "equal groups: give every node the same number of ranks, use mode 'flat', or group_by 'leaf' if the "
        "leaves are equal")


def test_recommended_order_groups_hosts_by_leaf():
    leaf_of = {"h0": "L0", "h1": "L1", "h2": "L0", "h3": "L1"}
    topo = Topology.from_hosts([(h, 2) for h in ("h0", "h1", "h2", "h3")], leaf_of=leaf_of)
    plan = plan_groups(topo)
    assert plan.host_order == ("h0", "h2", "h1", "h3") and plan.rank_order_changes == 2


def test_16384_ranks_under_2s_and_200mb():
    leaves = [{"name": f"su{k}", "hosts": f"n{k:03d}x[0001-0032]"} for k in range(64)]  # 2,048 nodes
    doc = {"gpus_per_node": 8, "tiers": {"spine": {"bandwidth_gbps": 24, "oversubscription": 2.0}}, "leaves": leaves}
    topo = topology_from_dict(doc)
    assert topo.world_size == 16384
    tracemalloc.start()
    t0 = time.process_time()  # CPU time: other jobs on a shared machine do not count against it
    plan = plan_groups(topo, middle_level=True)
    elapsed = time.process_time() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert shape(plan.intra_groups) == (2048, [8]) and shape(plan.inter_groups) == (8, [2048])
    assert shape(plan.leaf_rails) == (512, [32]) and shape(plan.spine_rails) == (256, [64])
    # tracemalloc slows allocation-heavy code ~2x; the bounds hold with it on, on a shared 2-core box.
    assert elapsed < 2.0, f"planning 16,384 ranks took {elapsed:.2f} s"
    assert peak < 200 * 1024 * 1024, f"planning 16,384 ranks peaked at {peak / 2**20:.0f} MiB"


def test_islands_of_one_rank_selective_keeps_two_levels():
    """Islands of one rank: flat for any mode but `selective`, which keeps groups of one and one rail
    of every rank (local SGD per rank between reconciliations) when the tiers differ, with a note."""
    topo = load_topology_file(CONFIGS / "virtual-4x1.json")
    for mode in (None, "flat", "hierarchical"):
        plan = plan_groups(topo, mode=mode)
        assert not plan.hierarchical and "every island holds one rank" in plan.reason
    sel = plan_groups(topo, mode="selective")
    assert sel.hierarchical and shape(sel.intra_groups) == (4, [1]) and sel.inter_groups == ((0, 1, 2, 3),)
    assert (sel.intra_tier, sel.inter_tier, sel.tier_ratio) == ("island", "leaf", pytest.approx(20.0))
    assert any("mode 'selective' keeps two levels" in n for n in sel.notes)
    assert Plan.from_json(sel.to_json()) == sel
    # tiers within min_tier_ratio: flat for selective too
    same = plan_groups(topo, mode="selective", min_tier_ratio=25.0)
    assert not same.hierarchical and "< min_tier_ratio 25" in same.reason
