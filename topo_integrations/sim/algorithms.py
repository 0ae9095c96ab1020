"""All-reduce algorithms of the data-parallel gradient, priced with the primitives of model.py.

Every function takes the `Fabric`, the data-parallel groups (a k x m array: k groups of m ranks that
reduce at the same time, e.g. one per TP x PP position) and the gradient size per rank, and returns a
`CommCost`: the phases of one step, split into streams that buckets are cut from (overlap.py). The
peers' algorithms (post-local SGD, DiLoCo, PowerSGD) are in peers.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .model import SIM_TIERS, Fabric, Phase, SimError, combine, ring_phase

__all__ = [
    "NotApplicable", "ALGORITHMS", "Stream", "CommCost", "SelectiveSpec",
    "flat_ring", "double_binary_tree", "hierarchical_2level", "hierarchical_3level", "selective",
    "split_groups", "three_level_groups",
]

ALGORITHMS: dict[str, str] = {
    "ring": "Flat ring (NCCL Ring)",
    "tree": "Tree (chain + double binary tree)",
    "nccl": "NCCL tuner (faster of ring/tree per bucket)",
    "hier2": "2-level hier., pipelined (NCCL-style)",
    "hier2-b2b": "2-level hier., back-to-back",
    "hier3": "3-level hier., pipelined",
    "hier3-b2b": "3-level hier., back-to-back",
    "selective": "Selective (SYNC hier. + LOCAL in group)",
    "localsgd": "Post-local SGD (grads in group, params averaged every H)",
    "diloco": "DiLoCo (grads in group, fp32 pseudo-gradient over rails every H)",
    "powersgd": "PowerSGD (rank-r P and Q, flat ring over all ranks)",
}
"""The peers (``localsgd``, ``diloco``, ``powersgd``: sim/peers.py) are priced only when asked for."""


class NotApplicable(SimError):
    """The algorithm cannot run on this layout (e.g. unequal islands); the others still can."""


@dataclass
class Stream:
    """Gradients reduced by one kind of collective; buckets of this stream go one after another."""

    name: str
    grad_fraction: float
    """Share of the gradient elements carried by this stream."""
    phases: list[Phase]
    pipelined: bool
    held_until: float = 0.0
    """Fraction of backward before which none of its buckets is released (overlap.QueuedStream)."""

    @property
    def bandwidth_s(self) -> float:
        return combine(self.phases, self.pipelined)[0]

    @property
    def latency_s(self) -> float:
        """Latency of one collective (paid once per bucket)."""
        return combine(self.phases, self.pipelined)[1]


@dataclass
class CommCost:
    """Communication of one training step for one algorithm (before bucketing and overlap)."""

    key: str
    label: str
    streams: list[Stream]
    background: list[Phase] = field(default_factory=list)
    """Per-step share of periodic work (selective reconciliation, already divided by the interval)."""
    background_blocking: bool = True
    """Whether the background work stops training (sync reconcile) or overlaps it (async)."""
    launch_rate: float = 1.0
    """Launches of the background work per step (``F / H``: F stream fragments per interval of H
    steps); one launch carries ``background_s() / launch_rate``."""
    launch_scales: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    """(share of the launches, time relative to the mean launch): a launch with the optimizer
    moments carries more than one without (every ``moments_interval``-th)."""

    def all_phases(self) -> list[Phase]:
        return [p for s in self.streams for p in s.phases] + list(self.background)

    def tier_bytes(self) -> dict[str, float]:
        """Bytes sent per step on each tier, summed over the cluster."""
        out = {t: 0.0 for t in SIM_TIERS}
        for p in self.all_phases():
            for t, v in p.tier_bytes.items():
                out[t] += v
        return out

    def tier_seconds(self) -> dict[str, float]:
        """Busy time of the busiest resource of each tier (streams and background, loads summed)."""
        phases = self.all_phases()
        return combine(phases, True)[2] if phases else {t: 0.0 for t in SIM_TIERS}

    def comm_s(self) -> float:
        """One collective per stream over the whole gradient, the streams one after another (the
        engine's one issuing queue: overlap.py), no overlap with compute."""
        grad = sum(s.bandwidth_s + s.latency_s for s in self.streams)
        return grad + (self.background_s() if self.background_blocking else 0.0)

    def background_s(self) -> float:
        bw, lat, _ = combine(self.background, False)
        return bw + lat


# -- groups ----------------------------------------------------------------------------------------


def _check_equal(sizes: list[int], what: str) -> int:
    if len(set(sizes)) > 1:
        counts: dict[int, int] = {}
        for s in sizes:
            counts[s] = counts.get(s, 0) + 1
        desc = ", ".join(f"{n} x {s}" for s, n in sorted(counts.items(), reverse=True))
        raise NotApplicable(f"{what} have unequal sizes ({desc} ranks); hierarchical algorithms need equal groups")
    return sizes[0]


def split_groups(fab: Fabric, groups: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Split each data-parallel group by island (or leaf): (intra rings (k*R, g), rails (k*g, R)).

    Rails hold the i-th member of every intra group, ordered as the intra groups first appear in
    rank order, as the planner builds them.
    """
    ids = {"island": fab.island, "leaf": fab.leaf, "host": fab.host}[key]
    intra: list[list[int]] = []
    rails: list[list[int]] = []
    for row in groups:
        parts: dict[int, list[int]] = {}
        for r in row.tolist():
            parts.setdefault(int(ids[r]), []).append(r)
        lists = list(parts.values())
        g = _check_equal([len(x) for x in lists], f"{key} groups inside a data-parallel group")
        intra.extend(lists)
        rails.extend([x[i] for x in lists] for i in range(g))
    return np.array(intra, dtype=np.int64), np.array(rails, dtype=np.int64)


def three_level_groups(fab: Fabric, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(island rings (., g), leaf rails (., q), spine rails (., L)) for the 3-level hierarchy.

    Leaf rail: inside one leaf, the i-th member of each of its q islands. Spine rail: the member at
    the same (island position, rail position) in each of the L leaves.
    """
    isl_rings: list[list[int]] = []
    leaf_rails: list[list[int]] = []
    spine_rails: list[list[int]] = []
    for row in groups:
        islands: dict[int, list[int]] = {}
        for r in row.tolist():
            islands.setdefault(int(fab.island[r]), []).append(r)
        ilists = list(islands.values())
        g = _check_equal([len(x) for x in ilists], "island groups inside a data-parallel group")
        by_leaf: dict[int, list[list[int]]] = {}
        for x in ilists:
            by_leaf.setdefault(int(fab.leaf[x[0]]), []).append(x)
        leaves = list(by_leaf.values())
        q = _check_equal([len(v) for v in leaves], "islands per leaf inside a data-parallel group")
        isl_rings.extend(ilists)
        for v in leaves:
            leaf_rails.extend([x[i] for x in v] for i in range(g))
        for j in range(q):
            for i in range(g):
                spine_rails.append([v[j][i] for v in leaves])
    return (np.array(isl_rings, dtype=np.int64), np.array(leaf_rails, dtype=np.int64),
            np.array(spine_rails, dtype=np.int64))


# -- algorithms ------------------------------------------------------------------------------------


def flat_ring(fab: Fabric, groups: np.ndarray, nbytes: float) -> CommCost:
    """One ring all-reduce per data-parallel group, in rank order (NCCL Ring)."""
    ph = ring_phase(fab, groups, nbytes, "allreduce", "ring all-reduce")
    return CommCost("ring", ALGORITHMS["ring"], [Stream("grad", 1.0, [ph], True)])


def _btree(n: int) -> tuple[np.ndarray, int]:
    """Parent of each position of NCCL's binary tree over 0..n-1 (root 0 has parent -1), and the depth
    in edges. Position r's level is its lowest set bit: odd positions are leaves, so the mirrored second
    tree makes them inner nodes there. Parent: (r ^ bit) | (bit << 1), or r ^ bit when that is >= n."""
    r = np.arange(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    if n > 1:
        rr = r[1:]
        bit = rr & -rr
        up = (rr ^ bit) | (bit << 1)
        parent[1:] = np.where(up >= n, rr ^ bit, up)
    depth, cur = 0, parent.copy()
    while (cur >= 0).any():
        depth += 1
        cur = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
    return parent, depth


def double_binary_tree(fab: Fabric, groups: np.ndarray, nbytes: float) -> CommCost:
    """NCCL Tree: a chain inside each host, a double binary tree across hosts, reduce then broadcast.

    Phases (pipelined by chunks, so priced as one phase):
      1. reduce up the intra-host chain (each member but the head sends the full nbytes once);
      2. reduce up two binary trees over the hosts, each carrying half of the data
         (tree 2 = tree 1 mirrored, or shifted by one host for an odd count, as NCCL does, so most
         hosts that are leaves in one tree are inner nodes in the other);
      3. broadcast down both trees (nbytes/2 per tree edge);
      4. broadcast down the chain.
    Latency: 2 * ((members per host - 1) * alpha_chain + depth * alpha_tree).
    """
    ph = fab.zero_phase("tree all-reduce")
    chain_steps = 0
    chain_codes: list[np.ndarray] = []
    tree_codes: list[np.ndarray] = []
    depth = 0
    for row in groups:
        hosts: dict[int, list[int]] = {}
        for r in row.tolist():
            hosts.setdefault(int(fab.host[r]), []).append(r)
        chains = list(hosts.values())
        for c in chains:
            if len(c) > 1:
                a = np.array(c, dtype=np.int64)
                # reduce towards the head, broadcast away from it: each chain edge carries nbytes both ways
                chain_codes.append(fab.add_messages(ph, a[1:], a[:-1], nbytes))
                fab.add_messages(ph, a[:-1], a[1:], nbytes)
                chain_steps = max(chain_steps, len(c) - 1)
        n = len(chains)
        if n > 1:
            heads = np.array([c[0] for c in chains], dtype=np.int64)
            parent, d = _btree(n)
            depth = max(depth, d)
            child = np.nonzero(parent >= 0)[0]
            # Tree 2 is tree 1 mirrored (even n) or shifted by one (odd n), as NCCL builds them.
            second = (lambda x: n - 1 - x) if n % 2 == 0 else (lambda x: (x + 1) % n)
            for where in ((lambda x: x), second):
                src = heads[where(child)]
                dst = heads[where(parent[child])]
                tree_codes.append(fab.add_messages(ph, src, dst, nbytes / 2))  # reduce
                fab.add_messages(ph, dst, src, nbytes / 2)  # broadcast
    a_chain = fab.max_alpha(np.concatenate(chain_codes)) if chain_codes else 0.0
    a_tree = fab.max_alpha(np.concatenate(tree_codes)) if tree_codes else 0.0
    ph.latency_s = 2 * (chain_steps * a_chain + depth * a_tree)
    return CommCost("tree", ALGORITHMS["tree"], [Stream("grad", 1.0, [ph], True)])


def _hier2_phases(fab: Fabric, intra: np.ndarray, rails: np.ndarray, nbytes: float, inter_bytes: float,
                  tag: str = "") -> list[Phase]:
    """Phases of the exact 2-level all-reduce of nbytes per rank:
      1. reduce-scatter inside each intra group (g ranks): (g-1)/g * nbytes per rank;
      2. all-reduce of the 1/g shard over each rail (R ranks): 2(R-1)/R * inter_bytes/g per rank;
      3. all-gather inside each intra group: (g-1)/g * nbytes per rank.
    ``inter_bytes`` is nbytes re-expressed in the inter wire dtype."""
    g = intra.shape[1]
    return [
        ring_phase(fab, intra, nbytes, "reducescatter", f"{tag}intra reduce-scatter"),
        ring_phase(fab, rails, inter_bytes / g, "allreduce", f"{tag}rail all-reduce"),
        ring_phase(fab, intra, nbytes, "allgather", f"{tag}intra all-gather"),
    ]


def hierarchical_2level(fab: Fabric, groups: np.ndarray, nbytes: float, *, pipelined: bool,
                        inter_bytes: float | None = None, group_by: str = "island") -> CommCost:
    intra, rails = split_groups(fab, groups, group_by)
    phases = _hier2_phases(fab, intra, rails, nbytes, nbytes if inter_bytes is None else inter_bytes)
    key = "hier2" if pipelined else "hier2-b2b"
    return CommCost(key, ALGORITHMS[key], [Stream("grad", 1.0, phases, pipelined)])


def hierarchical_3level(fab: Fabric, groups: np.ndarray, nbytes: float, *, pipelined: bool,
                        inter_bytes: float | None = None) -> CommCost:
    """Phases:
      1. reduce-scatter in the island (g): (g-1)/g * S;
      2. reduce-scatter over the leaf rail (q islands of one leaf): (q-1)/q * S/g;
      3. all-reduce over the spine rail (L leaves): 2(L-1)/L * S/(g q);
      4. all-gather over the leaf rail; 5. all-gather in the island.
    ``inter_bytes`` (wire dtype of the cross-island phases) scales phases 2-4."""
    isl, leaf_r, spine_r = three_level_groups(fab, groups)
    g, q = isl.shape[1], leaf_r.shape[1]
    ib = nbytes if inter_bytes is None else inter_bytes
    phases = [
        ring_phase(fab, isl, nbytes, "reducescatter", "island reduce-scatter"),
        ring_phase(fab, leaf_r, ib / g, "reducescatter", "leaf-rail reduce-scatter"),
        ring_phase(fab, spine_r, ib / (g * q), "allreduce", "spine-rail all-reduce"),
        ring_phase(fab, leaf_r, ib / g, "allgather", "leaf-rail all-gather"),
        ring_phase(fab, isl, nbytes, "allgather", "island all-gather"),
    ]
    key = "hier3" if pipelined else "hier3-b2b"
    return CommCost(key, ALGORITHMS[key], [Stream("grad", 1.0, phases, pipelined)])


@dataclass(frozen=True)
class SelectiveSpec:
    """The `selective` mode's knobs (docs/reducer.md), as the cost model needs them."""

    top_fraction: float = 0.15
    last_n_share: float = 0.0
    """Share of gradient elements in the last N layers (+ always_sync tensors, + the drift-promotion
    budget once it is spent)."""
    sync_bytes: float = 4
    """Bytes per SYNC element on the wire across groups (``sync.dtype``)."""
    grad_bytes: float = 4
    """Bytes per SYNC element inside the group (the gradient dtype: the island phases stay exact)."""
    local_bytes: float = 2
    reconcile_bytes: float = 4
    """Bytes per element of the parameters averaged at reconciliation (fp32 master weights by default)."""
    moments_bytes: float = 0.0
    """Optimizer-moment bytes per LOCAL element and reconciliation, amortised: Adam's two moments
    averaged at every ``local.moments_interval``-th reconciliation on the ``local.moments_dtype`` wire
    are 2 x its bytes / that interval (8 / that interval in fp32)."""
    moments_interval: int = 1
    """``local.moments_interval``: the reconciliation that carries the moments (every this-th) carries
    ``reconcile_bytes + moments_interval * moments_bytes`` per element, the others ``reconcile_bytes``."""
    reconcile_interval: int = 4
    stream_fragments: int = 1
    """``local.stream_fragments``: the reconciliation's bytes in that many launches per interval
    (the same bytes, that many latencies)."""
    async_reconcile: bool = True
    pipelined: bool = False
    """The reducer runs the hierarchical phases of a bucket back-to-back."""

    @property
    def sync_fraction(self) -> float:
        return min(1.0, self.top_fraction + self.last_n_share)

    def validate(self) -> None:
        for what, v in (("top_fraction", self.top_fraction), ("last_n_share", self.last_n_share)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
                raise SimError(f"selective {what} = {v!r}; expected a number in [0, 1]")
        if not (isinstance(self.reconcile_interval, int) and self.reconcile_interval >= 1):
            raise SimError(f"selective reconcile_interval = {self.reconcile_interval!r}; expected an integer >= 1")
        if not (isinstance(self.stream_fragments, int) and 1 <= self.stream_fragments <= self.reconcile_interval):
            raise SimError(f"selective stream_fragments = {self.stream_fragments!r}; expected an integer in "
                           f"[1, reconcile_interval = {self.reconcile_interval}]")


def selective(fab: Fabric, groups: np.ndarray, elements: float, spec: SelectiveSpec,
              group_by: str = "island") -> CommCost:
    """Selective reduction of ``elements`` gradient elements per rank.

    Per step:
      1. SYNC stream (fraction f = top_fraction + last-N share): 2-level all-reduce of f * elements,
         in the gradient dtype inside the group and in the sync dtype across groups;
      2. LOCAL stream: ring all-reduce of (1 - f) * elements in the local dtype inside each intra group.
    Both streams go through the engine's one issuing queue; LOCAL buckets are held until the step's
    last SYNC bucket is submitted (the end of backward when top-fraction tensors are SYNC: they may sit
    anywhere in the model; else when the last N layers, the first in backward, are done).
    Every reconcile_interval (H) steps, charged 1/H per step (the latency F/H with F stream fragments):
      3. each rank all-reduces its 1/g slice of the LOCAL parameters over its rail
         (2(R-1)/R * (1-f) * elements * reconcile_bytes / g), then
      4. all-gathers them inside the group ((g-1)/g * (1-f) * elements * reconcile_bytes);
      the optimizer moments ride along at ``moments_bytes`` per element.
    """
    spec.validate()
    intra, rails = split_groups(fab, groups, group_by)
    g = intra.shape[1]
    f = spec.sync_fraction
    sync_b = f * elements * spec.sync_bytes
    local_b = (1.0 - f) * elements * spec.local_bytes
    rec_b = (1.0 - f) * elements * (spec.reconcile_bytes + spec.moments_bytes)
    streams = []
    if f > 0:
        streams.append(Stream("sync", f, _hier2_phases(fab, intra, rails, f * elements * spec.grad_bytes, sync_b,
                                                       "SYNC "), spec.pipelined))
    if f < 1:
        held = 1.0 if (spec.top_fraction > 0 or f == 0) else f
        streams.append(
            Stream("local", 1.0 - f, [ring_phase(fab, intra, local_b, "allreduce", "LOCAL intra all-reduce")], True,
                   held_until=held)
        )
    background: list[Phase] = []
    if f < 1:
        h = spec.reconcile_interval
        background = [
            ring_phase(fab, rails, rec_b / g, "allreduce", "reconcile rail all-reduce").scaled(1.0 / h),
            ring_phase(fab, intra, rec_b, "allgather", "reconcile intra all-gather").scaled(1.0 / h),
        ]
        for p in background:
            p.latency_s *= spec.stream_fragments / h
    return CommCost("selective", ALGORITHMS["selective"], streams, background,
                    background_blocking=not spec.async_reconcile,
                    launch_rate=spec.stream_fragments / spec.reconcile_interval,
                    launch_scales=_launch_scales(spec))


def _launch_scales(spec: SelectiveSpec) -> tuple[tuple[float, float], ...]:
    """A reconciliation's launches relative to the mean one: every ``moments_interval``-th carries
    the optimizer moments too."""
    m, rb, mb = spec.moments_interval, spec.reconcile_bytes, spec.moments_bytes
    if m <= 1 or mb <= 0:
        return ((1.0, 1.0),)
    mean = rb + mb
    return (((m - 1) / m, rb / mean), (1 / m, (rb + m * mb) / mean))
