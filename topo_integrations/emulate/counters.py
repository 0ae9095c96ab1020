"""Byte accounting from the emulated interfaces themselves.

Counters are the kernel's per-interface statistics, ``/sys/class/net/<if>/statistics/{tx,rx}_{bytes,packets}``,
read inside each namespace (``ip netns exec`` remounts /sys for the namespace). They count wire bytes:
payload plus Ethernet/IP/TCP headers and the receivers' ACKs (about 1% at MTU 9000, 5-7% at 1500).

Per link:

- ``uplink``: node ``eth0``; ``tx`` = bytes the node sent to other nodes, ``rx`` = bytes it received.
  Every cross-node byte leaves exactly one node, so ``cross_node_bytes`` = sum of uplink ``tx``.
- ``spine``: leaf-side end ``u<j>`` in the switch namespace; ``tx`` = bytes leaving the leaf through the
  spine. ``cross_leaf_bytes`` = sum of spine ``tx``.
- ``loopback``: node ``lo``; intra-node traffic (ranks of one node talk over it, including traffic to
  the node's own 10.213 address). ``intra_node_bytes`` = sum of loopback ``tx``.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass

from .layout import NODE_IFACE, Layout
from .netns import EmulationError

__all__ = ["LinkCounters", "CounterSnapshot", "read_interfaces", "snapshot"]

_FIELDS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
# One subprocess per namespace: print "<if> tx_bytes rx_bytes tx_packets rx_packets" per interface.
_READ = ('cd /sys/class/net && for i in *; do s=$i/statistics; '
         'echo "$i $(cat $s/tx_bytes) $(cat $s/rx_bytes) $(cat $s/tx_packets) $(cat $s/rx_packets)"; done')


@dataclass(frozen=True)
class LinkCounters:
    link: str
    kind: str
    """``uplink`` | ``spine`` | ``loopback``."""
    tier: str
    ns: str
    iface: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def minus(self, before: LinkCounters) -> LinkCounters:
        return LinkCounters(self.link, self.kind, self.tier, self.ns, self.iface,
                            *(getattr(self, f) - getattr(before, f) for f in _FIELDS))


def read_interfaces(ns: str) -> dict[str, tuple[int, int, int, int]]:
    """``iface -> (tx_bytes, rx_bytes, tx_packets, rx_packets)`` for every interface in ``ns``."""
    proc = subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", _READ], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise EmulationError(f"cannot read interface counters in {ns}: {proc.stderr.strip()}")
    out = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and all(p.isdigit() for p in parts[1:]):
            out[parts[0]] = tuple(int(p) for p in parts[1:])
    return out


@dataclass(frozen=True)
class CounterSnapshot:
    links: tuple[LinkCounters, ...]

    def minus(self, before: CounterSnapshot) -> CounterSnapshot:
        prev = {c.link: c for c in before.links}
        return CounterSnapshot(tuple(c.minus(prev[c.link]) for c in self.links))

    def _sum(self, kind: str) -> int:
        return sum(c.tx_bytes for c in self.links if c.kind == kind)

    @property
    def cross_node_bytes(self) -> int:
        return self._sum("uplink")

    @property
    def cross_leaf_bytes(self) -> int:
        return self._sum("spine")

    @property
    def intra_node_bytes(self) -> int:
        return self._sum("loopback")

    def link(self, name: str) -> LinkCounters:
        for c in self.links:
            if c.link == name:
                return c
        raise KeyError(f"no link {name!r}; links: {[c.link for c in self.links]}")

    def to_json(self) -> dict:
        return {
            "links": [asdict(c) for c in self.links],
            "totals": {
                "cross_node_bytes": self.cross_node_bytes,
                "cross_leaf_bytes": self.cross_leaf_bytes,
                "intra_node_bytes": self.intra_node_bytes,
                "cross_node_packets": sum(c.tx_packets for c in self.links if c.kind == "uplink"),
            },
        }


def snapshot(layout: Layout) -> CounterSnapshot:
    """Read every link's counters now (one `ip netns exec` per namespace)."""
    links: list[LinkCounters] = []
    for node in layout.nodes:
        ifs = read_interfaces(node.ns)
        for iface, kind, tier, name in (
            (NODE_IFACE, "uplink", "leaf", node.host),
            ("lo", "loopback", "island", f"{node.host}:lo"),
        ):
            if iface not in ifs:
                raise EmulationError(f"interface {iface} is missing in {node.ns} ({node.host})")
            links.append(LinkCounters(name, kind, tier, node.ns, iface, *ifs[iface]))
    if layout.spines:
        ifs = read_interfaces(layout.switch_ns)
        for sp in layout.spines:
            links.append(
                LinkCounters(f"{sp.leaf}:spine", "spine", "spine", layout.switch_ns, sp.leaf_port, *ifs[sp.leaf_port])
            )
    return CounterSnapshot(tuple(links))
