"""The discovered topology as plain-text tables (``topo-align show`` and the start-of-run log).

    host    ranks  GPUs                     islands      NICs
    nodeA   2      2 x NVIDIA A100 (nvml)   [0,1]        2 x 200 Gb/s infiniband
    tier    GB/s per GPU  origin    detail
    island  80            nvlink    slowest host nodeA: 4 NVLink(s) x 25 GB/s x 0.8
"""

from __future__ import annotations

from collections import Counter

from .model import Topology

__all__ = ["host_rows", "tier_rows", "format_topology", "MAX_TABLE_HOSTS"]

MAX_TABLE_HOSTS = 64


def _nics(facts) -> str:
    up = Counter((n.rate_gbit, n.kind) for n in facts.nics if n.up)
    down = sum(1 for n in facts.nics if not n.up)
    text = ", ".join(f"{c} x {r:g} Gb/s {k}" for (r, k), c in sorted(up.items(), reverse=True)) or "none up"
    return text + (f" (+{down} down)" if down else "")


def host_rows(topo: Topology) -> list[dict]:
    """One row per host: ranks, GPUs, islands (of this job's ranks), NICs; facts where known."""
    facts = {f.host: f for f in topo.nodes}
    rows = []
    for host, ranks in topo.hosts.items():
        isl = list(dict.fromkeys(topo.ranks[r].island for r in ranks))
        islands = " ".join("[" + ",".join(str(topo.ranks[r].local_rank) for r in topo.islands[i]) + "]" for i in isl)
        f = facts.get(host)
        if f is None:
            gpus, nics = "-", "-"
        elif f.device_count:
            gpus = f"{f.device_count} x {f.device} ({f.islands_from})"
            nics = _nics(f)
        else:
            gpus, nics = "none (no fast tier)", _nics(f)
        rows.append({"host": host, "ranks": len(ranks), "gpus": gpus, "islands": islands, "nics": nics,
                     "leaf": topo.ranks[ranks[0]].leaf})
    return rows


def tier_rows(topo: Topology) -> list[dict]:
    present = topo.tiers_present()
    return [{"tier": n, "gbps": t.bandwidth_gbps, "effective_gbps": t.effective_gbps, "origin": t.origin,
             "detail": t.detail, "present": n in present} for n, t in topo.tiers.items()]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_topology(topo: Topology) -> str:
    """Hosts (at most MAX_TABLE_HOSTS rows), then the tiers in use with bandwidth and origin, then the
    warnings about missing facts."""
    hosts = host_rows(topo)
    lines = [f"{topo.name}: {topo.world_size} ranks on {len(hosts)} hosts ({topo.source})"]
    lines += _table([["host", "ranks", "GPUs", "islands", "NICs", "leaf"]]
                    + [[h["host"], str(h["ranks"]), h["gpus"], h["islands"], h["nics"], h["leaf"]]
                       for h in hosts[:MAX_TABLE_HOSTS]])
    if len(hosts) > MAX_TABLE_HOSTS:
        lines.append(f"... and {len(hosts) - MAX_TABLE_HOSTS} more hosts")
    tiers = [t for t in tier_rows(topo) if t["present"]]
    if tiers:
        lines += _table([["tier", "GB/s per GPU", "origin", "detail"]]
                        + [[t["tier"], f"{t['effective_gbps']:.4g}", t["origin"], t["detail"]] for t in tiers])
    else:
        lines.append("one rank: no tier in use")
    lines += [f"warning: {w}" for w in topo.warnings]
    return "\n".join(lines)
