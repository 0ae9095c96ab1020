"""Building blocks shared by the topology sources: reading a source file safely, the layout of one
node (how many GPUs, which ones share an NVLink island), and assembling a `Topology` from hosts.

A *host source* (Slurm, hostfile, gathered hostnames) says which hosts exist, in rank order, and
under which leaf and pod each sits. A *node source* (``nvidia-smi topo -m``, NCCL XML) says what one
node looks like inside. `build_topology` combines the two: every host gets the node's GPUs and
islands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from .model import DEFAULT_TIERS, RankPlace, Tier, Topology, TopologyError

__all__ = [
    "MAX_SOURCE_BYTES", "HostSpec", "NodeLayout", "read_source_text", "build_topology",
    "island_tier_from_links", "net_tier_from_rate", "NVLINK_GBPS_PER_LINK", "NVLINK_EFFICIENCY",
    "NET_EFFICIENCY",
]

# A topology source is kilobytes (a 10k-node topology.conf is well under a megabyte); anything larger
# is a wrong path, and reading it whole would waste memory.
MAX_SOURCE_BYTES = 16 * 1024 * 1024

# Estimates used when a source gives link counts or line rates instead of measured bandwidth
# (docs/topology-format.md, "Where the estimates come from"): one NVLink (gen 2-4) carries 25 GB/s
# per direction, and an all-reduce ring reaches ~80 % of it (230 GB/s of 300 on A100, ~370 of 450
# on H100). IB reaches ~96 % of line rate (192 GB/s measured over 8 x 200 Gb/s HDR).
NVLINK_GBPS_PER_LINK = 25.0
NVLINK_EFFICIENCY = 0.8
NET_EFFICIENCY = 0.96


def read_source_text(path: str, *, where: str) -> str:
    """Read a text source with a size cap; any problem is a one-line `TopologyError`."""
    try:
        size = os.path.getsize(path)
        if size > MAX_SOURCE_BYTES:
            raise TopologyError(f"{where}: file is {size} bytes; at most {MAX_SOURCE_BYTES} are accepted")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SOURCE_BYTES + 1)
        if len(raw) > MAX_SOURCE_BYTES:  # a device or pipe whose size stat() does not tell
            raise TopologyError(f"{where}: more than {MAX_SOURCE_BYTES} bytes; expected a topology source")
    except TopologyError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        raise TopologyError(f"{where}: cannot read file ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(f"{where}: not UTF-8 text (byte {exc.start}); expected a text file") from None


@dataclass(frozen=True)
class HostSpec:
    """One host of a host source, in rank order."""

    host: str
    gpus: int | None = None
    """Ranks on this host (None: take it from the node source or the default)."""
    leaf: str = "leaf0"
    pod: str = "pod0"


@dataclass(frozen=True)
class NodeLayout:
    """The inside of one node, as a node source describes it."""

    gpus: int
    islands: tuple[tuple[int, ...], ...]
    """Partition of local ranks ``0..gpus-1`` into NVLink islands, each sorted, ordered by first rank."""
    source: str
    island_tier: Tier | None = None
    """Estimated island tier (None when the source has no NVLink information)."""
    net_tier_gbps: float | None = None
    """Estimated per-GPU network bandwidth (from NIC line rates), for the leaf and spine tiers."""
    nics: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        flat = sorted(r for isl in self.islands for r in isl)
        if flat != list(range(self.gpus)):
            raise TopologyError(f"{self.source}: islands {self.islands} do not partition GPUs 0..{self.gpus - 1}")


def island_tier_from_links(links_per_gpu: int, *, latency_us: float = 2.0) -> Tier:
    """Island tier estimated from the NVLinks each GPU has inside its island."""
    n = max(links_per_gpu, 1)
    return Tier("island", n * NVLINK_GBPS_PER_LINK * NVLINK_EFFICIENCY, latency_us, origin="nvlink",
                detail=f"{n} NVLink(s) x {NVLINK_GBPS_PER_LINK:g} GB/s x {NVLINK_EFFICIENCY:g}")


def net_tier_from_rate(rate_gbit: float, nics: int, gpus: int) -> float:
    """Per-GPU network bandwidth (GB/s) from ``nics`` ports of ``rate_gbit`` Gb/s shared by ``gpus`` GPUs."""
    return rate_gbit / 8.0 * NET_EFFICIENCY * nics / max(gpus, 1)


def build_topology(
    hosts: Sequence[HostSpec],
    *,
    node: NodeLayout | None = None,
    default_gpus: int = 8,
    tiers: dict[str, Tier] | None = None,
    name: str = "topology",
    source: str = "memory",
) -> Topology:
    """Ranks host by host in the given order; each host's islands follow ``node`` (else one island)."""
    if not hosts:
        raise TopologyError(f"{source}: no hosts")
    places: list[RankPlace] = []
    seen: set[str] = set()
    for spec in hosts:
        if spec.host in seen:
            raise TopologyError(f"{source}: host {spec.host!r} is listed twice")
        seen.add(spec.host)
        n = spec.gpus if spec.gpus is not None else (node.gpus if node else default_gpus)
        if node is not None and n != node.gpus:
            raise TopologyError(
                f"{source}: host {spec.host!r} has {n} ranks but {node.source} describes a node of {node.gpus} GPUs; "
                "give every host the node's GPU count"
            )
        island_of: dict[int, str] = {}
        if node is not None and len(node.islands) > 1:
            for k, isl in enumerate(node.islands):
                for lr in isl:
                    island_of[lr] = f"{spec.host}/i{k}"
        for lr in range(n):
            places.append(RankPlace(len(places), spec.host, lr, island_of.get(lr, spec.host), spec.leaf, spec.pod))
    merged = dict(DEFAULT_TIERS)
    if node is not None and node.island_tier is not None:
        merged["island"] = node.island_tier
    if node is not None and node.net_tier_gbps is not None:
        for t in ("leaf", "spine"):
            old = merged[t]
            merged[t] = Tier(t, node.net_tier_gbps, old.latency_us, old.oversubscription, origin="nic-rate",
                             detail=f"NICs of {node.source}")
    merged.update(tiers or {})
    return Topology(tuple(places), merged, name=name, source=source)
