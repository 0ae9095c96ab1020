"""Property tests: arbitrary or truncated input to every parser (and the config) yields the documented
error type (`TopologyError` / `ConfigError`, both ValueError) or a valid result, never another exception."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topo_integrations.config import ConfigError, TopoAlignConfig, load_json_text
from topo_integrations.topology import TopologyError, plan_groups
from topo_integrations.topology.file_source import topology_from_dict
from topo_integrations.topology.hostfile import parse_hostfile
from topo_integrations.topology.hostlist import compress_hostlist, expand_hostlist
from topo_integrations.topology.layout import build_topology
from topo_integrations.topology.nccl_xml import parse_nccl_xml
from topo_integrations.topology.nvidia_smi import parse_nvidia_smi
from topo_integrations.topology.slurm import parse_topology_conf
from topo_integrations.topology.sysfs_ib import read_ib_ports

pytestmark = pytest.mark.timeout(180)

FIX = Path(__file__).parent / "fixtures" / "topology"
SMI = [(FIX / n).read_text() for n in ("nvidia-smi-topo-dgx-a100.txt", "nvidia-smi-topo-dgx-h100.txt",
                                       "nvidia-smi-topo-dgx1v-mlx5.txt", "nvidia-smi-topo-bridged-pairs.txt")]
XML = (FIX / "nccl-topo-dgx-a100.xml").read_text()
CONF = (FIX / "topology.conf").read_text()
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ok_or_topology_error(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except TopologyError as exc:
        assert "\n" not in str(exc), f"multi-line message: {exc!r}"
        return None


def _mutate(text: str, cut: int, pos: int, junk: str) -> str:
    """Truncate at ``cut`` (fraction of the length) and splice ``junk`` at ``pos``."""
    t = text[: int(len(text) * cut)]
    p = int(len(t) * pos)
    return t[:p] + junk + t[p:]


fractions = st.floats(min_value=0.0, max_value=1.0)
tokens = st.sampled_from(["NV12", "X", " X ", "SYS", "GPU0", "GPU9", "NIC0", "\t", "\n", "NV", "NV999999", "mlx5_0",
                          "<", ">", "<!DOCTYPE x>", "<gpu dev='1'/>", "=", "Nodes=", "[", "]", "-", ",", "slots=0",
                          "Legend:", "\x00", "é", "#"])


@FAST
@given(st.sampled_from(SMI), fractions, fractions, st.lists(tokens, max_size=5).map("".join))
def test_nvidia_smi_truncated_or_mutated(text, cut, pos, junk):
    node = _ok_or_topology_error(parse_nvidia_smi, _mutate(text, cut, pos, junk))
    if node is not None:
        assert sorted(r for i in node.islands for r in i) == list(range(node.gpus))


@FAST
@given(st.text(max_size=400))
def test_nvidia_smi_arbitrary(text):
    _ok_or_topology_error(parse_nvidia_smi, text)


@FAST
@given(fractions, fractions, st.lists(tokens, max_size=5).map("".join))
def test_nccl_xml_truncated_or_mutated(cut, pos, junk):
    node = _ok_or_topology_error(parse_nccl_xml, _mutate(XML, cut, pos, junk))
    if node is not None:
        assert node.gpus >= 1


@FAST
@given(st.text(max_size=300))
def test_nccl_xml_arbitrary(text):
    _ok_or_topology_error(parse_nccl_xml, "<system>" + text)
    _ok_or_topology_error(parse_nccl_xml, text)


@FAST
@given(fractions, fractions, st.lists(tokens, max_size=5).map("".join), st.text(max_size=40))
def test_slurm_truncated_mutated_arbitrary(cut, pos, junk, text):
    tree = _ok_or_topology_error(parse_topology_conf, _mutate(CONF, cut, pos, junk))
    if tree is not None:
        assert all(h in tree.leaf_of for h in tree.hosts)
    _ok_or_topology_error(parse_topology_conf, text)


@FAST
@given(st.text(max_size=200))
def test_hostfile_arbitrary(text):
    hosts = _ok_or_topology_error(parse_hostfile, text)
    if hosts is not None:
        topo = _ok_or_topology_error(build_topology, hosts, default_gpus=1)
        if topo is not None:
            _ok_or_topology_error(plan_groups, topo)


@FAST
@given(st.text(alphabet="ab01-9[],x ", max_size=30))
def test_hostlist_arbitrary(text):
    names = _ok_or_topology_error(expand_hostlist, text)
    if names is not None and len(names) < 1000:
        assert expand_hostlist(compress_hostlist(names)) == names


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
leaf_docs = st.fixed_dictionaries(
    {
        "leaves": st.lists(
            st.fixed_dictionaries(
                {"hosts": st.sampled_from(["a[1-2]", "b[1-3]", "a1", "c[01-02]", "", 3])},
                optional={"name": st.sampled_from(["l0", "l1", ""]), "pod": st.sampled_from(["p0", "p1"])},
            ),
            max_size=3,
        )
    },
    optional={
        "gpus_per_node": st.integers(-1, 9),
        "island_size": st.none() | st.integers(0, 5),
        "tiers": st.dictionaries(
            st.sampled_from(["island", "leaf", "spine", "host", "x"]),
            st.dictionaries(
                st.sampled_from(["bandwidth_gbps", "latency_us", "oversubscription"]),
                st.floats(allow_nan=True) | st.integers(-5, 500),
            ),
            max_size=3,
        ),
        "islands": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["r0", "r1"]), "hosts": st.sampled_from(["a[1-2]", "b1", "zz"])}
            ),
            max_size=2,
        ),
    },
)


@FAST
@given(json_values | leaf_docs)
def test_topology_file_arbitrary(doc):
    topo = _ok_or_topology_error(topology_from_dict, doc)
    if topo is not None:
        for gb in ("island", "leaf"):
            _ok_or_topology_error(plan_groups, topo, group_by=gb, middle_level=True)


config_docs = st.fixed_dictionaries(
    {},
    optional={
        "mode": st.sampled_from(["flat", "hierarchical", "selective", "x", 1]),
        "topology": st.dictionaries(
            st.sampled_from(["source", "file", "group_by", "min_tier_ratio", "zz"]),
            st.sampled_from(["auto", "slurm", "leaf", None, 0.5, 2.0, "x"]),
            max_size=4,
        ),
        "sync": st.dictionaries(
            st.sampled_from(["last_n_layers", "top_fraction", "dtype", "always_sync", "layer_pattern"]),
            json_values,
            max_size=3,
        ),
        "local": st.dictionaries(
            st.sampled_from(["dtype", "reconcile_interval", "async_reconcile"]), json_values, max_size=3
        ),
        "enabled": json_values,
    },
)


@FAST
@given(json_values | config_docs)
def test_config_arbitrary(block):
    try:
        TopoAlignConfig.from_block(block)
    except ConfigError as exc:
        assert str(exc).startswith("topo_align")


@FAST
@given(st.text(max_size=200) | st.sampled_from(["[" * 5000, '{"a":' * 100 + "1" + "}" * 100, "1" * 5000]))
def test_config_json_text_arbitrary(text):
    try:
        data = load_json_text(text, where="c.json")
    except ConfigError:
        return
    try:
        TopoAlignConfig.from_block(data)
    except ConfigError:
        pass


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.text(max_size=20))
def test_sysfs_arbitrary_files(rate, state):
    with tempfile.TemporaryDirectory() as root:
        p = os.path.join(root, "mlx5_0", "ports", "1")
        os.makedirs(p)
        for name, value in (
            ("rate", rate),
            ("state", state),
            ("phys_state", "5: LinkUp"),
            ("link_layer", "InfiniBand"),
        ):
            with open(os.path.join(p, name), "w", encoding="utf-8", errors="surrogateescape") as fh:
                fh.write(value)
        _ok_or_topology_error(read_ib_ports, root)


@FAST
@given(st.lists(st.sampled_from(["a", "b", "c", "", " ", "x" * 300]) | st.integers(0, 3), max_size=12),
       st.none() | st.lists(st.integers(-1, 3) | st.booleans(), max_size=12))
def test_hostnames_arbitrary(names, local_ranks):
    from topo_integrations.topology.hostnames import topology_from_hostnames

    topo = _ok_or_topology_error(topology_from_hostnames, names, local_ranks=local_ranks)
    if topo is not None:
        assert topo.world_size == len(names)
        _ok_or_topology_error(plan_groups, topo)


@FAST
@given(
    st.lists(
        st.text(max_size=20)
        | st.sampled_from(
            [
                "file:",
                "slurm:",
                "nvidia-smi:/nonexistent",
                "sysfs-ib:/x",
                "hostfile:/dev/null",
                "file:/dev/null",
                "file:a\x00b",
                "nccl-xml:a\x00",
                "slurm:/dev/null,x[",
            ]
        ),
        max_size=3,
    )
)
def test_source_specs_arbitrary(specs):
    from topo_integrations.topology.sources import load_sources

    _ok_or_topology_error(load_sources, specs)
