"""Per-rank node facts -> the `Topology` of a running job, with the origin of every tier bandwidth.

Each host is described as its own ranks report it (GPU count, islands, NICs, Slurm switch), never
copied from another host. Tier bandwidths (GB/s per GPU):

    island  the slowest host's NVLink estimate (NVLinks x 25 GB/s x 0.8)          origin nvlink
    host    PCIe/SMP between islands of one host: no source gives it               origin default
    leaf    the slowest host's NIC share: line rate / 8 x 0.96 x NICs / its ranks  origin nic-rate
    spine   as leaf (no oversubscription is known from a node)                     origin nic-rate

A tier some ranks use but no fact supports keeps its DEFAULT_TIERS number, with one warning naming
the missing fact (`Topology.warnings`). `with_measured` replaces tiers by probe measurements
(origin measured).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Sequence

from .facts import NodeFacts
from .layout import NVLINK_EFFICIENCY, NVLINK_GBPS_PER_LINK, net_tier_from_rate
from .model import DEFAULT_TIERS, RankPlace, Tier, Topology, TopologyError

__all__ = ["topology_from_facts", "with_measured", "host_net_gbps", "probe_groups"]

_SHARED = ("device", "device_count", "islands", "island_links", "islands_from", "nics", "leaf", "pod")


def host_net_gbps(facts: NodeFacts, ranks: int) -> tuple[float, str] | None:
    """Per-GPU network bandwidth of a host with ``ranks`` ranks, and how it was derived; None when
    no NIC rate is known. RDMA: the most common rate of the ports that are up, one per rank at most
    (rail-optimised nodes); Ethernet: the fastest port."""
    nics = facts.fast_nics()
    if not nics:
        return None
    if nics[0].kind == "ethernet":
        best = max(nics, key=lambda n: n.rate_gbit)
        rate, count, kind = best.rate_gbit, 1, "ethernet"
    else:
        rate, count = Counter(n.rate_gbit for n in nics).most_common(1)[0]
        count = min(count, ranks)
        kind = next(n.kind for n in nics if n.rate_gbit == rate)
    return net_tier_from_rate(rate, count, ranks), f"{count} x {rate:g} Gb/s {kind} for {ranks} rank(s)"


def _check_host(host: str, ranks: list[int], facts: Sequence[NodeFacts]) -> None:
    first = facts[ranks[0]]
    for r in ranks[1:]:
        for f in _SHARED:
            a, b = getattr(first, f), getattr(facts[r], f)
            if a != b:
                raise TopologyError(
                    f"gathered facts: ranks {ranks[0]} and {r} both run on host {host!r} but report different "
                    f"{f} ({a!r} vs {b!r}); every rank of a node must see the same node"
                )


def _local_ranks(host: str, ranks: list[int], facts: Sequence[NodeFacts]) -> list[int]:
    reported = [facts[r].local_rank for r in ranks]
    if any(lr is None for lr in reported):
        return list(range(len(ranks)))
    seen: dict[int, int] = {}
    for r, lr in zip(ranks, reported):
        if lr in seen:
            raise TopologyError(f"gathered facts: ranks {seen[lr]} and {r} on host {host!r} both report local "
                                f"rank {lr}; expected one rank per local rank (LOCAL_RANK)")
        seen[lr] = r
    n = facts[ranks[0]].device_count
    for r, lr in zip(ranks, reported):
        if n and lr >= n:
            raise TopologyError(f"gathered facts: rank {r} is local rank {lr} on host {host!r}, which has {n} "
                                f"GPUs ({facts[r].islands_from}); a rank uses GPU LOCAL_RANK")
    return reported  # type: ignore[return-value]


def _island_tier(used: dict[str, NodeFacts], warnings: list[str]) -> Tier:
    base = DEFAULT_TIERS["island"]
    unknown = [h for h, f in used.items() if f.island_links <= 0]
    if unknown:
        why = "; ".join(dict.fromkeys(m for h in unknown for m in used[h].missing if "island" in m.lower()
                                      or "xgmi" in m.lower())) or "no NVLink between its GPUs"
        warnings.append(f"island tier: no NVLink bandwidth for host(s) {', '.join(unknown[:4])} ({why}); "
                        f"using the default {base.bandwidth_gbps:g} GB/s")
        return base
    host, f = min(used.items(), key=lambda kv: kv[1].island_links)
    bw = f.island_links * NVLINK_GBPS_PER_LINK * NVLINK_EFFICIENCY
    return Tier("island", bw, base.latency_us, origin="nvlink",
                detail=f"slowest host {host}: {f.island_links} NVLink(s) x {NVLINK_GBPS_PER_LINK:g} GB/s x "
                       f"{NVLINK_EFFICIENCY:g} ({f.islands_from})")


def _net_tiers(per_host: dict[str, NodeFacts], counts: dict[str, int], warnings: list[str]) -> dict[str, Tier]:
    known: dict[str, tuple[float, str]] = {}
    for h, f in per_host.items():
        got = host_net_gbps(f, counts[h])
        if got is not None:
            known[h] = got
    unknown = [h for h in per_host if h not in known]
    if unknown:
        base = DEFAULT_TIERS["leaf"]
        warnings.append(f"leaf/spine tiers: no NIC rate for host(s) {', '.join(unknown[:4])} "
                        f"({next((m for m in per_host[unknown[0]].missing if 'NIC' in m or 'speed' in m), 'no NIC')}); "
                        f"using the default {base.bandwidth_gbps:g} GB/s")
        return {}
    host, (bw, how) = min(known.items(), key=lambda kv: kv[1][0])
    return {t: Tier(t, bw, DEFAULT_TIERS[t].latency_us, origin="nic-rate", detail=f"slowest host {host}: {how}")
            for t in ("leaf", "spine")}


def topology_from_facts(facts: Sequence[NodeFacts], *, name: str = "discovered",
                        source: str = "auto") -> Topology:
    """The topology of ranks whose facts are ``facts`` (index = rank / data-parallel position)."""
    if not facts:
        raise TopologyError("gathered facts: no ranks")
    hosts: dict[str, list[int]] = {}
    for r, f in enumerate(facts):
        hosts.setdefault(f.host, []).append(r)
    per_host = {h: facts[rs[0]] for h, rs in hosts.items()}
    with_leaf = [h for h, f in per_host.items() if f.leaf]
    if with_leaf and len(with_leaf) != len(per_host):
        lacking = next(h for h in per_host if h not in with_leaf)
        raise TopologyError(f"gathered facts: host {with_leaf[0]!r} reports Slurm leaf {per_host[with_leaf[0]].leaf!r} "
                            f"but host {lacking!r} reports none; every node of the job must see the switch layout")
    places: list[RankPlace | None] = [None] * len(facts)
    for h, rs in hosts.items():
        _check_host(h, rs, facts)
        f = per_host[h]
        for r, lr in zip(rs, _local_ranks(h, rs, facts)):
            island = h
            if f.device_count and len(f.islands) > 1:
                island = f"{h}/i{next(k for k, isl in enumerate(f.islands) if lr in isl)}"
            places[r] = RankPlace(r, h, lr, island, f.leaf or "leaf0", f.pod or "pod0")
    topo = Topology(tuple(p for p in places if p is not None), dict(DEFAULT_TIERS), name=name, source=source)
    present = topo.tiers_present()
    warnings: list[str] = []
    tiers = dict(DEFAULT_TIERS)
    if "island" in present:
        multi = {topo.ranks[rs[0]].host for rs in topo.islands.values() if len(rs) > 1}
        tiers["island"] = _island_tier({h: per_host[h] for h in hosts if h in multi}, warnings)
    if "host" in present:
        warnings.append(f"host tier: the bandwidth between NVLink islands of one host is not read from any source; "
                        f"using the default {DEFAULT_TIERS['host'].bandwidth_gbps:g} GB/s")
    if "leaf" in present or "spine" in present:
        tiers.update(_net_tiers(per_host, {h: len(rs) for h, rs in hosts.items()}, warnings))
    gpu = next((f.device for f in per_host.values() if f.device_count), None)
    return replace(topo, tiers=tiers, gpu=gpu, nodes=tuple(per_host.values()), warnings=tuple(warnings))


def with_measured(topo: Topology, measured: dict[str, tuple]) -> Topology:
    """``topo`` with the tiers in ``measured`` (name -> (GB/s per GPU, how) or (GB/s per GPU, how,
    latency in us)) replaced, origin measured; without a measured latency the tier keeps its own.
    A measured spine keeps no oversubscription (the measurement already includes it)."""
    new = {}
    for t, (gbps, how, *lat) in measured.items():
        if not gbps > 0:
            raise TopologyError(f"probe: tier {t} measured {gbps!r} GB/s; expected a positive bandwidth")
        latency = lat[0] if lat else topo.tiers[t].latency_us
        if not latency >= 0:
            raise TopologyError(f"probe: tier {t} measured a latency of {latency!r} us; expected a number >= 0")
        new[t] = Tier(t, gbps, latency, 1.0, origin="measured", detail=how)
    return topo.with_tiers(**new)


def probe_groups(topo: Topology) -> dict[str, list[list[int]]]:
    """The groups the probe times, per tier in use (ranks of ``topo``; each rank in at most one group
    of a tier, so a tier's groups run at the same time, sharing links as training does):

        island  each island of two or more ranks
        host    per host with several islands: the i-th rank of each of its islands
        leaf    per leaf: the ranks at the same place in their host, over the hosts of the leaf
        spine   the ranks at the same place in their leaf (host index, place in host), over the leaves
    """
    keys: dict[str, dict[tuple, list[int]]] = {t: {} for t in topo.tiers_present()}
    host_index: dict[str, int] = {}
    for rs in topo.leaves.values():
        for i, h in enumerate(dict.fromkeys(topo.ranks[r].host for r in rs)):
            host_index[h] = i
    for p in topo.ranks:
        in_island = sorted(topo.islands[p.island]).index(p.rank)
        in_host = sorted(topo.hosts[p.host]).index(p.rank)
        wanted = {"island": (p.island,), "host": (p.host, in_island), "leaf": (p.leaf, in_host),
                  "spine": (host_index[p.host], in_host)}
        for t, groups in keys.items():
            groups.setdefault(wanted[t], []).append(p.rank)
    return {t: [g for g in groups.values() if len(g) > 1] for t, groups in keys.items()}
