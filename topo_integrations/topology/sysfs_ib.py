"""InfiniBand port state and rate from sysfs (``/sys/class/infiniband/<dev>/ports/<p>/...``).

File formats (kernel ``drivers/infiniband/core/sysfs.c``): ``state`` = ``4: ACTIVE``, ``phys_state`` =
``5: LinkUp``, ``rate`` = ``200 Gb/sec (4X HDR)``, ``link_layer`` = ``InfiniBand`` or ``Ethernet``.
Works without infiniband-diags and inside containers. Reads go through `machine.Machine` (the seam
of every machine read); the root is a parameter so tests (and ``topo-align doctor --sysfs-root``)
can point at a copy.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from .layout import net_tier_from_rate
from .machine import Machine
from .model import TopologyError

__all__ = ["IBPort", "read_ib_ports", "ib_net_gbps", "DEFAULT_SYSFS_ROOT"]

DEFAULT_SYSFS_ROOT = "/sys/class/infiniband"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")
MAX_PORTS = 4096


@dataclass(frozen=True)
class IBPort:
    device: str
    port: str
    state: str
    """e.g. ``ACTIVE``, ``DOWN``"""
    phys_state: str
    """e.g. ``LinkUp``, ``Polling``, ``Disabled``"""
    rate_gbit: float
    link_layer: str

    @property
    def healthy(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"

    def to_json(self) -> dict:
        return {"device": self.device, "port": self.port, "state": self.state, "phys_state": self.phys_state,
                "rate_gbit": self.rate_gbit, "link_layer": self.link_layer, "healthy": self.healthy}


def _read(machine: Machine, path: str) -> str:
    try:
        return machine.read(path) or ""
    except TopologyError as exc:
        raise TopologyError(f"sysfs-ib:{exc}") from None


def _state(machine: Machine, path: str) -> str:
    text = _read(machine, path)
    m = _STATE.match(text)
    if not m:
        raise TopologyError(
            f"sysfs-ib:{machine.path(path)}: {text[:40]!r}; expected '<n>: <STATE>' such as '4: ACTIVE'")
    return m.group(2)


def read_ib_ports(root: str = DEFAULT_SYSFS_ROOT, machine: Machine | None = None) -> list[IBPort]:
    """Every port under ``root`` (read through ``machine``, live by default); an absent root means
    no IB devices (empty list)."""
    machine = machine or Machine(None)
    ports: list[IBPort] = []
    for dev in machine.listdir(root):
        pdir = f"{root}/{dev}/ports"
        for port in sorted(machine.listdir(pdir), key=lambda p: (len(p), p)):
            base = f"{pdir}/{port}"
            if not machine.isdir(base):
                continue
            rate_text = _read(machine, f"{base}/rate")
            m = _RATE.match(rate_text)
            if not m:
                raise TopologyError(
                    f"sysfs-ib:{machine.path(base + '/rate')}: {rate_text[:40]!r}; expected '<n> Gb/sec (...)'"
                )
            ll_path = f"{base}/link_layer"
            link_layer = _read(machine, ll_path) if machine.exists(ll_path) else "InfiniBand"
            ports.append(IBPort(dev, port, _state(machine, f"{base}/state"),
                                _state(machine, f"{base}/phys_state"), float(m.group(1)), link_layer))
            if len(ports) > MAX_PORTS:
                raise TopologyError(f"sysfs-ib:{machine.path(root)}: more than {MAX_PORTS} ports")
    return ports


def ib_net_gbps(ports: list[IBPort], gpus: int = 8) -> float | None:
    """Per-GPU network bandwidth (GB/s) from the healthy InfiniBand ports: the most common rate,
    assuming one compute rail per GPU (rail-optimised DGX); None when no port is healthy."""
    rates = [p.rate_gbit for p in ports if p.healthy and p.link_layer.lower() == "infiniband"]
    if not rates:
        return None
    rate, count = Counter(rates).most_common(1)[0]
    return net_tier_from_rate(rate, min(count, gpus), gpus)
