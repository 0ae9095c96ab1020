"""Link shaping with `tc`: an HTB rate limit per link direction, plus a netem delay where the kernel has it.

Each emulated link is a veth pair; each end shapes its own egress, so both directions are limited:

    dev root: htb (handle 1:, default class 1:1)
      class 1:1  rate R ceil R          -- the link speed
        qdisc 10: netem delay D         -- the link's one-way share of the tier latency (if available)

HTB is a token bucket with exact byte accounting (GSO super-packets are charged their full length),
so a 200 Mbit/s class sends 25 MB/s of wire bytes including headers. Units: ``rate_mbit`` is
megabits per second (10^6 bit/s, tc's ``mbit``); topology tiers are GB/s (10^9 bytes/s), so
1 GB/s = 8000 Mbit/s.

netem (CONFIG_NET_SCH_NETEM) is missing from some kernels (the CI and development VMs among them):
then links are rate-shaped only, :func:`netem_available` says so and an explicit delay request
raises :class:`DelayUnsupported`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .netns import EmulationError, run_ip

__all__ = ["LinkShape", "DelayUnsupported", "gbps_to_mbit", "apply_shape", "change_shape", "netem_available"]

_NETEM_OK: bool | None = None


class DelayUnsupported(EmulationError):
    """The kernel has no netem qdisc, so a link delay cannot be emulated."""


@dataclass(frozen=True)
class LinkShape:
    rate_mbit: float
    """Megabits per second (10^6 bit/s) in each direction."""
    delay_ms: float = 0.0
    """One-way delay added by this link end (applied to its egress)."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.rate_mbit, (int, float)) and math.isfinite(self.rate_mbit) and 0.01 <= self.rate_mbit <= 1e7
        ):
            raise ValueError(f"rate_mbit = {self.rate_mbit!r}; expected a number in [0.01, 1e7] (Mbit/s)")
        if not (
            isinstance(self.delay_ms, (int, float)) and math.isfinite(self.delay_ms) and 0 <= self.delay_ms <= 60_000
        ):
            raise ValueError(f"delay_ms = {self.delay_ms!r}; expected a number in [0, 60000] (ms)")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


def gbps_to_mbit(gbps: float) -> float:
    """GB/s (10^9 bytes/s, the topology's unit) -> Mbit/s (10^6 bit/s, tc's unit)."""
    return gbps * 8000.0


def netem_available() -> bool | None:
    """True/False once a link has been shaped in this process; None before (unknown)."""
    return _NETEM_OK


def _rate(shape: LinkShape) -> str:
    # kbit keeps three significant decimals of Mbit/s without float formatting surprises.
    return f"{max(1, round(shape.rate_mbit * 1000))}kbit"


def _burst(shape: LinkShape, mtu: int) -> str:
    # 1 ms of tokens, at least one 64 KiB GSO packet plus headroom: HTB needs a whole packet's worth
    # to send it; larger bursts let short transfers run above the rate (4 ms of tokens let a 500 kB
    # transfer run at 1.8x a 400 Mbit/s rate; 1 ms: 1.3x, 2 MB within 5%).
    return f"{max(int(shape.bytes_per_s * 0.001), 65536 + 2 * mtu)}b"


def _htb_args(shape: LinkShape, mtu: int) -> list[str]:
    b = _burst(shape, mtu)
    return ["htb", "rate", _rate(shape), "ceil", _rate(shape), "burst", b, "cburst", b, "quantum", "200000"]


def _set_delay(ns: str, dev: str, delay_ms: float, *, explicit: bool) -> bool:
    """Put (or replace) the netem child. Returns whether a delay is in place."""
    global _NETEM_OK
    if _NETEM_OK is False:
        if delay_ms > 0 and explicit:
            raise DelayUnsupported(
                f"cannot set delay_ms={delay_ms:g} on {dev} in {ns}: this kernel has no netem qdisc "
                "(CONFIG_NET_SCH_NETEM); rate shaping still works"
            )
        return False
    if delay_ms <= 0 and _NETEM_OK is None:
        return False  # nothing to add; probe netem when a delay is first needed
    proc = run_ip(["qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                   "delay", f"{delay_ms * 1000:.0f}us", "limit", "100000"], ns=ns, tool="tc", check=False)
    if proc.returncode == 0:
        _NETEM_OK = True
        return True
    if "unknown" in (proc.stderr or "").lower():
        _NETEM_OK = False
        return _set_delay(ns, dev, delay_ms, explicit=explicit)
    raise EmulationError(f"tc netem on {dev} in {ns} failed: {proc.stderr.strip()}")


def apply_shape(ns: str, dev: str, shape: LinkShape, *, mtu: int) -> bool:
    """Shape ``dev``'s egress in namespace ``ns``. Returns whether the delay was applied."""
    run_ip(["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"], ns=ns, tool="tc")
    run_ip(["class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", *_htb_args(shape, mtu)], ns=ns, tool="tc")
    return _set_delay(ns, dev, shape.delay_ms, explicit=False)


def change_shape(ns: str, dev: str, shape: LinkShape, *, mtu: int, delay_explicit: bool) -> bool:
    """Change a shaped link's rate and delay in place (no packets dropped, connections survive).
    The delay goes first, so a kernel without netem refuses before anything has changed."""
    if shape.delay_ms > 0 or _NETEM_OK:
        # With netem present, a zero delay keeps the netem child at 0 us: swapping it for the
        # default qdisc would drop the packets queued in it.
        applied = _set_delay(ns, dev, shape.delay_ms, explicit=delay_explicit)
    else:
        applied = False
    run_ip(["class", "change", "dev", dev, "parent", "1:", "classid", "1:1", *_htb_args(shape, mtu)], ns=ns, tool="tc")
    return applied and shape.delay_ms > 0
