"""Alpha-beta primitives over a `Topology`: resources, rank order, and the cost of ring phases.

The model (equations in docs/costmodel.md):

* Resources and their capacities (GB/s), from the topology's tiers (``effective_gbps`` =
  bandwidth / oversubscription):

  ====== ============================== ========================================
  tier   resource                       capacity
  ====== ============================== ========================================
  island one NVLink port per GPU        ``B_island``
  host   one host link per GPU          ``B_host`` (PCIe/SMP between islands)
  leaf   the NICs of one host, pooled   ``gpus_on_host * B_leaf`` (NCCL spreads
                                        channels over all NICs of a node)
  spine  the uplinks of one leaf        ``gpus_in_leaf * B_spine / oversub``
  ====== ============================== ========================================

  A message from rank a to rank b loads the resource of the tier they first share: the NVLink port
  of a, the host link of a, or the NICs of a's host; a message that crosses leaves loads a's host
  NICs *and* a's leaf uplinks. Links are full duplex, so only the sending side is counted.

* A phase (one collective running on several disjoint groups at once) takes
  ``max over resources (load / capacity) + steps * alpha``, where alpha is the largest latency of the
  tiers its messages use. Phases run back-to-back (sum of phase times) or pipelined by chunks as NCCL
  does (max over resources of the summed load, plus the summed latencies).

Everything is linear in the message size, so an algorithm is evaluated once per gradient size and
buckets are priced as ``latency + fraction * bandwidth_time`` (see overlap.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from ..topology.model import RankPlace, Topology

__all__ = [
    "SimError", "DTYPE_BYTES", "RANK_ORDERS", "SIM_TIERS", "Fabric", "Phase",
    "apply_rank_order", "ring_phase", "combine", "dtype_bytes",
]

SIM_TIERS: tuple[str, ...] = ("island", "host", "leaf", "spine")
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1 + 4 / 256}
"""Wire bytes per element; int8 carries one fp32 scale per 256 elements."""
GRADIENT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The wire dtypes every gradient hop may use (int8 only on the SYNC and reconciliation wires)."""
RANK_ORDERS: tuple[str, ...] = ("leaf", "scattered", "file")
GB = 1e9


class SimError(ValueError):
    """Input the cost model cannot use; the message names what, which value and what is accepted."""


def dtype_bytes(name: str, what: str = "dtype") -> float:
    accepted = list(DTYPE_BYTES) if what in ("reconcile_dtype", "sync_dtype") else list(GRADIENT_DTYPES)
    if name not in accepted:
        raise SimError(f"{what} = {name!r}; expected one of {accepted}")
    return DTYPE_BYTES[name]


def apply_rank_order(topo: Topology, order: str, *, seed: int = 0) -> Topology:
    """Renumber ranks host by host.

    * ``file``: as the topology lists them;
    * ``leaf``: hosts grouped by pod and leaf (the planner's recommended order, `topo-align hostfile`);
    * ``scattered``: hosts in a seeded random order, as a fragmented allocation without topology-aware
      placement gives (with L leaves about (L-1)/L of the host-to-host ring edges cross the spine).
    """
    if order not in RANK_ORDERS:
        raise SimError(f"rank order = {order!r}; expected one of {list(RANK_ORDERS)}")
    if order == "file":
        return topo
    by_host: dict[str, list[RankPlace]] = {}
    for p in topo.ranks:
        by_host.setdefault(p.host, []).append(p)
    hosts = list(by_host)
    if order == "leaf":
        first: dict[tuple[str, str], int] = {}
        for p in topo.ranks:
            first.setdefault((p.pod, p.leaf), len(first))
        pos = {h: i for i, h in enumerate(hosts)}
        hosts.sort(key=lambda h: (first[(by_host[h][0].pod, by_host[h][0].leaf)], pos[h]))
    else:
        random.Random(seed).shuffle(hosts)
    places: list[RankPlace] = []
    for h in hosts:
        for p in by_host[h]:
            places.append(RankPlace(len(places), p.host, p.local_rank, p.island, p.leaf, p.pod))
    return Topology(tuple(places), dict(topo.tiers), name=topo.name,
                    source=f"{topo.source} (rank order {order})", gpu=topo.gpu)


@dataclass(frozen=True)
class Fabric:
    """Integer ids and capacities of a topology, for vectorised cost computation."""

    topo: Topology
    island: np.ndarray
    host: np.ndarray
    leaf: np.ndarray
    cap_island: float
    cap_host: float
    cap_nic: np.ndarray
    """bytes/s of each host's pooled NICs."""
    cap_up: np.ndarray
    """bytes/s of each leaf's spine uplinks."""
    alpha: dict[str, float]
    """Latency per message step of each tier, seconds."""

    @classmethod
    def from_topology(cls, topo: Topology) -> Fabric:
        def ids(key: str) -> np.ndarray:
            index: dict[str, int] = {}
            return np.fromiter((index.setdefault(getattr(p, key), len(index)) for p in topo.ranks),
                               dtype=np.int64, count=topo.world_size)

        island, host, leaf = ids("island"), ids("host"), ids("leaf")
        t = topo.tiers
        gpus_host = np.bincount(host).astype(float)
        gpus_leaf = np.bincount(leaf).astype(float)
        return cls(
            topo=topo, island=island, host=host, leaf=leaf,
            cap_island=t["island"].effective_gbps * GB,
            cap_host=t["host"].effective_gbps * GB,
            cap_nic=gpus_host * t["leaf"].effective_gbps * GB,
            cap_up=gpus_leaf * t["spine"].effective_gbps * GB,
            alpha={k: t[k].latency_us * 1e-6 for k in SIM_TIERS},
        )

    @property
    def world_size(self) -> int:
        return int(self.island.shape[0])

    def tier_codes(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """0 island, 1 host, 2 leaf, 3 spine for each (src, dst) pair."""
        code = np.full(src.shape, 3, dtype=np.int8)
        code[self.leaf[src] == self.leaf[dst]] = 2
        code[self.host[src] == self.host[dst]] = 1
        code[self.island[src] == self.island[dst]] = 0
        return code

    def zero_phase(self, name: str) -> Phase:
        return Phase(
            name=name,
            load_island=np.zeros(self.world_size), load_host=np.zeros(self.world_size),
            load_nic=np.zeros(self.cap_nic.shape[0]), load_up=np.zeros(self.cap_up.shape[0]),
            latency_s=0.0, fabric=self,
        )

    def add_messages(self, ph: Phase, src: np.ndarray, dst: np.ndarray, nbytes: float | np.ndarray) -> np.ndarray:
        """Load the resources the messages src->dst use; returns their tier codes."""
        src = np.asarray(src, dtype=np.int64).ravel()
        dst = np.asarray(dst, dtype=np.int64).ravel()
        b = np.broadcast_to(np.asarray(nbytes, dtype=float), src.shape)
        code = self.tier_codes(src, dst)
        m = code == 0
        np.add.at(ph.load_island, src[m], b[m])
        m = code == 1
        np.add.at(ph.load_host, src[m], b[m])
        m = code >= 2
        np.add.at(ph.load_nic, self.host[src[m]], b[m])
        m = code == 3
        np.add.at(ph.load_up, self.leaf[src[m]], b[m])
        for c, name in enumerate(SIM_TIERS):
            ph.tier_bytes[name] += float(b[code == c].sum())
        return code

    def max_alpha(self, codes: np.ndarray) -> float:
        if codes.size == 0:
            return 0.0
        return max(self.alpha[SIM_TIERS[c]] for c in np.unique(codes))


@dataclass
class Phase:
    """Loads (bytes sent) on every resource during one collective phase, and its latency."""

    name: str
    load_island: np.ndarray
    load_host: np.ndarray
    load_nic: np.ndarray
    load_up: np.ndarray
    latency_s: float
    fabric: Fabric = field(repr=False)
    tier_bytes: dict[str, float] = field(default_factory=lambda: {t: 0.0 for t in SIM_TIERS})
    """Bytes sent over each tier, summed over the cluster (a spine message counts under spine only)."""

    def tier_seconds(self) -> dict[str, float]:
        """Busy time of the most loaded resource of each tier."""
        f = self.fabric
        return {
            "island": float(self.load_island.max(initial=0.0)) / f.cap_island,
            "host": float(self.load_host.max(initial=0.0)) / f.cap_host,
            "leaf": float((self.load_nic / f.cap_nic).max(initial=0.0)),
            "spine": float((self.load_up / f.cap_up).max(initial=0.0)),
        }

    def bandwidth_s(self) -> float:
        return max(self.tier_seconds().values())

    def scaled(self, k: float, name: str | None = None) -> Phase:
        """The same phase with every byte multiplied by ``k`` (latency unchanged)."""
        return Phase(
            name=name or self.name, load_island=self.load_island * k, load_host=self.load_host * k,
            load_nic=self.load_nic * k, load_up=self.load_up * k, latency_s=self.latency_s,
            fabric=self.fabric, tier_bytes={t: v * k for t, v in self.tier_bytes.items()},
        )


def ring_phase(fab: Fabric, rings: np.ndarray, nbytes: float, kind: str, name: str) -> Phase:
    """Ring collective on each row of ``rings`` (k disjoint rings of m ranks, in ring order), all at once.

    Phases of one ring all-reduce of ``nbytes`` per rank:
      1. reduce-scatter: m-1 steps, each rank sends nbytes/m to its successor per step;
      2. all-gather: m-1 more steps of nbytes/m.
    So each rank sends 2(m-1)/m * nbytes (``kind="allreduce"``), or (m-1)/m * nbytes for
    ``"reducescatter"`` / ``"allgather"`` alone; latency is steps * the largest alpha of the ring's edges.
    """
    rings = np.atleast_2d(np.asarray(rings, dtype=np.int64))
    ph = fab.zero_phase(name)
    k, m = rings.shape
    if m <= 1 or nbytes == 0:
        return ph
    factor = {"allreduce": 2.0, "reducescatter": 1.0, "allgather": 1.0}[kind]
    steps = int(factor) * (m - 1)
    per_rank = factor * (m - 1) / m * nbytes
    codes = fab.add_messages(ph, rings, np.roll(rings, -1, axis=1), per_rank)
    ph.latency_s = steps * fab.max_alpha(codes)
    return ph


def combine(phases: list[Phase], pipelined: bool) -> tuple[float, float, dict[str, float]]:
    """(bandwidth seconds, latency seconds, busy seconds per tier) of phases run in sequence.

    Back-to-back: each phase waits for the previous one, so times add. Pipelined: chunks flow through
    all phases at once, so each resource is busy for its summed load and the slowest resource sets
    the pace; the latencies still add (the first chunk crosses every phase).
    """
    latency = sum(p.latency_s for p in phases)
    if not phases:
        return 0.0, 0.0, {t: 0.0 for t in SIM_TIERS}
    if not pipelined:
        per = [p.tier_seconds() for p in phases]
        tiers = {t: sum(d[t] for d in per) for t in SIM_TIERS}
        return sum(max(d.values()) for d in per), latency, tiers
    f = phases[0].fabric
    total = f.zero_phase("sum")
    for p in phases:
        total.load_island += p.load_island
        total.load_host += p.load_host
        total.load_nic += p.load_nic
        total.load_up += p.load_up
    tiers = total.tier_seconds()
    return max(tiers.values()), latency, tiers
