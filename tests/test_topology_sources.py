"""Topology sources: nvidia-smi text, NCCL XML, Slurm topology.conf, hostfile, sysfs IB, gathered
hostnames, and their combination through load_source / load_sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from topo_integrations.topology import TopologyError, plan_groups
from topo_integrations.topology.hostfile import parse_hostfile
from topo_integrations.topology.hostnames import topology_from_hostnames
from topo_integrations.topology.nccl_xml import parse_nccl_xml
from topo_integrations.topology.nvidia_smi import parse_nvidia_smi
from topo_integrations.topology.slurm import parse_topology_conf
from topo_integrations.topology.sources import load_source, load_sources
from topo_integrations.topology.sysfs_ib import ib_net_gbps, read_ib_ports

pytestmark = pytest.mark.timeout(60)

FIX = Path(__file__).parent / "fixtures" / "topology"
A100_SMI = FIX / "nvidia-smi-topo-dgx-a100.txt"
H100_SMI = FIX / "nvidia-smi-topo-dgx-h100.txt"
DGX1_SMI = FIX / "nvidia-smi-topo-dgx1v-mlx5.txt"
PAIRS_SMI = FIX / "nvidia-smi-topo-bridged-pairs.txt"
A100_XML = FIX / "nccl-topo-dgx-a100.xml"
SLURM = FIX / "topology.conf"

# sysfs values of the DGX A100 in ib-discovery-examples.txt (device, state, phys_state, rate, link layer).
A100_SYSFS = [
    ("mlx5_0", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_1", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_2", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_3", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_4", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_5", "1: DOWN", "3: Disabled", "10 Gb/sec (4X SDR)", "Ethernet"),
    ("mlx5_6", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_7", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_8", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ("mlx5_9", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"),
]


def make_sysfs(root: Path, rows=A100_SYSFS, rate_override: str | None = None) -> Path:
    for dev, state, phys, rate, ll in rows:
        p = root / dev / "ports" / "1"
        p.mkdir(parents=True)
        (p / "state").write_text(state + "\n")
        (p / "phys_state").write_text(phys + "\n")
        (p / "rate").write_text((rate_override or rate) + "\n")
        (p / "link_layer").write_text(ll + "\n")
    return root


def shape(groups):
    return len(groups), sorted({len(g) for g in groups})


# -- nvidia-smi ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,gpus,nics,island_gbps", [
    (A100_SMI, 8, 10, 240.0),   # NV12 to every peer: NVSwitch, 12 links
    (H100_SMI, 8, 12, 360.0),   # NV18
    (DGX1_SMI, 8, 4, 120.0),    # hybrid cube mesh: NV1+NV1+NV2+NV2 = 6 links per GPU
])
def test_nvidia_smi_one_island_of_eight(path, gpus, nics, island_gbps):
    node = parse_nvidia_smi(path.read_text(), source=str(path))
    assert node.gpus == gpus
    assert node.islands == (tuple(range(8)),)
    assert len(node.nics) == nics
    assert node.island_tier.bandwidth_gbps == island_gbps


def test_nvidia_smi_nic_legend_and_old_mlx5_columns():
    assert parse_nvidia_smi(A100_SMI.read_text()).nics[:2] == ("mlx5_0", "mlx5_1")
    assert parse_nvidia_smi(DGX1_SMI.read_text()).nics == ("mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3")


def test_nvidia_smi_bridged_pairs_give_islands_of_two():
    node = parse_nvidia_smi(PAIRS_SMI.read_text())
    assert node.gpus == 4 and node.islands == ((0, 1), (2, 3))
    assert node.island_tier.bandwidth_gbps == 80.0  # NV4
    topo = load_source("nvidia-smi", str(PAIRS_SMI), nodes=3)
    assert topo.world_size == 12 and len(topo.islands) == 6
    assert topo.tiers_present() == ["island", "host", "leaf"]
    plan = plan_groups(topo)
    assert plan.hierarchical
    assert shape(plan.intra_groups) == (6, [2]) and shape(plan.inter_groups) == (2, [6])
    assert plan.intra_groups[:2] == ((0, 1), (2, 3))


def test_nvidia_smi_tabs_and_spaces_parse_alike():
    tabs = A100_SMI.read_text()
    spaces = tabs.replace("\t", "    ")
    assert parse_nvidia_smi(tabs).islands == parse_nvidia_smi(spaces).islands
    assert parse_nvidia_smi(tabs).nics == parse_nvidia_smi(spaces).nics


def test_nvidia_smi_unequal_islands_refused_by_planner_naming_sizes():
    text = PAIRS_SMI.read_text().replace("GPU2    SYS    SYS     X    NV4", "GPU2    SYS    SYS     X    SYS") \
        .replace("GPU3    SYS    SYS    NV4", "GPU3    SYS    SYS    SYS")
    node = parse_nvidia_smi(text)
    assert node.islands == ((0, 1), (2,), (3,))
    p = FIX.parent / "_tmp_unequal.txt"
    try:
        p.write_text(text)
        topo = load_source("nvidia-smi", str(p), nodes=2)
    finally:
        p.unlink()
    with pytest.raises(TopologyError) as err:
        plan_groups(topo)
    msg = str(err.value)
    assert "unequal sizes (2 x 2, 4 x 1 ranks" in msg and "'node0/i1' has 1" in msg


def test_nvidia_smi_errors_name_line_and_accepted_values():
    bad = A100_SMI.read_text().replace("GPU3\tNV12\tNV12\tNV12", "GPU3\tNV12\tNVX\tNV12", 1)
    with pytest.raises(TopologyError) as err:
        parse_nvidia_smi(bad, source="f.txt")
    assert str(err.value) == ("f.txt: line 10: row 'GPU3', column 'GPU1' = 'NVX'; accepted: X, SYS, SOC, NODE, PHB, "
                              "PXB, PIX, NV<n> ('X' only on the diagonal)")
    with pytest.raises(TopologyError, match=r"^f.txt: no header row starting with 'GPU0'"):
        parse_nvidia_smi("hello\nworld\n", source="f.txt")
    truncated = "\n".join(A100_SMI.read_text().splitlines()[:8])
    with pytest.raises(TopologyError, match=r"no row for GPU2; expected one row per GPU column"):
        parse_nvidia_smi(truncated, source="f.txt")
    lines = A100_SMI.read_text().splitlines()
    assert lines[13].startswith("GPU7")
    lines[13] = "\t".join(lines[13].split("\t")[:5])  # a row cut short (copy-paste)
    with pytest.raises(TopologyError) as err:
        parse_nvidia_smi("\n".join(lines), source="f.txt")
    assert str(err.value) == "f.txt: line 14: row 'GPU7' has 4 cells; expected 18 (one per device column)"


# -- NCCL XML --------------------------------------------------------------------------------------

def test_nccl_xml_dgx_a100():
    node = parse_nccl_xml(A100_XML.read_text())
    assert node.gpus == 8 and node.islands == (tuple(range(8)),)
    assert node.island_tier.bandwidth_gbps == 240.0  # 6 NVSwitches x 2 links
    assert node.net_tier_gbps == pytest.approx(24.0)  # 200 Gb/s per GPU rail x 0.96
    assert len(node.nics) == 10


def test_nccl_xml_direct_gpu_links_form_pairs():
    gpu = ('<pci busid="0000:{a}:00.0" class="0x030200"><gpu dev="{d}" sm="86" rank="{d}">'
           '<nvlink target="0000:{b}:00.0" count="4" tclass="0x030200"/></gpu></pci>')
    pcis = "\n ".join(gpu.format(a=a, b=b, d=d) for d, (a, b) in enumerate([("01", "02"), ("02", "01"),
                                                                             ("81", "82"), ("82", "81")]))
    xml = f"""<?xml version="1.0"?>
<system version="1"><cpu numaid="0">
 {pcis}
</cpu></system>"""
    node = parse_nccl_xml(xml)
    assert node.islands == ((0, 1), (2, 3)) and node.island_tier.bandwidth_gbps == 80.0
    assert node.net_tier_gbps is None


@pytest.mark.parametrize(
    "doc,needle",
    [
        (
            '<?xml version="1.0"?><!DOCTYPE system [<!ENTITY a "aaaa">]><system>&a;</system>',
            "line 1: <!DOCTYPE is refused",
        ),
        ('<system>\n<!ENTITY x SYSTEM "file:///etc/passwd"></system>', "line 2: <!ENTITY is refused"),
        ("<system><cpu>", "not well-formed XML"),
        ("<topology/>", "root element <topology>; expected <system>"),
        ("<system/>", "no <gpu> elements"),
        (
            '<system><pci busid="1"><gpu dev="x"/></pci></system>',
            "<gpu> attribute dev='x'; expected an integer in [0, 4095]",
        ),
        ('<system><gpu dev="0"/></system>', "is not inside a <pci busid=...>"),
    ],
)
def test_nccl_xml_refuses_bad_input(doc, needle):
    with pytest.raises(TopologyError) as err:
        parse_nccl_xml(doc, source="x.xml")
    assert str(err.value).startswith("x.xml: ") and needle in str(err.value)


# -- Slurm ------------------------------------------------------------------------------------------

def test_slurm_fixture_su_as_leaf():
    tree = parse_topology_conf(SLURM.read_text())
    assert len(tree.hosts) == 120 and tree.hosts[0] == "dgx001"
    assert tree.leaf_of["dgx045"] == "su3" and tree.pod_of_leaf["su3"] == "spine"
    topo = load_source("slurm", str(SLURM))
    assert topo.world_size == 960 and len(topo.leaves) == 6
    plan = plan_groups(topo, middle_level=True)
    assert shape(plan.intra_groups) == (120, [8]) and shape(plan.inter_groups) == (8, [120])
    assert shape(plan.leaf_rails) == (48, [20]) and shape(plan.spine_rails) == (160, [6])
    assert plan.middle_level


def test_slurm_with_nodelist_and_nvidia_smi_islands():
    topo = load_sources([f"slurm:{SLURM},dgx[001-020,045]", f"nvidia-smi:{A100_SMI}"])
    assert topo.world_size == 21 * 8 and set(topo.leaves) == {"su1", "su3"}
    assert topo.tiers["island"].bandwidth_gbps == 240.0
    plan = plan_groups(topo)
    assert shape(plan.intra_groups) == (21, [8])


def test_slurm_nodelist_order_is_rank_order_and_planner_reorders():
    topo = load_source("slurm", f"{SLURM},dgx[041,001,042,002]", gpus_per_node=2)
    assert [topo.ranks[r].host for r in (0, 2, 4, 6)] == ["dgx041", "dgx001", "dgx042", "dgx002"]
    plan = plan_groups(topo)
    assert plan.host_order == ("dgx041", "dgx042", "dgx001", "dgx002") and plan.rank_order_changes == 2


def test_slurm_three_level_tree_pods_and_block_plugin():
    conf = ("# comment\nSwitchName=l1 Nodes=a[1-2]\nSwitchName=l2 Nodes=a[3-4]\nswitchname=l3 nodes=b[1-2]\n"
            "SwitchName=p1 Switches=l[1-2]\nSwitchName=p2 Switches=l3\nSwitchName=core Switches=p[1-2]\n")
    tree = parse_topology_conf(conf)
    assert tree.pod_of_leaf == {"l1": "p1", "l2": "p1", "l3": "p2"}
    blocks = parse_topology_conf("BlockName=b1 Nodes=n[1-4]\nBlockName=b2 Nodes=n[5-8]\nBlockSizes=4,8\n")
    assert blocks.leaf_of["n6"] == "b2" and blocks.pod_of_leaf["b2"] == "pod0"


@pytest.mark.parametrize(
    "conf,msg",
    [
        (
            "SwitchName=s1 Nodes=a[1-2] Speed=3",
            "t.conf: line 1: 'Speed=3'; accepted: SwitchName=, Nodes=, Switches=, LinkSpeed=",
        ),
        ("SwitchName=s1 Nodes=a1\nSwitchName=s2 Nodes=a1", "t.conf: line 2: node 'a1' is already under switch 's1'"),
        (
            "SwitchName=s1 Nodes=a1\nSwitchName=top Switches=s[1-2]",
            "t.conf: line 2: Switches= names 's2', which no line defines",
        ),
        ("SwitchName=s1 Nodes=a[1-", "t.conf: line 1: Nodes=: hostlist 'a[1-': '[' without ']'"),
        ("SwitchName=top Switches=x", "t.conf: no switch with Nodes="),
        ("Nodes=a1", "t.conf: line 1: expected exactly one SwitchName= or BlockName= per line"),
    ],
)
def test_slurm_errors(conf, msg):
    with pytest.raises(TopologyError) as err:
        parse_topology_conf(conf, source="t.conf")
    assert str(err.value).startswith(msg)


def test_slurm_node_outside_tree():
    with pytest.raises(TopologyError, match=r"node 'dgx999' of the node list is under no switch"):
        load_source("slurm", f"{SLURM},dgx[001,999]")


# -- hostfile ---------------------------------------------------------------------------------------

def test_hostfile():
    hosts = parse_hostfile("# DeepSpeed\nworker-1 slots=4\n\nworker-2 slots=4 max_slots=8  # x\nworker-3\n")
    assert [(h.host, h.gpus) for h in hosts] == [("worker-1", 4), ("worker-2", 4), ("worker-3", 1)]
    with pytest.raises(TopologyError, match=r"^h: line 2: 'slot=4'; accepted: slots=N"):
        parse_hostfile("a slots=1\nb slot=4\n", source="h")
    with pytest.raises(TopologyError, match=r"^h: line 2: host 'a' already listed on line 1"):
        parse_hostfile("a slots=1\na slots=1\n", source="h")
    with pytest.raises(TopologyError, match=r"^h: no hosts"):
        parse_hostfile("# only a comment\n", source="h")


def test_hostfile_with_nvidia_smi(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("n1 slots=4\nn2\n")
    topo = load_sources([f"hostfile:{hf}", f"nvidia-smi:{PAIRS_SMI}"])
    assert topo.world_size == 8 and len(topo.islands) == 4
    hf.write_text("n1 slots=8\n")
    with pytest.raises(TopologyError, match=r"host 'n1' has 8 ranks but nvidia-smi:.* describes a node of 4 GPUs"):
        load_sources([f"hostfile:{hf}", f"nvidia-smi:{PAIRS_SMI}"])


# -- sysfs IB ---------------------------------------------------------------------------------------

def test_sysfs_ib_ports_and_rate(tmp_path):
    root = make_sysfs(tmp_path / "ib")
    ports = read_ib_ports(str(root))
    assert len(ports) == 10 and sum(p.healthy for p in ports) == 9
    assert ports[5].device == "mlx5_5" and ports[5].phys_state == "Disabled" and ports[5].rate_gbit == 10
    assert ib_net_gbps(ports, 8) == pytest.approx(24.0)
    assert read_ib_ports(str(tmp_path / "absent")) == []


def test_sysfs_ib_sets_leaf_and_spine(tmp_path):
    root = make_sysfs(tmp_path / "ib", rate_override="400 Gb/sec (4X NDR)")
    topo = load_sources([f"file:{Path(__file__).parents[1] / 'configs/topologies/dgx-a100-superpod-960-2to1.json'}",
                         f"sysfs-ib:{root}"])
    assert topo.tiers["leaf"].bandwidth_gbps == pytest.approx(48.0)
    assert topo.tiers["spine"].bandwidth_gbps == pytest.approx(48.0)
    assert topo.tiers["spine"].oversubscription == 2.0


def test_sysfs_ib_bad_rate(tmp_path):
    root = make_sysfs(tmp_path / "ib", rate_override="fast")
    with pytest.raises(TopologyError, match=r"rate: 'fast'; expected '<n> Gb/sec \(...\)'"):
        read_ib_ports(str(root))


# -- gathered hostnames -----------------------------------------------------------------------------

def test_hostnames_non_consecutive_ranks():
    names = ["a", "b", "a", "b", "a", "b", "a", "b"]  # round-robin placement
    topo = topology_from_hostnames(names)
    assert topo.hosts == {"a": [0, 2, 4, 6], "b": [1, 3, 5, 7]}
    assert [topo.ranks[r].local_rank for r in range(4)] == [0, 0, 1, 1]
    plan = plan_groups(topo)
    assert plan.intra_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert plan.inter_groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_hostnames_with_islands_and_local_ranks():
    node = parse_nvidia_smi(PAIRS_SMI.read_text())
    topo = topology_from_hostnames(["x", "x", "x", "x"], local_ranks=[3, 2, 1, 0], node=node)
    assert topo.islands == {"x/i1": [0, 1], "x/i0": [2, 3]}
    with pytest.raises(TopologyError, match=r"ranks share host 'x' and local rank 0"):
        topology_from_hostnames(["x", "x"], local_ranks=[0, 0])
    with pytest.raises(TopologyError, match=r"rank 1 reports host ''"):
        topology_from_hostnames(["x", ""])


# -- load_sources -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "specs,kw,msg",
    [
        (
            ["bogus:x"],
            {},
            "source 'bogus:x': unknown KIND 'bogus'; accepted: file, nvidia-smi, nccl-xml, slurm, hostfile, sysfs-ib",
        ),
        (["nvidia-smi"], {}, "source 'nvidia-smi': expected KIND:PATH"),
        (["file:"], {}, "source 'file:': empty PATH after file:"),
        ([f"nvidia-smi:{A100_SMI}", f"nccl-xml:{A100_XML}"], {}, "combine at most one host source"),
        (
            [f"file:{A100_SMI}", f"nvidia-smi:{A100_SMI}"],
            {},
            "file: is a complete topology; combine it only with sysfs-ib",
        ),
        (["sysfs-ib:/nonexistent"], {}, "sysfs-ib gives only link rates"),
        ([f"nvidia-smi:{A100_SMI}"], {"nodes": 0}, "nodes = 0; expected a count in [1, 1000000] or a hostlist"),
        ([f"nvidia-smi:{A100_SMI}"], {"gpus_per_node": 4}, "gpus_per_node = 4 but nvidia-smi:"),
        ([f"nvidia-smi:{FIX / 'missing.txt'}"], {}, "cannot read file"),
        ([f"nvidia-smi:{A100_SMI}"], {"colour": 1}, "unknown source option 'colour'"),
    ],
)
def test_load_sources_errors(specs, kw, msg):
    with pytest.raises(TopologyError) as err:
        load_sources(specs, **kw)
    assert msg in str(err.value) and "\n" not in str(err.value)


def test_single_node_sources_replicate_over_hostlist():
    topo = load_source("nccl-xml", str(A100_XML), nodes="dgx[01-04]")
    assert list(topo.hosts) == ["dgx01", "dgx02", "dgx03", "dgx04"]
    assert topo.tiers["leaf"].bandwidth_gbps == pytest.approx(24.0)
    plan = plan_groups(topo)
    assert shape(plan.intra_groups) == (4, [8]) and shape(plan.inter_groups) == (8, [4])
    one = load_source("nvidia-smi", str(H100_SMI))
    assert list(one.hosts) == ["node0"] and plan_groups(one).hierarchical is False


def test_not_utf8(tmp_path):
    p = tmp_path / "x.txt"
    p.write_bytes(b"\xff\xfe GPU0")
    with pytest.raises(TopologyError, match=r"not UTF-8 text"):
        load_source("nvidia-smi", str(p))
