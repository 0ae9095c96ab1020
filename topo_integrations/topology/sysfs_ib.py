"""InfiniBand port state and rate from sysfs (``/sys/class/infiniband/<dev>/ports/<p>/...``).

File formats (kernel ``drivers/infiniband/core/sysfs.c``): ``state`` = ``4: ACTIVE``, ``phys_state`` =
``5: LinkUp``, ``rate`` = ``200 Gb/sec (4X HDR)``, ``link_layer`` = ``InfiniBand`` or ``Ethernet``.
Works without infiniband-diags and inside containers. The root is a parameter so tests (and
``topo-align doctor --sysfs-root``) can point at a copy.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

from .layout import net_tier_from_rate
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


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise TopologyError(f"sysfs-ib:{path}: cannot read ({exc.strerror or exc})") from None


def _state(path: str) -> str:
    text = _read(path)
    m = _STATE.match(text)
    if not m:
        raise TopologyError(f"sysfs-ib:{path}: {text[:40]!r}; expected '<n>: <STATE>' such as '4: ACTIVE'")
    return m.group(2)


def read_ib_ports(root: str = DEFAULT_SYSFS_ROOT) -> list[IBPort]:
    """Every port under ``root``; an absent root means no IB devices (empty list)."""
    if not os.path.isdir(root):
        return []
    ports: list[IBPort] = []
    for dev in sorted(os.listdir(root)):
        pdir = os.path.join(root, dev, "ports")
        if not os.path.isdir(pdir):
            continue
        for port in sorted(os.listdir(pdir), key=lambda p: (len(p), p)):
            base = os.path.join(pdir, port)
            if not os.path.isdir(base):
                continue
            rate_text = _read(os.path.join(base, "rate"))
            m = _RATE.match(rate_text)
            if not m:
                raise TopologyError(
                    f"sysfs-ib:{os.path.join(base, 'rate')}: {rate_text[:40]!r}; expected '<n> Gb/sec (...)'"
                )
            ll_path = os.path.join(base, "link_layer")
            link_layer = _read(ll_path) if os.path.exists(ll_path) else "InfiniBand"
            ports.append(IBPort(dev, port, _state(os.path.join(base, "state")),
                                _state(os.path.join(base, "phys_state")), float(m.group(1)), link_layer))
            if len(ports) > MAX_PORTS:
                raise TopologyError(f"sysfs-ib:{root}: more than {MAX_PORTS} ports")
    return ports


def ib_net_gbps(ports: list[IBPort], gpus: int = 8) -> float | None:
    """Per-GPU network bandwidth (GB/s) from the healthy InfiniBand ports: the most common rate,
    assuming one compute rail per GPU (rail-optimised DGX); None when no port is healthy."""
    rates = [p.rate_gbit for p in ports if p.healthy and p.link_layer.lower() == "infiniband"]
    if not rates:
        return None
    rate, count = Counter(rates).most_common(1)[0]
    return net_tier_from_rate(rate, min(count, gpus), gpus)
