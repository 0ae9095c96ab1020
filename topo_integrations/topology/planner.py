"""Plan communication groups from a `Topology` (pure Python; no torch.distributed needed).

The plan has
  * intra groups: the fast islands (``group_by="island"``) or all ranks under a leaf (``"leaf"``);
  * inter groups (rails): the i-th rank of every intra group;
  * a leaf level for 3-level reduction: inside each leaf, the i-th rank of every island
    (``leaf_rails``), and across leaves, the ranks at the same place in their leaf (``spine_rails``);
  * a recommended host order (hosts grouped by pod and leaf, so a ring crosses the spine rarely);
  * whether the tiers differ enough (``min_tier_ratio``) for grouping to pay off.

Islands of one rank (one GPU per node, or one per NVLink domain) give `hierarchical` nothing to do
inside a group, so the plan is flat; for ``mode="selective"`` it keeps two levels (groups of one rank,
one rail of every rank) when the tiers differ: LOCAL tensors then cross no link between
reconciliations (local SGD per rank), SYNC tensors and the reconciliation cross the rail.

The plan is deterministic: the same topology and options give the same groups, in the same order,
on every rank, which `torch.distributed.new_group` requires.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..config import Mode
from .model import Topology, TopologyError

__all__ = ["Plan", "PlanError", "plan_groups", "recommended_host_order"]


class PlanError(TopologyError):
    """The topology cannot be planned as asked (e.g. unequal islands); the message says why."""


Groups = tuple[tuple[int, ...], ...]
_PLURAL = {"island": "islands", "leaf": "leaves"}


@dataclass(frozen=True)
class Plan:
    world_size: int
    group_by: str
    hierarchical: bool
    """True when the intra and inter tiers differ by at least ``min_tier_ratio``."""
    reason: str
    """Why the plan is (or is not) hierarchical, for the log and `topo-align plan`."""
    intra_groups: Groups
    inter_groups: Groups
    intra_tier: str
    inter_tier: str
    intra_bandwidth_gbps: float
    inter_bandwidth_gbps: float
    tier_ratio: float
    intra_origin: str = "default"
    """Where the intra tier's bandwidth came from (`Tier.origin`: measured, nic-rate, nvlink, file, default)."""
    inter_origin: str = "default"
    intra_latency_us: float | None = None
    """Latency of the intra tier as the topology states it (the probe measures bandwidth only)."""
    inter_latency_us: float | None = None
    leaf_groups: Groups = ()
    leaf_rails: Groups = ()
    """3-level: inside each leaf, the i-th rank of every island (empty when not applicable)."""
    spine_rails: Groups = ()
    """3-level: across leaves, the ranks at the same position of their leaf."""
    middle_level: bool = False
    """Whether the reducer should use the 3-level (island, leaf rail, spine rail) hierarchy."""
    host_order: tuple[str, ...] = ()
    """Recommended host order: grouped by pod and leaf, stable within a leaf."""
    rank_order_changes: int = 0
    """How many hosts the recommended order moves relative to the current rank order."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    # -- lookups -----------------------------------------------------------------------------------

    def intra_group_of(self, rank: int) -> tuple[int, ...]:
        return self._index(self.intra_groups)[rank]

    def inter_group_of(self, rank: int) -> tuple[int, ...]:
        return self._index(self.inter_groups)[rank]

    def group_index(self, rank: int) -> int:
        """Index of the intra group holding ``rank`` (the replica id in `selective`)."""
        for i, g in enumerate(self.intra_groups):
            if rank in g:
                return i
        raise KeyError(rank)

    def _index(self, groups: Groups) -> dict[int, tuple[int, ...]]:
        return {r: g for g in groups for r in g}

    @property
    def num_groups(self) -> int:
        return len(self.intra_groups)

    @property
    def group_size(self) -> int:
        return len(self.intra_groups[0]) if self.intra_groups else 0

    # -- serialisation (rank 0 plans, every rank builds groups from the broadcast plan) -----------

    def to_json(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = [list(x) if isinstance(x, tuple) else x for x in v]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        def groups(v):
            return tuple(tuple(int(r) for r in g) for g in v)

        kw = dict(d)
        for k in ("intra_groups", "inter_groups", "leaf_groups", "leaf_rails", "spine_rails"):
            kw[k] = groups(kw.get(k, ()))
        kw["host_order"] = tuple(kw.get("host_order", ()))
        kw["notes"] = tuple(kw.get("notes", ()))
        return cls(**kw)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _rails(groups: list[list[int]]) -> Groups:
    size = len(groups[0])
    return tuple(tuple(g[i] for g in groups) for i in range(size))


def _check_equal(groups: dict[str, list[int]], what: str, topo: Topology) -> None:
    sizes = {len(g) for g in groups.values()}
    if len(sizes) > 1:
        counts: dict[int, int] = {}
        for g in groups.values():
            counts[len(g)] = counts.get(len(g), 0) + 1
        desc = ", ".join(f"{n} x {s}" for s, n in sorted(counts.items(), reverse=True))
        bad = next(k for k, g in groups.items() if len(g) != max(sizes))
        raise PlanError(
            f"{topo.name}: {what} have unequal sizes ({desc} ranks; e.g. {bad!r} has {len(groups[bad])}); "
            "hierarchical and selective need equal groups: give every node the same number of ranks, "
            "use mode 'flat', or group_by 'leaf' if the leaves are equal"
        )


def _slowest(topo: Topology, tiers: list[str]) -> tuple[str, float]:
    name = min(tiers, key=lambda t: topo.tiers[t].effective_gbps)
    return name, topo.tiers[name].effective_gbps


def recommended_host_order(topo: Topology) -> tuple[tuple[str, ...], int]:
    """Hosts grouped by pod, then leaf (each in order of first appearance), keeping each leaf's own
    host order; and how many positions differ from the current order. Needs no equal islands."""
    first_seen: dict[tuple[str, str], int] = {}
    host_key: dict[str, tuple[int, int]] = {}
    for p in topo.ranks:
        k = (p.pod, p.leaf)
        first_seen.setdefault(k, len(first_seen))
        if p.host not in host_key:
            host_key[p.host] = (first_seen[k], len(host_key))
    current = list(host_key)
    host_order = tuple(sorted(current, key=lambda h: host_key[h]))
    return host_order, sum(1 for a, b in zip(current, host_order) if a != b)


def plan_groups(
    topo: Topology,
    *,
    group_by: str = "island",
    min_tier_ratio: float = 1.3,
    middle_level: bool = False,
    mode: str | None = None,
) -> Plan:
    """Plan groups for ``topo``; raises :class:`PlanError` where equal groups cannot be formed.

    ``mode`` is the reducer mode the plan is for (None: any). Where every group holds one rank the
    plan is flat (one all-reduce: a hierarchy of groups of one is the same ring with more steps),
    except for ``"selective"``: its LOCAL class needs no intra group (each rank keeps its own replica
    between reconciliations, i.e. local SGD with a SYNC class), so it keeps two levels, groups of one
    and one rail of every rank, when the tiers differ by ``min_tier_ratio``, and says so in ``notes``.
    """
    if group_by not in ("island", "leaf"):
        raise PlanError(f"group_by = {group_by!r}; expected 'island' or 'leaf'")
    present = topo.tiers_present()
    islands = topo.islands
    leaves = topo.leaves
    notes: list[str] = []

    # 1. Host order: by pod, then leaf, keeping each leaf's own host order.
    host_order, moved = recommended_host_order(topo)
    if moved:
        notes.append(f"{moved} hosts are not ordered by leaf; `topo-align hostfile` writes the recommended order")

    # 2. Intra groups and the tier each side of the split runs on.
    if group_by == "island":
        intra = islands
        inside = ["island"]
        outside = [t for t in present if t != "island"] or ["island"]
    else:
        intra = leaves
        inside = [t for t in present if t != "spine"] or ["island"]
        outside = ["spine"]
    intra_lists = [sorted(g) for g in intra.values()]
    intra_tier, intra_bw = _slowest(topo, inside)
    inter_tier, inter_bw = _slowest(topo, outside)
    ratio = intra_bw / inter_bw if inter_bw > 0 else float("inf")
    intra_o, inter_o = topo.tiers[intra_tier].origin, topo.tiers[inter_tier].origin

    # 3. Decide whether grouping pays off.
    reason = ""
    if len(intra_lists) == 1:
        reason = f"one {group_by} holds all {topo.world_size} ranks: a single tier"
    elif all(len(g) == 1 for g in intra_lists) and mode != Mode.SELECTIVE:
        reason = (f"every {group_by} holds one rank: nothing to reduce inside groups"
                  + ("; try group_by 'leaf'" if group_by == "island" and len(leaves) > 1 else ""))
    elif ratio < min_tier_ratio:
        reason = (f"intra tier '{intra_tier}' ({intra_bw:g} GB/s, {intra_o}) and inter tier '{inter_tier}' "
                  f"({inter_bw:g} GB/s, {inter_o}) differ by {ratio:.2f}x < min_tier_ratio {min_tier_ratio:g}")
    hierarchical = not reason
    if hierarchical:
        _check_equal(intra, _PLURAL[group_by], topo)
        reason = (f"{len(intra_lists)} {_PLURAL[group_by]} of {len(intra_lists[0])} ranks; intra tier '{intra_tier}' "
                  f"{intra_bw:g} GB/s ({intra_o}) vs inter tier '{inter_tier}' {inter_bw:g} GB/s ({inter_o}) "
                  f"({ratio:.1f}x)")
        inter = _rails(intra_lists)
        if len(intra_lists[0]) == 1:
            notes.append(f"every {group_by} holds one rank: mode 'selective' keeps two levels (groups of one "
                         "rank: LOCAL tensors are not reduced between reconciliations, each rank trains its own "
                         f"replica; SYNC tensors and the reconciliation cross the rail of all {topo.world_size} "
                         "ranks)")
    else:
        intra_lists = [list(range(topo.world_size))]
        inter = tuple((r,) for r in range(topo.world_size))

    # 4. Leaf level (3-level hierarchy): only with island groups, several leaves, equal shapes.
    leaf_groups: Groups = tuple(tuple(sorted(g)) for g in leaves.values())
    leaf_rails: Groups = ()
    spine_rails: Groups = ()
    use_middle = False
    if hierarchical and group_by == "island" and len(leaves) > 1:
        per_leaf: list[list[list[int]]] = []
        for lranks in leaves.values():
            isl = list(dict.fromkeys(topo.ranks[r].island for r in lranks))
            per_leaf.append([sorted(islands[i]) for i in isl])
        if len({len(x) for x in per_leaf}) == 1 and len(per_leaf[0]) > 1:
            leaf_rails = tuple(r for groups in per_leaf for r in _rails(groups))
            # Position p of leaf-rail groups: the same rail-in-leaf in every leaf.
            n_pos = len(leaf_rails) // len(per_leaf)
            spine_rails = tuple(
                tuple(leaf_rails[li * n_pos + p][j] for li in range(len(per_leaf)))
                for p in range(n_pos)
                for j in range(len(per_leaf[0]))
            )
            use_middle = middle_level
        elif middle_level:
            notes.append("middle_level asked for, but leaves hold different numbers of islands "
                         "(or one island each): using 2 levels")
    elif middle_level:
        notes.append("middle_level needs group_by 'island', several leaves and a hierarchical plan: using 2 levels")

    return Plan(
        world_size=topo.world_size,
        group_by=group_by,
        hierarchical=hierarchical,
        reason=reason,
        intra_groups=tuple(tuple(g) for g in intra_lists),
        inter_groups=inter,
        intra_tier=intra_tier,
        inter_tier=inter_tier,
        intra_bandwidth_gbps=intra_bw,
        inter_bandwidth_gbps=inter_bw,
        tier_ratio=ratio,
        intra_origin=intra_o,
        inter_origin=inter_o,
        intra_latency_us=topo.tiers[intra_tier].latency_us,
        inter_latency_us=topo.tiers[inter_tier].latency_us,
        leaf_groups=leaf_groups,
        leaf_rails=leaf_rails,
        spine_rails=spine_rails,
        middle_level=use_middle,
        host_order=host_order,
        rank_order_changes=moved,
        notes=tuple(notes),
    )
