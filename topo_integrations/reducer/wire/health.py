"""Link probes between the reducer's groups (the measurement; judging it is diagnostics.py's job).

:func:`probe_groups` (inside a running job) times small all-reduces on every group kind of a
:class:`ReducerGroups` -- my intra group (fast tier) and my rail (slow tier) -- and gathers every
rank's numbers, so rank 0 can name the slow group, not only say that one is slow. The findings, the
start-of-run check and the probe job of ``topo-align doctor --probe`` are in
``topo_integrations/diagnostics.py``; the adaptive controller uses :func:`tier_gbps`.

Bus bandwidth: an all-reduce of S bytes over p ranks moves ``2(p-1)/p * S`` per rank on a ring, so
``busbw = 2(p-1)/p * S / t`` is comparable with a tier's per-GPU link bandwidth (as nccl-tests).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..plan.groups import ReducerGroups
from .collectives import run

__all__ = ["ProbeResult", "probe_groups", "tier_gbps", "start_check", "CHECK_KINDS"]

CHECK_KINDS = ("dp_group", "intra", "inter", "intra_low", "inter_low", "leaf_rail", "spine_rail",
               "leaf_rail_low", "spine_rail_low")
"""The communicators the start-of-run check touches, in this order on every rank."""

# kind -> which ReducerGroups attribute, which tier of the plan it runs on
_KINDS = (("intra", "intra_ranks"), ("inter", "inter_ranks"))


@dataclass
class ProbeResult:
    """Per DP position: the group members and the measured latency / bus bandwidth of each kind."""

    nbytes: int
    rows: list[dict]
    """One per DP position: ``{"rank", "intra": {"ranks", "latency_us", "busbw_gbps"}, "inter": ...}``."""

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "rows": self.rows}

    def groups(self, kind: str) -> list[dict]:
        """Distinct groups of ``kind`` with the slowest member's numbers (a group is as fast as its slowest)."""
        by: dict[tuple, dict] = {}
        for row in self.rows:
            g = row.get(kind)
            if not g or len(g["ranks"]) < 2:
                continue
            key = tuple(g["ranks"])
            cur = by.get(key)
            if cur is None or g["busbw_gbps"] < cur["busbw_gbps"]:
                by[key] = {"ranks": list(key), "latency_us": g["latency_us"], "busbw_gbps": g["busbw_gbps"]}
            else:
                cur["latency_us"] = max(cur["latency_us"], g["latency_us"])
        return list(by.values())


def start_check(groups: ReducerGroups) -> Callable[[], None]:
    """The start-of-run check every adapter runs (through its engine): one all-reduce of a single
    element on every communicator of the engine, on the communication device, in ``CHECK_KINDS``
    order. It fails fast (within ``fallback.timeout_s``, naming the tier, group and ranks) when a
    peer or a link is missing, catches a membership mismatch (the sum must equal the group size),
    and creates the communicators before the first step (NCCL and gloo connect lazily).

    Issues the all-reduces and returns the verification, which reads the sums on the host: call it
    only once they have arrived (the engine's ``call`` waits for that, bounded), never inside the
    issuing step (on NCCL ``.item()`` there would block the host on a dead peer, unbounded)."""
    dev = groups.device or torch.device("cpu")
    issued = []
    for kind in CHECK_KINDS:
        group = getattr(groups, kind, None)
        if group is None and kind != "dp_group":
            continue
        size = groups.dp_size if kind == "dp_group" else dist.get_world_size(group)
        if size < 2:
            continue
        t = torch.ones(1, device=dev)
        tier = "dp" if kind == "dp_group" else ("intra" if kind.startswith("intra") else "inter")
        run(f"all_reduce(start-of-run check, {kind})", tier, group if kind != "dp_group" else groups.dp_group,
            groups, 4, None, lambda t=t, g=(groups.dp_group if kind == "dp_group" else group):
            dist.all_reduce(t, group=g), like=t)
        issued.append((t, size, group))

    def verify() -> None:
        for t, size, group in issued:
            if int(t.item()) != size:
                raise RuntimeError(f"topo_align: start-of-run check on the {groups.describe(group)}: the all-reduce "
                                   f"counted {int(t.item())} members, expected {size} (ranks disagree on the groups)")

    return verify


def _time_all_reduce(t: torch.Tensor, group, groups: ReducerGroups, what: str, iters: int) -> float:
    """Median seconds of ``iters`` all-reduces of ``t`` (after one warm-up), error-wrapped, each
    timed to completion (on CUDA: after synchronising the stream that ran it)."""
    def once(label):
        run(label, "control", group, groups, 0, None, lambda: dist.all_reduce(t, group=group), like=t)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    once(f"all_reduce({what} warm-up)")
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once(f"all_reduce({what})")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_groups(groups: ReducerGroups, *, nbytes: int = 1 << 20, iters: int = 3, device=None) -> ProbeResult:
    """Latency and bus bandwidth of my intra group and my rail, gathered from every DP rank.

    Phases (every rank runs all, same order, so the groups' collectives match):
      1. intra group: all-reduce of 1 float (latency), then of ``nbytes`` (bandwidth), median of ``iters``;
      2. the same on my rail (the `inter` group), when the plan has one;
      3. all-gather over the DP group of every rank's 4 numbers.
    Cost: about ``2 * (iters + 1) * nbytes`` per rank on each tier.
    """
    device = device or torch.device("cpu")
    numel = max(1, nbytes // 4)
    mine = []
    for kind, _ in _KINDS:
        group = getattr(groups, kind)
        size = len(getattr(groups, f"{kind}_ranks"))
        if group is None or size < 2:
            mine += [0.0, 0.0]
            continue
        lat = _time_all_reduce(torch.zeros(1, device=device), group, groups, f"{kind} latency probe", iters)
        sec = _time_all_reduce(torch.zeros(numel, device=device), group, groups, f"{kind} bandwidth probe", iters)
        busbw = 2 * (size - 1) / size * numel * 4 / sec / 1e9 if sec > 0 else 0.0
        mine += [lat * 1e6, busbw]
    vec = torch.tensor(mine, dtype=torch.float64, device=device)
    allv = [torch.empty_like(vec) for _ in range(groups.dp_size)]
    run("all_gather(probe results)", "dp", groups.dp_group, groups, vec.numel() * 8, None,
         lambda: dist.all_gather(allv, vec, group=groups.dp_group))
    # all_gather orders by group rank = ascending global rank; the gathered members lists are global
    # ranks, recomputed here from the plan so every rank builds the same rows.
    by_rank = dict(zip(sorted(groups.dp_ranks), [v.cpu().tolist() for v in allv]))
    plan = groups.plan
    rows = []
    intra_of = {p: sorted(groups.dp_ranks[q] for q in g) for g in plan.intra_groups for p in g}
    for pos, rank in enumerate(groups.dp_ranks):
        v = by_rank[rank]
        intra = intra_of.get(pos, sorted(groups.dp_ranks)) if plan.hierarchical else sorted(groups.dp_ranks)
        row = {"rank": rank, "intra": {"ranks": intra, "latency_us": v[0], "busbw_gbps": v[1]}}
        if plan.hierarchical:
            i = intra.index(rank)
            rail = sorted(sorted(groups.dp_ranks[q] for q in g)[i] for g in plan.intra_groups)
            row["inter"] = {"ranks": rail, "latency_us": v[2], "busbw_gbps": v[3]}
        rows.append(row)
    return ProbeResult(nbytes=numel * 4, rows=rows)


def tier_gbps(result: ProbeResult) -> tuple[float | None, float | None]:
    """(intra, inter) bus bandwidth of the slowest group of each tier (None when the tier has no group
    of two or more): a hierarchical step waits for its slowest group, so that is what estimates use."""
    out = []
    for kind, _ in _KINDS:
        bws = [g["busbw_gbps"] for g in result.groups(kind) if g["busbw_gbps"] > 0]
        out.append(min(bws) if bws else None)
    return out[0], out[1]
