"""Per-node facts, the machine seam, capture/replay and facts -> topology (issue 24), without ranks.

The captured nodes are tests/fixtures/nodes/<node>/ (the layout `topo-align capture` writes);
tests/fixtures/nodes/bad/ holds one malformed node per kind of bad fact, each a named error.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from topo_integrations.cli import main
from topo_integrations.topology import TopologyError, plan_groups
from topo_integrations.topology.capture import capture_node
from topo_integrations.topology.discovered import probe_groups, topology_from_facts, with_measured
from topo_integrations.topology.facts import NodeFacts, collect_node_facts
from topo_integrations.topology.machine import Machine
from topo_integrations.topology.report import format_topology

pytestmark = pytest.mark.timeout(60)
NODES = Path(__file__).resolve().parent / "fixtures" / "nodes"


def node(name: str) -> NodeFacts:
    return collect_node_facts(Machine(str(NODES / name)))


def ranks_of(*specs: tuple[str, int]) -> list[NodeFacts]:
    return [replace(node(n), local_rank=lr) for n, k in specs for lr in range(k)]


# one malformed node per kind of bad fact -> the start of the message (paths relative to its node)
BAD = {
    "ib-rate": "sysfs-ib:{d}/sys/class/infiniband/mlx5_0/ports/1/rate: 'fast'; expected '<n> Gb/sec (...)'",
    "ib-state": "sysfs-ib:{d}/sys/class/infiniband/mlx5_0/ports/1/state: 'ACTIVE'; expected '<n>: <STATE>'",
    "not-utf8": "sysfs-ib:{d}/sys/class/infiniband/mlx5_0/ports/1/rate: not UTF-8 text (byte 0)",
    "net-speed": "{d}/sys/class/net/eth0/speed: 'fast'; expected the link speed in Mb/s",
    "nvidia-smi": "`nvidia-smi topo -m` (captured node {d}): line 3: row 'GPU1', column 'GPU1' = 'BOGUS'",
    "gpu-count": "`nvidia-smi --query-gpu=name --format=csv,noheader` (captured node {d}) lists 3 GPUs but",
    "command-failed": "`nvidia-smi topo -m` failed on the captured node {d}: `nvidia-smi topo -m` exited 9",
    "rocm": "`rocm-smi --showtopo` (captured node {d}): line 4: GPU1 to GPU0 is 'NVLINK'; accepted: XGMI",
    "env-json": "{d}/env.json: not JSON",
    "no-hostname": "{d}/etc/hostname: missing",
    "slurm-addr": "SLURM_TOPOLOGY_ADDR='spine.su1.bad1' does not match SLURM_TOPOLOGY_ADDR_PATTERN='switch.node'",
    "slurm-host": "slurm:{d}/etc/slurm/topology.conf: host 'bad1' is under no switch",
}


def test_every_malformed_fixture_is_a_named_error():
    assert sorted(BAD) == sorted(p.name for p in (NODES / "bad").iterdir())
    for name, want in BAD.items():
        d = str(NODES / "bad" / name)
        with pytest.raises(TopologyError) as err:
            collect_node_facts(Machine(d))
        assert str(err.value).startswith(want.format(d=d)), (name, str(err.value))


def test_replayed_nodes_give_their_facts():
    a = node("nodeA-2x200")
    assert (a.host, a.device, a.device_count, a.islands, a.island_links, a.islands_from) == (
        "nodeA", "NVIDIA A100-SXM4-80GB", 2, ((0, 1),), 4, "nvidia-smi")
    assert [(n.name, n.kind, n.rate_gbit, n.up) for n in a.fast_nics()] == [
        ("mlx5_0:1", "infiniband", 200.0, True), ("mlx5_1:1", "infiniband", 200.0, True)]
    b = node("nodeB-1x100")
    assert [n.name for n in b.fast_nics()] == ["mlx5_0:1"] and not b.missing
    amd = node("amd-rocm")
    assert (amd.device_count, amd.islands, amd.islands_from) == (4, ((0, 1, 2, 3),), "rocm-smi")
    assert {n.kind for n in amd.nics} == {"roce"} and amd.missing[0].startswith("XGMI link bandwidth")
    cpu = node("cpu-slurm")
    assert (cpu.device_count, cpu.islands_from, cpu.leaf, cpu.pod) == (0, "none", "leaf1", "spine")
    assert [(n.name, n.rate_gbit) for n in cpu.fast_nics()] == [("eth0", 100.0)]
    assert NodeFacts.from_json(json.loads(json.dumps(a.to_json()))) == a


def test_facts_from_json_names_the_bad_field():
    good = node("nodeA-2x200").to_json()
    for field, value, want in (("device_count", -1, "device_count = -1; expected an integer in [0, 4096]"),
                               ("islands", [[0]], "islands = [[0]]; expected a partition of the devices 0..1"),
                               ("local_rank", "0", "local_rank = '0'; expected an integer >= 0 or null")):
        with pytest.raises(TopologyError, match=rf"^facts of rank 5: {__import__('re').escape(want)}"):
            NodeFacts.from_json({**good, field: value}, who="facts of rank 5")


def test_heterogeneous_nodes_are_described_as_they_are():
    topo = topology_from_facts(ranks_of(("nodeA-2x200", 2), ("nodeB-1x100", 2)))
    assert list(topo.islands.values()) == [[0, 1], [2, 3]]
    assert (topo.tiers["island"].bandwidth_gbps, topo.tiers["island"].origin) == (80.0, "nvlink")
    leaf = topo.tiers["leaf"]
    assert (leaf.bandwidth_gbps, leaf.origin) == (pytest.approx(6.0), "nic-rate")
    assert leaf.detail == "slowest host nodeB: 1 x 100 Gb/s infiniband for 2 rank(s)"
    assert not topo.warnings
    plan = plan_groups(topo)
    assert plan.hierarchical and (plan.inter_origin, plan.intra_origin) == ("nic-rate", "nvlink")
    table = format_topology(topo)
    assert "nodeB  2      2 x NVIDIA A100-SXM4-80GB (nvidia-smi)  [0,1]    1 x 100 Gb/s infiniband (+2 down)" in table
    assert "leaf    6             nic-rate  slowest host nodeB" in table


def test_tiers_within_the_ratio_fall_back_to_flat():
    plan = plan_groups(topology_from_facts(ranks_of(("nodeC-nv1", 2), ("nodeD-nv1", 2))))
    assert not plan.hierarchical
    assert plan.reason == ("intra tier 'island' (20 GB/s, nvlink) and inter tier 'leaf' (24 GB/s, nic-rate) "
                           "differ by 0.83x < min_tier_ratio 1.3")


def test_a_default_is_used_only_with_one_warning_naming_the_missing_fact():
    cpu = replace(node("cpu-slurm"), leaf=None, pod=None)
    facts = [replace(cpu, host=h, local_rank=lr) for h in ("a", "b") for lr in range(2)]
    nic_less = [replace(f, nics=()) if f.host == "b" else f for f in facts]
    topo = topology_from_facts(nic_less)
    assert topo.tiers["island"].origin == "default" and topo.tiers["leaf"].origin == "default"
    assert len(topo.warnings) == 2
    assert topo.warnings[0].startswith("island tier: no NVLink bandwidth for host(s) a, b (NVLink islands (no NVML")
    assert topo.warnings[1].startswith("leaf/spine tiers: no NIC rate for host(s) b (")
    assert topology_from_facts(facts).tiers["leaf"].origin == "nic-rate"  # 100 Gb/s Ethernet on both


def test_facts_that_disagree_or_collide_are_named():
    a = ranks_of(("nodeA-2x200", 2))
    with pytest.raises(TopologyError, match="ranks 0 and 1 both run on host 'nodeA' but report different device_count"):
        topology_from_facts([a[0], replace(a[1], device_count=4, islands=((0, 1, 2, 3),))])
    with pytest.raises(TopologyError, match="ranks 0 and 1 on host 'nodeA' both report local rank 0"):
        topology_from_facts([a[0], replace(a[1], local_rank=0)])
    with pytest.raises(TopologyError, match="rank 1 is local rank 5 on host 'nodeA', which has 2 GPUs"):
        topology_from_facts([a[0], replace(a[1], local_rank=5)])
    with pytest.raises(TopologyError, match="host 'cpu07' reports Slurm leaf 'leaf1' but host 'nodeA' reports none"):
        topology_from_facts([replace(node("cpu-slurm"), local_rank=0), a[0]])


def test_probe_groups_and_measured_tiers():
    facts = ranks_of(("nodeA-2x200", 2), ("nodeB-1x100", 2))
    topo = topology_from_facts(facts)
    assert probe_groups(topo) == {"island": [[0, 1], [2, 3]], "leaf": [[0, 2], [1, 3]]}
    two_leaves = topology_from_facts([replace(f, leaf=f"l{i // 2}", pod="p") for i, f in enumerate(facts)])
    assert probe_groups(two_leaves) == {"island": [[0, 1], [2, 3]], "spine": [[0, 2], [1, 3]]}
    m = with_measured(topo, {"leaf": (0.5, "probe")})
    assert (m.tiers["leaf"].bandwidth_gbps, m.tiers["leaf"].origin) == (0.5, "measured")
    assert m.tiers["island"].origin == "nvlink"
    assert m.tiers["leaf"].latency_us == topo.tiers["leaf"].latency_us  # none measured: the tier's own
    m = with_measured(topo, {"leaf": (0.5, "probe", 120.0)})
    assert (m.tiers["leaf"].bandwidth_gbps, m.tiers["leaf"].latency_us) == (0.5, 120.0)
    with pytest.raises(TopologyError, match="probe: tier leaf measured 0.0 GB/s"):
        with_measured(topo, {"leaf": (0.0, "probe")})
    with pytest.raises(TopologyError,
                       match=r"^probe: tier leaf measured a latency of -1.0 us; expected a number >= 0$"):
        with_measured(topo, {"leaf": (0.5, "probe", -1.0)})


def test_measured_bandwidth_and_latency_of_the_slowest_group():
    from topo_integrations.reducer.plan.discover import PROBE_ITERS, _measured

    groups = {"leaf": [[0, 2], [1, 3]]}
    # seconds per rank: (1 MiB all-reduce, 1-element all-reduce); rank 3 is the slow member
    secs = {0: {"leaf": (0.01, 2e-4)}, 2: {"leaf": (0.01, 2e-4)}, 1: {"leaf": (0.01, 2e-4)},
            3: {"leaf": (0.02, 6e-4)}}
    bw, how, lat = _measured(groups, secs, 2**20)["leaf"]
    assert bw == pytest.approx(2 * 1 / 2 * 2**20 / 0.02 / 1e9)  # the group {1, 3}, as slow as rank 3
    assert lat == pytest.approx(6e-4 / 2 * 1e6)  # one step of a 2-rank ring: 2(n-1) = 2 steps
    assert how.startswith(f"median of {PROBE_ITERS} all-reduces of 1 MiB (latency: fastest of {PROBE_ITERS} "
                          "1-element ones)")
    assert how.endswith("slowest of 2 group(s): global ranks 1, 3")


def test_capture_writes_a_tree_that_replays_the_same_node(tmp_path):
    for name in ("nodeA-2x200", "cpu-slurm", "amd-rocm"):
        facts = capture_node(str(tmp_path / name), Machine(str(NODES / name)))
        assert facts == node(name)
        assert collect_node_facts(Machine(str(tmp_path / name))) == facts
        assert NodeFacts.from_json(json.loads((tmp_path / name / "facts.json").read_text())) == facts
    with pytest.raises(TopologyError, match="exists and is not an empty directory"):
        capture_node(str(tmp_path / "cpu-slurm"), Machine(str(NODES / "cpu-slurm")))


def test_nvml_is_read_when_importable(monkeypatch):
    nv = types.SimpleNamespace(
        NVML_P2P_CAPS_INDEX_NVLINK=3, NVML_P2P_STATUS_OK=0, NVML_NVLINK_MAX_LINKS=4, NVML_FEATURE_ENABLED=1,
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 4, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        # bridged pairs 0-1 and 2-3, two active links each
        nvmlDeviceGetP2PStatus=lambda a, b, cap: 0 if a // 2 == b // 2 else 2,
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 2 else 0)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    f = collect_node_facts(Machine(None))
    assert (f.device, f.device_count, f.islands, f.island_links, f.islands_from) == (
        "NVIDIA H100 80GB HBM3", 4, ((0, 1), (2, 3)), 2, "nvml")


def test_cli_show_and_capture(tmp_path, capsys):
    a, b = NODES / "nodeA-2x200", NODES / "nodeB-1x100"
    assert main(["show", f"capture:{a},{b}"]) == 0
    out = capsys.readouterr().out
    assert "nodeA  2      2 x NVIDIA A100-SXM4-80GB (nvidia-smi)  [0,1]    2 x 200 Gb/s infiniband" in out
    assert "island  80            nvlink" in out
    assert main(["show", f"capture:{a},{b}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["topology"]["tier_origins"]["leaf"]["origin"] == "nic-rate"
    assert [h["host"] for h in data["hosts"]] == ["nodeA", "nodeB"]
    assert main(["show", f"capture:{NODES / 'bad' / 'ib-rate'}"]) == 2
    assert "'fast'; expected '<n> Gb/sec (...)'" in capsys.readouterr().err
    assert main(["show", f"capture:{a}", "file:x.json"]) == 2
    assert "capture: describes whole nodes; give it alone" in capsys.readouterr().err
    assert main(["capture", str(tmp_path / "me")]) == 0
    assert capsys.readouterr().out.startswith("captured ")
    assert main(["show", f"capture:{tmp_path / 'me'}"]) == 0
