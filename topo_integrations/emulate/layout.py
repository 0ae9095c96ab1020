"""From a `Topology` to the emulated network: namespaces, addresses, links and their shapes (pure).

Mapping (docs/emulation.md):

- one namespace per host (node); all ranks of a node share it and talk over its loopback (the
  island/host tiers are not shaped: loopback runs at memory speed, ~2.6 GB/s here);
- one switch namespace holding a bridge per leaf and, with more than one leaf, a spine bridge;
- node uplink (veth ``eth0`` in the node <-> ``n<i>`` on its leaf bridge), shaped in both directions to
  ``leaf.bandwidth_gbps x ranks on the node`` (tiers are GB/s *per GPU*; a node with g GPUs has g
  rails' worth of NIC bandwidth), with one-way delay ``leaf.latency_us / 2`` per end, so a node-to-node
  path under one leaf has the leaf tier's latency;
- leaf uplink to the spine (veth ``u<j>`` on the leaf bridge <-> ``d<j>`` on the spine bridge), shaped
  to ``spine.bandwidth_gbps x ranks under the leaf / spine.oversubscription``, with one-way delay
  ``max(0, spine.latency_us - leaf.latency_us) / 2`` per end, so a cross-leaf path has the spine
  tier's latency;
- addresses 10.213.<leaf index>.<host index in leaf + 1>/16, one L2 domain; nothing routes outside.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..topology.model import Topology
from .shaping import LinkShape, gbps_to_mbit

__all__ = ["NodeSpec", "SpineSpec", "Layout", "plan_layout", "NODE_IFACE", "MAX_HOSTS_PER_LEAF", "MAX_LEAVES"]

NODE_IFACE = "eth0"
SUBNET = "10.213.0.0/16"
MAX_HOSTS_PER_LEAF = 254
MAX_LEAVES = 256


@dataclass(frozen=True)
class NodeSpec:
    index: int
    host: str
    ns: str
    address: str
    leaf: str
    leaf_index: int
    ranks: tuple[int, ...]
    uplink: LinkShape
    switch_port: str
    """The uplink's far end, in the switch namespace, on the leaf's bridge."""


@dataclass(frozen=True)
class SpineSpec:
    leaf: str
    leaf_index: int
    shape: LinkShape
    leaf_port: str
    """Leaf-side end (on the leaf bridge): its egress is traffic leaving the leaf."""
    spine_port: str
    """Spine-side end (on the spine bridge): its egress is traffic entering the leaf."""


@dataclass(frozen=True)
class Layout:
    prefix: str
    switch_ns: str
    nodes: tuple[NodeSpec, ...]
    spines: tuple[SpineSpec, ...]
    leaf_bridges: dict[str, str]
    spine_bridge: str | None
    mtu: int

    @property
    def master(self) -> NodeSpec:
        """The node holding rank 0 (rendezvous)."""
        return next(n for n in self.nodes if 0 in n.ranks)

    def node(self, key: str | int) -> NodeSpec:
        for n in self.nodes:
            if key == n.host or key == n.index:
                return n
        raise KeyError(f"no emulated node {key!r}; nodes: {[n.host for n in self.nodes]}")

    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [n.ns for n in self.nodes]


def plan_layout(topo: Topology, prefix: str, *, mtu: int = 9000, uplink_mbit: float | None = None) -> Layout:
    """Namespaces, addresses and link shapes for ``topo``; ``prefix`` is ``ta<pid>-<seq>``.
    ``uplink_mbit`` overrides every node uplink's rate (Mbit/s) instead of the per-GPU mapping."""
    if not (576 <= mtu <= 65535):
        raise ValueError(f"mtu = {mtu!r}; expected an integer in [576, 65535]")
    leaf_t, spine_t = topo.tiers["leaf"], topo.tiers["spine"]
    leaves = list(topo.leaves)
    if len(leaves) > MAX_LEAVES:
        raise ValueError(f"{topo.name}: {len(leaves)} leaves; the emulator supports at most {MAX_LEAVES}")
    hosts = topo.hosts
    nodes: list[NodeSpec] = []
    per_leaf: dict[str, int] = {}
    for i, (host, ranks) in enumerate(hosts.items()):
        leaf = topo.ranks[ranks[0]].leaf
        li = leaves.index(leaf)
        j = per_leaf.get(leaf, 0)
        per_leaf[leaf] = j + 1
        if j >= MAX_HOSTS_PER_LEAF:
            raise ValueError(f"{topo.name}: leaf {leaf!r} has more than {MAX_HOSTS_PER_LEAF} hosts; "
                             "the emulator gives each leaf one /24 of 10.213.0.0/16")
        nodes.append(
            NodeSpec(
                index=i,
                host=host,
                ns=f"{prefix}-n{i}",
                address=f"10.213.{li}.{j + 1}",
                leaf=leaf,
                leaf_index=li,
                ranks=tuple(ranks),
                uplink=LinkShape(
                    uplink_mbit if uplink_mbit is not None else gbps_to_mbit(leaf_t.bandwidth_gbps) * len(ranks),
                    leaf_t.latency_us / 2000.0,
                ),
                switch_port=f"n{i}",
            )
        )
    spines: list[SpineSpec] = []
    if len(leaves) > 1:
        extra_ms = max(0.0, spine_t.latency_us - leaf_t.latency_us) / 2000.0
        for li, leaf in enumerate(leaves):
            n_ranks = len(topo.leaves[leaf])
            rate = gbps_to_mbit(spine_t.bandwidth_gbps) * n_ranks / spine_t.oversubscription
            spines.append(SpineSpec(leaf, li, LinkShape(rate, extra_ms), f"u{li}", f"d{li}"))
    return Layout(
        prefix=prefix,
        switch_ns=f"{prefix}-sw",
        nodes=tuple(nodes),
        spines=tuple(spines),
        leaf_bridges={leaf: f"l{li}" for li, leaf in enumerate(leaves)},
        spine_bridge="sp" if len(leaves) > 1 else None,
        mtu=mtu,
    )
