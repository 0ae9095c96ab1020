"""Per-node facts: what one rank reports about the node it runs on (read through the `Machine` seam).

    host, local rank        $TOPO_ALIGN_HOSTNAME / the host name; LOCAL_RANK
    device model, count     NVML, else nvidia-smi, else rocm-smi (`node_gpus`), else none
    NVLink islands          the same source; "no fast tier" when there is none
    NICs and rates          /sys/class/infiniband/*/ports/*/{rate,state,phys_state,link_layer}
                            (InfiniBand, or RoCE when the link layer is Ethernet); when no RDMA port
                            is up, the physical Ethernet ports /sys/class/net/*/{speed,operstate}
    Slurm leaf and pod      $SLURM_TOPOLOGY_ADDR (+ _PATTERN), else topology.conf, under Slurm only

A fact that is not there is listed in ``missing`` (the topology then uses a default and warns once,
naming it); a fact that is there but malformed is a `TopologyError` naming the path or command.
Facts travel between ranks as plain JSON (`to_json` / `NodeFacts.from_json`, which validates).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .layout import read_source_text
from .machine import Machine
from .model import TopologyError
from .node_gpus import read_gpus
from .slurm import parse_topology_conf
from .sysfs_ib import read_ib_ports

__all__ = ["NicFacts", "NodeFacts", "collect_node_facts", "read_nics", "read_slurm", "NIC_KINDS"]

NIC_KINDS = ("infiniband", "roce", "ethernet")
IB_ROOT = "/sys/class/infiniband"
NET_ROOT = "/sys/class/net"


@dataclass(frozen=True)
class NicFacts:
    name: str
    """``mlx5_0:1`` (device:port) or an interface name such as ``eth0``."""
    kind: str
    """One of NIC_KINDS."""
    rate_gbit: float
    up: bool
    """ACTIVE and LinkUp (RDMA), or operstate up (Ethernet)."""


@dataclass(frozen=True)
class NodeFacts:
    host: str
    local_rank: int | None
    device: str
    device_count: int
    islands: tuple[tuple[int, ...], ...]
    """Partition of the device indices 0..device_count-1 into NVLink (XGMI) islands."""
    island_links: int
    """NVLinks per GPU inside its island (0: none or not known)."""
    islands_from: str
    """``nvml``, ``nvidia-smi``, ``rocm-smi`` or ``none``."""
    nics: tuple[NicFacts, ...] = ()
    leaf: str | None = None
    pod: str | None = None
    missing: tuple[str, ...] = field(default=())
    """Facts this node could not give (the topology uses a default for each and warns once)."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, *, who: str = "facts") -> NodeFacts:
        """Validate gathered or captured facts; a `TopologyError` names ``who`` and the bad field."""
        if not isinstance(d, dict):
            raise TopologyError(f"{who}: expected an object of node facts, got {type(d).__name__}")
        want = {f for f in cls.__dataclass_fields__}
        if set(d) != want:
            extra, lack = sorted(set(d) - want), sorted(want - set(d))
            raise TopologyError(f"{who}: node facts have unknown {extra} / missing {lack} fields")

        def bad(what: str, v: Any, expected: str) -> TopologyError:
            return TopologyError(f"{who}: {what} = {v!r}; expected {expected}")

        if not isinstance(d["host"], str) or not d["host"]:
            raise bad("host", d["host"], "a host name")
        lr = d["local_rank"]
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int) or lr < 0):
            raise bad("local_rank", lr, "an integer >= 0 or null")
        n = d["device_count"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 4096:
            raise bad("device_count", n, "an integer in [0, 4096]")
        try:
            islands = tuple(tuple(int(g) for g in isl) for isl in d["islands"])
        except (TypeError, ValueError):
            raise bad("islands", d["islands"], "a list of lists of device indices") from None
        if sorted(g for isl in islands for g in isl) != list(range(n)):
            raise bad("islands", d["islands"], f"a partition of the devices 0..{n - 1}")
        links = d["island_links"]
        if isinstance(links, bool) or not isinstance(links, int) or not 0 <= links <= 1024:
            raise bad("island_links", links, "an integer in [0, 1024]")
        nics = []
        for i, nic in enumerate(d["nics"] or ()):
            if not isinstance(nic, dict) or set(nic) != {"name", "kind", "rate_gbit", "up"}:
                raise bad(f"nics[{i}]", nic, "an object with name, kind, rate_gbit, up")
            rate = nic["rate_gbit"]
            if nic["kind"] not in NIC_KINDS or isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                    or not 0 <= rate <= 1e6:
                raise bad(f"nics[{i}]", nic, f"kind in {NIC_KINDS} and a rate in [0, 1e6] Gb/s")
            nics.append(NicFacts(str(nic["name"]), nic["kind"], float(rate), bool(nic["up"])))
        return cls(d["host"], lr, str(d["device"]), n, islands, links, str(d["islands_from"]), tuple(nics),
                   d["leaf"], d["pod"], tuple(str(m) for m in d["missing"] or ()))

    def fast_nics(self) -> tuple[NicFacts, ...]:
        """The NICs that carry inter-node traffic: the RDMA ports that are up, else the Ethernet ones."""
        rdma = tuple(n for n in self.nics if n.up and n.kind != "ethernet" and n.rate_gbit > 0)
        return rdma or tuple(n for n in self.nics if n.up and n.kind == "ethernet" and n.rate_gbit > 0)


def read_nics(machine: Machine) -> tuple[tuple[NicFacts, ...], list[str]]:
    """IB/RoCE ports and physical Ethernet interfaces, and the facts that were missing."""
    missing: list[str] = []
    nics = [NicFacts(f"{p.device}:{p.port}", "infiniband" if p.link_layer.lower() == "infiniband" else "roce",
                     p.rate_gbit, p.healthy) for p in read_ib_ports(IB_ROOT, machine)]
    for name in machine.listdir(NET_ROOT):
        base = f"{NET_ROOT}/{name}"
        if not machine.exists(f"{base}/device"):  # lo, bridges, veths, bonds' slaves: not a NIC
            continue
        state = machine.read(f"{base}/operstate", missing_ok=True) or "unknown"
        up = state == "up"
        speed = None
        if up:
            text = machine.read(f"{base}/speed", missing_ok=True)
            try:
                speed = int(text) if text is not None else None
            except ValueError:
                raise TopologyError(f"{machine.path(base + '/speed')}: {text[:40]!r}; expected the link speed "
                                    "in Mb/s (an integer)") from None
            if speed is None or speed <= 0:
                missing.append(f"the speed of {name} (sysfs says {text!r})")
                speed = None
        nics.append(NicFacts(name, "ethernet", (speed or 0) / 1000.0, up and speed is not None))
    if not any(n.up and n.rate_gbit > 0 for n in nics):
        missing.append(f"NIC rates (no InfiniBand/RoCE port ACTIVE and LinkUp under {IB_ROOT}, "
                       f"no Ethernet port up with a speed under {NET_ROOT})")
    return tuple(nics), missing


def read_slurm(machine: Machine, host: str) -> tuple[str | None, str | None, list[str]]:
    """(leaf, pod, missing) of ``host`` when the job runs under Slurm; (None, None, []) otherwise."""
    if machine.env("SLURM_JOB_ID") is None:
        return None, None, []
    addr, pattern = machine.env("SLURM_TOPOLOGY_ADDR"), machine.env("SLURM_TOPOLOGY_ADDR_PATTERN")
    if addr and pattern:
        parts, kinds = addr.split("."), pattern.split(".")
        if len(parts) != len(kinds) or kinds[-1] != "node":
            raise TopologyError(f"SLURM_TOPOLOGY_ADDR={addr!r} does not match SLURM_TOPOLOGY_ADDR_PATTERN={pattern!r}")
        switches = parts[:-1]
        if switches:
            return switches[-1], switches[-2] if len(switches) > 1 else "pod0", []
    conf_dir = os.path.dirname(machine.env("SLURM_CONF") or "/etc/slurm/slurm.conf")
    conf = f"{conf_dir}/topology.conf"
    if not machine.exists(conf):
        return None, None, [f"Slurm switch layout ({machine.path(conf)} not readable, no SLURM_TOPOLOGY_ADDR)"]
    where = f"slurm:{machine.path(conf)}"
    tree = parse_topology_conf(read_source_text(machine.path(conf), where=where), source=where)
    leaf = tree.leaf_of.get(host)
    if leaf is None:
        raise TopologyError(f"{where}: host {host!r} is under no switch; the job's node must be in topology.conf")
    return leaf, tree.pod_of_leaf[leaf], []


def collect_node_facts(machine: Machine | None = None, *, local_rank: int | None = None) -> NodeFacts:
    """This node's facts (live, or the captured node ``$TOPO_ALIGN_SYSROOT`` names)."""
    machine = machine or Machine.from_env()
    host = machine.hostname()
    gpus = read_gpus(machine)
    nics, nic_missing = read_nics(machine)
    leaf, pod, slurm_missing = read_slurm(machine, host)
    return NodeFacts(host, local_rank, gpus.device, gpus.count, gpus.islands, gpus.links, gpus.origin, nics,
                     leaf, pod, (*gpus.missing, *nic_missing, *slurm_missing))
