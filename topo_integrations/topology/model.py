"""The `Topology` model: where each global rank sits, and the tiers that connect them.

A rank has a host, an island (NVLink domain: a node, a bridged GPU pair, or an NVL72 rack), a leaf
(leaf switch, or a rail-optimised scalable unit) and a pod (spine). Tiers are named by the level
two ranks first share:

    island  -- both ranks in one NVLink island       (fastest)
    host    -- same host, different islands (PCIe/SMP; only for bridged-pair nodes)
    leaf    -- different hosts under one leaf switch
    spine   -- different leaves (through the spine, possibly oversubscribed)

Bandwidths are GB/s per GPU (bus bandwidth a ring on that tier achieves), latencies in us. Every
tier says where its number came from (`Tier.origin`, one of ORIGINS): ``measured`` (the probe),
``nic-rate`` (NIC line rates), ``nvlink`` (NVLink counts), ``file`` (a topology file) or ``default``
(nothing was found: DEFAULT_TIERS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

__all__ = ["TopologyError", "TopologyTimeout", "RankPlace", "Tier", "Topology", "TIER_NAMES", "DEFAULT_TIERS",
           "ORIGINS"]

TIER_NAMES: tuple[str, ...] = ("island", "host", "leaf", "spine")


ORIGINS: tuple[str, ...] = ("measured", "nic-rate", "nvlink", "file", "default")


class TopologyError(ValueError):
    """A topology source or model that cannot be used; the message says what, where and why."""


class TopologyTimeout(TopologyError, TimeoutError):
    """Discovery did not complete in time (a rank did not answer); the message names the ranks."""


@dataclass(frozen=True, slots=True)
class Tier:
    """One level of the network."""

    name: str
    bandwidth_gbps: float
    """Achievable bus bandwidth per GPU on this tier, GB/s."""
    latency_us: float
    """Per-message latency (alpha) on this tier, microseconds."""
    oversubscription: float = 1.0
    """Uplink oversubscription into this tier (2.0 means 2:1); effective bandwidth is divided by it."""
    origin: str = field(default="default", compare=False)
    """Where `bandwidth_gbps` came from: one of ORIGINS."""
    detail: str = field(default="", compare=False)
    """What decided the number, for the table and the log (e.g. ``slowest host b: 1 x 100 Gb/s``)."""

    @property
    def effective_gbps(self) -> float:
        return self.bandwidth_gbps / self.oversubscription

    def to_json(self) -> dict:
        return {
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency_us": self.latency_us,
            "oversubscription": self.oversubscription,
        }


# Effective figures for a DGX A100 SuperPOD (docs/topology-format.md, "Where the estimates come
# from"): NVLink ~230 GB/s per GPU, HDR ~24 GB/s per GPU, PCIe/SMP between bridged pairs ~20 GB/s.
DEFAULT_TIERS: dict[str, Tier] = {
    "island": Tier("island", 230.0, 2.0),
    "host": Tier("host", 20.0, 5.0),
    "leaf": Tier("leaf", 24.0, 7.0),
    "spine": Tier("spine", 24.0, 10.0),
}


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one global rank sits."""

    rank: int
    host: str
    local_rank: int
    island: str
    leaf: str
    pod: str = "pod0"


@dataclass(frozen=True)
class Topology:
    """Ranks (index = global rank) and the tiers between them."""

    ranks: tuple[RankPlace, ...]
    tiers: dict[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    name: str = "topology"
    source: str = "memory"
    """Where this topology came from (e.g. ``slurm:topology.conf``), for messages."""
    gpu: str | None = None
    """The GPU kind, e.g. ``"A100"`` (topology files' optional ``"gpu"`` key); the cost model takes
    its default peak FLOP/s from it (docs/costmodel.md). None when the source does not say."""
    nodes: tuple[Any, ...] = field(default=(), compare=False)
    """Per-host facts (`topology.facts.NodeFacts`, one per host in rank order) when the topology was
    discovered or replayed; empty for the other sources."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Facts that were missing and the default used instead (one line each, logged once)."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise TopologyError(f"{self.name}: topology has no ranks")
        for i, place in enumerate(self.ranks):
            if place.rank != i:
                raise TopologyError(
                    f"{self.name}: ranks must be numbered 0..{len(self.ranks) - 1} in order; "
                    f"position {i} holds rank {place.rank}"
                )
        missing = [t for t in TIER_NAMES if t not in self.tiers]
        if missing:
            raise TopologyError(f"{self.name}: tiers {missing} are missing; need {list(TIER_NAMES)}")
        for t in self.tiers.values():
            for what, v in (("bandwidth_gbps", t.bandwidth_gbps), ("latency_us", t.latency_us)):
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise TopologyError(f"{self.name}: tier {t.name}.{what} = {v!r}; expected a finite number >= 0")
            if not (t.bandwidth_gbps > 0):
                raise TopologyError(f"{self.name}: tier {t.name}.bandwidth_gbps = {t.bandwidth_gbps!r}; expected > 0")
            if not (math.isfinite(t.oversubscription) and t.oversubscription >= 1.0):
                raise TopologyError(
                    f"{self.name}: tier {t.name}.oversubscription = {t.oversubscription!r}; expected a number >= 1"
                )
        # A host may not belong to two leaves, and an island never spans two leaves.
        host_leaf: dict[str, str] = {}
        island_leaf: dict[str, str] = {}
        seen: set[tuple[str, int]] = set()
        for p in self.ranks:
            if host_leaf.setdefault(p.host, p.leaf) != p.leaf:
                raise TopologyError(
                    f"{self.name}: host {p.host!r} is under two leaves ({host_leaf[p.host]!r}, {p.leaf!r})"
                )
            if island_leaf.setdefault(p.island, p.leaf) != p.leaf:
                raise TopologyError(
                    f"{self.name}: island {p.island!r} spans leaves {island_leaf[p.island]!r} and {p.leaf!r}"
                )
            key = (p.host, p.local_rank)
            if key in seen:
                raise TopologyError(f"{self.name}: host {p.host!r} has local rank {p.local_rank} twice")
            seen.add(key)

    # -- views -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _grouped(self, key: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for p in self.ranks:
            out.setdefault(getattr(p, key), []).append(p.rank)
        return out

    @property
    def hosts(self) -> dict[str, list[int]]:
        """Host -> its ranks, in order of first appearance."""
        return self._grouped("host")

    @property
    def islands(self) -> dict[str, list[int]]:
        return self._grouped("island")

    @property
    def leaves(self) -> dict[str, list[int]]:
        return self._grouped("leaf")

    @property
    def pods(self) -> dict[str, list[int]]:
        return self._grouped("pod")

    def tier_between(self, a: int, b: int) -> str:
        """Name of the tier two ranks communicate over."""
        pa, pb = self.ranks[a], self.ranks[b]
        if pa.island == pb.island:
            return "island"
        if pa.host == pb.host:
            return "host"
        if pa.leaf == pb.leaf:
            return "leaf"
        return "spine"

    def bandwidth(self, a: int, b: int) -> float:
        """Effective GB/s between two ranks (inf for a rank with itself)."""
        if a == b:
            return math.inf
        return self.tiers[self.tier_between(a, b)].effective_gbps

    def bandwidth_matrix(self) -> list[list[float]]:
        """Rank x rank effective bandwidth in GB/s (O(n^2): for small topologies and plots)."""
        n = self.world_size
        return [[self.bandwidth(a, b) for b in range(n)] for a in range(n)]

    def tiers_present(self) -> list[str]:
        """The tiers some pair of ranks actually uses, fastest level first."""
        present = set()
        if any(len(r) > 1 for r in self.islands.values()):
            present.add("island")
        for ranks in self.hosts.values():
            isl = {self.ranks[r].island for r in ranks}
            if len(isl) > 1:
                present.add("host")
                break
        for ranks in self.leaves.values():
            if len({self.ranks[r].host for r in ranks}) > 1:
                present.add("leaf")
                break
        if len(self.leaves) > 1:
            present.add("spine")
        return [t for t in TIER_NAMES if t in present]

    def summary(self) -> dict:
        isl = self.islands
        return {
            "name": self.name,
            "source": self.source,
            "world_size": self.world_size,
            "hosts": len(self.hosts),
            "islands": len(isl),
            "island_sizes": sorted({len(v) for v in isl.values()}),
            "leaves": len(self.leaves),
            "pods": len(self.pods),
            "tiers_present": self.tiers_present(),
            "tiers": {k: v.to_json() for k, v in self.tiers.items()},
            "tier_origins": {k: {"origin": v.origin, "detail": v.detail} for k, v in self.tiers.items()},
            "warnings": list(self.warnings),
        }

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_hosts(
        cls,
        hosts: Iterable[tuple[str, int]],
        *,
        leaf_of: dict[str, str] | None = None,
        pod_of: dict[str, str] | None = None,
        island_size: int | None = None,
        tiers: dict[str, Tier] | None = None,
        name: str = "topology",
        source: str = "memory",
    ) -> Topology:
        """Build from ``(host, n_gpus)`` in rank order; islands are whole hosts unless ``island_size``
        splits each host into islands of that many consecutive local ranks (bridged pairs)."""
        places: list[RankPlace] = []
        seen_hosts: set[str] = set()
        for host, n in hosts:
            if host in seen_hosts:
                raise TopologyError(f"{name}: host {host!r} is listed twice")
            seen_hosts.add(host)
            if not isinstance(n, int) or n < 1:
                raise TopologyError(f"{name}: host {host!r} has {n!r} GPUs; expected an integer >= 1")
            leaf = (leaf_of or {}).get(host, "leaf0")
            pod = (pod_of or {}).get(host, "pod0")
            for lr in range(n):
                island = host if not island_size else f"{host}/i{lr // island_size}"
                places.append(RankPlace(len(places), host, lr, island, leaf, pod))
        merged = dict(DEFAULT_TIERS)
        merged.update(tiers or {})
        return cls(tuple(places), merged, name=name, source=source)

    def with_tiers(self, **tiers: Tier) -> Topology:
        merged = dict(self.tiers)
        merged.update(tiers)
        return replace(self, tiers=merged)
