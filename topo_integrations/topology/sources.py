"""One entry point for every topology source: ``KIND:PATH`` strings, combined.

    load_source("slurm", "topology.conf,dgx[001-040]", gpus_per_node=8)
    load_sources(["slurm:topology.conf,dgx[001-040]", "nvidia-smi:topo.txt"])

KINDs and what each gives:

    file        a complete topology (JSON, docs/topology-format.md)
    slurm       hosts, leaves, pods  (PATH = topology.conf[,NODELIST])
    hostfile    hosts and their slots (DeepSpeed / MPI hostfile)
    nvidia-smi  one node's GPUs and NVLink islands (``nvidia-smi topo -m`` text)
    nccl-xml    one node's GPUs, NVLink islands and NIC rates (NCCL topology XML)
    sysfs-ib    leaf/spine bandwidth from the IB port rates (PATH = /sys/class/infiniband or a copy)
    capture     captured nodes (`topo-align capture DIR`; PATH = DIR[,DIR...], one host each), read
                as `auto` reads a running job's nodes; combines with nothing

Combine at most one host source (slurm, hostfile) with at most one node source (nvidia-smi,
nccl-xml) and sysfs-ib; ``file`` combines only with sysfs-ib. A node source alone describes one host
(``node0``), or ``nodes`` hosts (a count or a hostlist) all alike, under one leaf.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from .capture import load_captures
from .file_source import load_topology_file
from .hostfile import load_hostfile
from .hostlist import expand_hostlist
from .layout import HostSpec, NodeLayout, build_topology
from .model import Tier, Topology, TopologyError
from .nccl_xml import load_nccl_xml
from .nvidia_smi import load_nvidia_smi
from .slurm import load_slurm_hosts
from .sysfs_ib import ib_net_gbps, read_ib_ports

__all__ = ["KINDS", "HOST_KINDS", "NODE_KINDS", "parse_spec", "load_source", "load_sources", "replicate_hosts"]

KINDS: tuple[str, ...] = ("file", "nvidia-smi", "nccl-xml", "slurm", "hostfile", "sysfs-ib", "capture")
HOST_KINDS = ("slurm", "hostfile")
NODE_KINDS = ("nvidia-smi", "nccl-xml")
_OPTS = {"nodes", "gpus_per_node", "name"}


def parse_spec(spec: Any) -> tuple[str, str]:
    """``"KIND:PATH"`` -> ``(kind, path)``; a bad spec is a `TopologyError` listing the KINDs."""
    if not isinstance(spec, str) or ":" not in spec:
        raise TopologyError(f"source {spec!r}: expected KIND:PATH with KIND one of {', '.join(KINDS)}")
    kind, _, path = spec.partition(":")
    if kind not in KINDS:
        raise TopologyError(f"source {spec!r}: unknown KIND {kind!r}; accepted: {', '.join(KINDS)}")
    if not path.strip():
        raise TopologyError(f"source {spec!r}: empty PATH after {kind}:")
    return kind, path


def replicate_hosts(nodes: int | str | None) -> list[str]:
    """Host names for a node source used alone: ``node0..node{N-1}`` for a count, or a hostlist."""
    if nodes is None:
        return ["node0"]
    if isinstance(nodes, bool):
        raise TopologyError(f"nodes = {nodes!r}; expected a count >= 1 or a hostlist such as dgx[001-004]")
    if isinstance(nodes, int) or (isinstance(nodes, str) and nodes.strip().isdigit()):
        n = int(nodes)
        if not 1 <= n <= 1_000_000:
            raise TopologyError(f"nodes = {nodes!r}; expected a count in [1, 1000000] or a hostlist")
        return [f"node{i}" for i in range(n)]
    if isinstance(nodes, str):
        return expand_hostlist(nodes)
    raise TopologyError(f"nodes = {nodes!r}; expected a count >= 1 or a hostlist such as dgx[001-004]")


def load_source(kind: str, path: str, **opts: Any) -> Topology:
    """Load one source. ``opts``: ``nodes`` (replicate a node source), ``gpus_per_node``, ``name``."""
    return _combine([(kind, path)], **opts)


def load_sources(specs: Iterable[str], **opts: Any) -> Topology:
    """Load and combine ``KIND:PATH`` sources (see the module docstring for what combines)."""
    if isinstance(specs, str):
        specs = [specs]
    parts = [parse_spec(s) for s in specs]
    if not parts:
        raise TopologyError(f"no topology source given; expected one or more KIND:PATH with KIND in {', '.join(KINDS)}")
    return _combine(parts, **opts)


def _combine(parts: list[tuple[str, str]], **opts: Any) -> Topology:
    unknown = sorted(set(opts) - _OPTS)
    if unknown:
        raise TopologyError(f"unknown source option {unknown[0]!r}; accepted: {sorted(_OPTS)}")
    for kind, _ in parts:
        if kind not in KINDS:
            raise TopologyError(f"source kind {kind!r}; accepted: {', '.join(KINDS)}")
    by_kind: dict[str, str] = {}
    for kind, path in parts:
        if kind in by_kind:
            raise TopologyError(f"source {kind}: given twice; give each KIND once")
        by_kind[kind] = path
    label = " + ".join(f"{k}:{p}" for k, p in parts)
    hosts_k = [k for k in by_kind if k in HOST_KINDS]
    node_k = [k for k in by_kind if k in NODE_KINDS]
    if len(hosts_k) > 1 or len(node_k) > 1:
        raise TopologyError(
            f"{label}: combine at most one host source (slurm, hostfile) with at most one node source "
            "(nvidia-smi, nccl-xml)"
        )
    gpn = opts.get("gpus_per_node")
    if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or not 1 <= gpn <= 4096):
        raise TopologyError(f"gpus_per_node = {gpn!r}; expected an integer in [1, 4096]")
    nodes = opts.get("nodes")
    name = opts.get("name")

    if "capture" in by_kind:
        if len(by_kind) > 1:
            raise TopologyError(f"{label}: capture: describes whole nodes; give it alone")
        if nodes is not None:
            raise TopologyError(f"{label}: nodes= replicates a node source; capture: lists its nodes itself")
        dirs = [d for d in by_kind["capture"].split(",") if d]
        return load_captures(dirs, gpus_per_node=gpn, name=name)
    if "file" in by_kind:
        if hosts_k or node_k:
            raise TopologyError(f"{label}: file: is a complete topology; combine it only with sysfs-ib")
        topo = load_topology_file(by_kind["file"])
        if "sysfs-ib" in by_kind:
            topo = _apply_ib(topo, by_kind["sysfs-ib"], _gpus_of_first_host(topo))
        return _renamed(topo, name, label)

    if not hosts_k and not node_k:
        raise TopologyError(f"{label}: sysfs-ib gives only link rates; add a source of hosts or nodes "
                            "(file, slurm, hostfile, nvidia-smi, nccl-xml)")
    node: NodeLayout | None = None
    if node_k:
        path = by_kind[node_k[0]]
        node = load_nvidia_smi(path) if node_k[0] == "nvidia-smi" else load_nccl_xml(path)
        if gpn is not None and gpn != node.gpus:
            raise TopologyError(f"gpus_per_node = {gpn} but {node.source} describes {node.gpus} GPUs")
    if hosts_k:
        if nodes is not None:
            raise TopologyError(
                f"{label}: nodes= replicates a node source used alone; the hosts come from {hosts_k[0]}"
            )
        kind = hosts_k[0]
        if kind == "slurm":
            hosts = load_slurm_hosts(by_kind[kind], gpus=None if node else (gpn or 8))
        else:
            # With a node source, a line without slots= takes the node's GPU count.
            hosts = load_hostfile(by_kind[kind], default_slots=None if node else (gpn or 1))
    else:
        hosts = [HostSpec(h) for h in replicate_hosts(nodes)]
    topo = build_topology(hosts, node=node, default_gpus=gpn or 8, name=name or label, source=label)
    if "sysfs-ib" in by_kind:
        topo = _apply_ib(topo, by_kind["sysfs-ib"], _gpus_of_first_host(topo))
    return topo


def _gpus_of_first_host(topo: Topology) -> int:
    first = topo.ranks[0].host
    return sum(1 for p in topo.ranks if p.host == first)


def _apply_ib(topo: Topology, root: str, gpus: int) -> Topology:
    ports = read_ib_ports(root)
    gbps = ib_net_gbps(ports, gpus)
    if gbps is None:
        raise TopologyError(
            f"sysfs-ib:{root}: no InfiniBand port is ACTIVE and LinkUp ({len(ports)} ports found); "
            "expected /sys/class/infiniband/<dev>/ports/<p>/{state,phys_state,rate,link_layer}"
        )
    new = {t: Tier(t, gbps, topo.tiers[t].latency_us, topo.tiers[t].oversubscription, origin="nic-rate",
                   detail=f"IB ports under {root}") for t in ("leaf", "spine")}
    return topo.with_tiers(**new)


def _renamed(topo: Topology, name: str | None, label: str) -> Topology:
    return replace(topo, name=name or topo.name, source=label)
