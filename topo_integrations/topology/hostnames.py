"""The topology of a running job from the hostname each rank reports.

Ranks are taken as they are: rank ``r`` runs on ``hostnames[r]``. Ranks of one host need not be
consecutive (a scheduler may interleave them); a rank's local index is its order among the ranks of
its host unless ``local_ranks`` gives it (e.g. the gathered ``LOCAL_RANK``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .layout import NodeLayout
from .model import DEFAULT_TIERS, RankPlace, Tier, Topology, TopologyError

__all__ = ["topology_from_hostnames"]


def topology_from_hostnames(
    hostnames: Sequence[str],
    *,
    local_ranks: Sequence[int] | None = None,
    node: NodeLayout | None = None,
    leaf_of: Mapping[str, str] | None = None,
    pod_of: Mapping[str, str] | None = None,
    tiers: Mapping[str, Tier] | None = None,
    name: str = "hostnames",
) -> Topology:
    """Build a `Topology` from per-rank hostnames (index = global rank).

    ``node`` splits each host into its NVLink islands (by local rank); ``leaf_of``/``pod_of`` map
    hosts to leaves and pods (default: one leaf, one pod).
    """
    src = "hostnames"
    if isinstance(hostnames, (str, bytes)) or not isinstance(hostnames, Sequence) or not hostnames:
        raise TopologyError(f"{src}: expected a non-empty list of host names, one per rank")
    if local_ranks is not None and len(local_ranks) != len(hostnames):
        raise TopologyError(f"{src}: {len(local_ranks)} local ranks for {len(hostnames)} ranks; expected one per rank")
    counts: dict[str, int] = {}
    used: set[tuple[str, int]] = set()
    places: list[RankPlace] = []
    for r, h in enumerate(hostnames):
        if not isinstance(h, str) or not h.strip() or len(h) > 255:
            raise TopologyError(f"{src}: rank {r} reports host {h!r}; expected a non-empty name")
        lr = counts.get(h, 0)
        counts[h] = lr + 1
        if local_ranks is not None:
            lr = local_ranks[r]
            if isinstance(lr, bool) or not isinstance(lr, int) or lr < 0:
                raise TopologyError(f"{src}: rank {r} has local rank {lr!r}; expected an integer >= 0")
        if (h, lr) in used:
            raise TopologyError(
                f"{src}: ranks share host {h!r} and local rank {lr}; expected one rank per (host, local rank)"
            )
        used.add((h, lr))
        island = h
        if node is not None and len(node.islands) > 1:
            if lr >= node.gpus:
                raise TopologyError(
                    f"{src}: rank {r} is local rank {lr} on {h!r}, but {node.source} has {node.gpus} GPUs"
                )
            k = next(i for i, isl in enumerate(node.islands) if lr in isl)
            island = f"{h}/i{k}"
        leaf = (leaf_of or {}).get(h, "leaf0")
        places.append(RankPlace(r, h, lr, island, leaf, (pod_of or {}).get(h, "pod0")))
    merged = dict(DEFAULT_TIERS)
    if node is not None and node.island_tier is not None:
        merged["island"] = node.island_tier
    merged.update(tiers or {})
    return Topology(tuple(places), merged, name=name, source=src)
