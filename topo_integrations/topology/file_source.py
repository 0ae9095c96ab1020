"""The JSON topology file (``file:`` source). Format: docs/topology-format.md.

    {
      "format": "topo-align/topology/v1",
      "name": "dgx-a100-superpod",
      "gpu": "A100",
      "gpus_per_node": 8,
      "island_size": null,
      "tiers": {"island": {"bandwidth_gbps": 230, "latency_us": 2},
                "leaf":   {"bandwidth_gbps": 24,  "latency_us": 7},
                "spine":  {"bandwidth_gbps": 24,  "latency_us": 10, "oversubscription": 2.0}},
      "leaves": [{"name": "su1", "pod": "pod0", "hosts": "dgx[001-020]"}, ...],
      "islands": [{"name": "rack1", "hosts": "nvl[01-18]"}]
    }

Ranks are numbered leaf by leaf, host by host, GPU by GPU, in the order written. A host may carry
its own GPU count (``"hosts": [{"host": "a", "gpus": 4}, "b"]``).
"""

from __future__ import annotations

import math
import os
from typing import Any

from ..config import ConfigError, load_json_file
from .hostlist import expand_hostlist
from .model import DEFAULT_TIERS, TIER_NAMES, RankPlace, Tier, Topology, TopologyError

__all__ = ["FORMAT", "load_topology_file", "topology_from_dict", "topology_to_dict", "MAX_RANKS"]

FORMAT = "topo-align/topology/v1"
MAX_RANKS = 1_048_576
_TOP_KEYS = {"format", "name", "gpus_per_node", "island_size", "tiers", "leaves", "islands", "description", "gpu"}
_TIER_KEYS = {"bandwidth_gbps", "latency_us", "oversubscription"}
_LEAF_KEYS = {"name", "pod", "hosts"}


def _where(src: str, path: str) -> str:
    return f"{src}: {path}" if path else src


def _int(v: Any, path: str, src: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
        raise TopologyError(f"{_where(src, path)} = {v!r}; expected an integer in [{lo}, {hi}]")
    return v


def _num(v: Any, path: str, src: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not (lo <= v <= hi):
        raise TopologyError(f"{_where(src, path)} = {v!r}; expected a number in [{lo}, {hi}]")
    return float(v)


def _str(v: Any, path: str, src: str) -> str:
    if not isinstance(v, str) or not v.strip() or len(v) > 256:
        raise TopologyError(f"{_where(src, path)} = {v!r}; expected a non-empty name (at most 256 characters)")
    return v


def _unknown(d: dict, allowed: set[str], path: str, src: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise TopologyError(f"{_where(src, path)}: unknown key {extra[0]!r}; accepted: {sorted(allowed)}")


def _hosts(v: Any, path: str, src: str, default_gpus: int) -> list[tuple[str, int]]:
    if isinstance(v, str):
        return [(h, default_gpus) for h in expand_hostlist(v)]
    if not isinstance(v, list) or not v:
        raise TopologyError(f"{_where(src, path)} = {v!r}; expected a hostlist string or a non-empty list")
    out: list[tuple[str, int]] = []
    for i, item in enumerate(v):
        if isinstance(item, str):
            out.extend((h, default_gpus) for h in expand_hostlist(item))
        elif isinstance(item, dict):
            _unknown(item, {"host", "gpus"}, f"{path}[{i}]", src)
            host = _str(item.get("host"), f"{path}[{i}].host", src)
            gpus = _int(item.get("gpus", default_gpus), f"{path}[{i}].gpus", src, 1, 4096)
            out.append((host, gpus))
        else:
            raise TopologyError(f'{_where(src, f"{path}[{i}]")} = {item!r}; expected a host name or {{"host", "gpus"}}')
    return out


def topology_from_dict(data: Any, *, source: str = "file") -> Topology:
    """Validate a decoded topology document and build the `Topology`."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a JSON object, got {type(data).__name__}")
    _unknown(data, _TOP_KEYS, "", source)
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise TopologyError(f"{source}: format = {fmt!r}; expected {FORMAT!r}")
    name = _str(data.get("name", os.path.basename(source)), "name", source)
    gpn = _int(data.get("gpus_per_node", 8), "gpus_per_node", source, 1, 4096)
    isz = data.get("island_size")
    if isz is not None:
        isz = _int(isz, "island_size", source, 1, 4096)
    gpu = data.get("gpu")
    if gpu is not None:
        gpu = _str(gpu, "gpu", source)

    tiers = dict(DEFAULT_TIERS)
    raw_tiers = data.get("tiers", {})
    if not isinstance(raw_tiers, dict):
        raise TopologyError(f"{source}: tiers = {raw_tiers!r}; expected an object keyed by {list(TIER_NAMES)}")
    for tname, spec in raw_tiers.items():
        if tname not in TIER_NAMES:
            raise TopologyError(f"{source}: tiers: unknown tier {tname!r}; accepted: {list(TIER_NAMES)}")
        if not isinstance(spec, dict):
            raise TopologyError(f"{source}: tiers.{tname} = {spec!r}; expected an object")
        _unknown(spec, _TIER_KEYS, f"tiers.{tname}", source)
        base = DEFAULT_TIERS[tname]
        tiers[tname] = Tier(
            tname,
            _num(spec.get("bandwidth_gbps", base.bandwidth_gbps), f"tiers.{tname}.bandwidth_gbps", source, 1e-9, 1e9),
            _num(spec.get("latency_us", base.latency_us), f"tiers.{tname}.latency_us", source, 0.0, 1e9),
            _num(spec.get("oversubscription", 1.0), f"tiers.{tname}.oversubscription", source, 1.0, 1e6),
            origin="file" if "bandwidth_gbps" in spec else "default",
            detail=source,
        )

    leaves = data.get("leaves")
    if not isinstance(leaves, list) or not leaves:
        raise TopologyError(f"{source}: leaves = {leaves!r}; expected a non-empty list of {{\"name\", \"hosts\"}}")
    island_of: dict[str, str] = {}
    islands = data.get("islands", [])
    if not isinstance(islands, list):
        raise TopologyError(f"{source}: islands = {islands!r}; expected a list of {{\"name\", \"hosts\"}}")
    for i, spec in enumerate(islands):
        if not isinstance(spec, dict):
            raise TopologyError(f"{source}: islands[{i}] = {spec!r}; expected an object")
        _unknown(spec, {"name", "hosts"}, f"islands[{i}]", source)
        iname = _str(spec.get("name"), f"islands[{i}].name", source)
        for h, _ in _hosts(spec.get("hosts"), f"islands[{i}].hosts", source, gpn):
            if h in island_of:
                raise TopologyError(f"{source}: islands[{i}]: host {h!r} is already in island {island_of[h]!r}")
            island_of[h] = iname

    places: list[RankPlace] = []
    seen_hosts: dict[str, str] = {}
    leaf_names: set[str] = set()
    for li, leaf in enumerate(leaves):
        if not isinstance(leaf, dict):
            raise TopologyError(f"{source}: leaves[{li}] = {leaf!r}; expected an object")
        _unknown(leaf, _LEAF_KEYS, f"leaves[{li}]", source)
        lname = _str(leaf.get("name", f"leaf{li}"), f"leaves[{li}].name", source)
        if lname in leaf_names:
            raise TopologyError(f"{source}: leaves[{li}].name = {lname!r} is used twice")
        leaf_names.add(lname)
        pod = _str(leaf.get("pod", "pod0"), f"leaves[{li}].pod", source)
        for host, n in _hosts(leaf.get("hosts"), f"leaves[{li}].hosts", source, gpn):
            if host in seen_hosts:
                raise TopologyError(
                    f"{source}: host {host!r} is listed twice (leaves {seen_hosts[host]!r} and {lname!r})"
                )
            seen_hosts[host] = lname
            if len(places) + n > MAX_RANKS:
                raise TopologyError(f"{source}: more than {MAX_RANKS} ranks")
            for lr in range(n):
                if host in island_of:
                    island = island_of[host]
                elif isz:
                    island = f"{host}/i{lr // isz}"
                else:
                    island = host
                places.append(RankPlace(len(places), host, lr, island, lname, pod))
    unknown_island_hosts = sorted(set(island_of) - set(seen_hosts))
    if unknown_island_hosts:
        raise TopologyError(f"{source}: islands name host {unknown_island_hosts[0]!r} that no leaf lists")
    return Topology(tuple(places), tiers, name=name, source=source, gpu=gpu)


def load_topology_file(path: str | os.PathLike[str]) -> Topology:
    """Read a JSON topology file; every problem is a one-line :class:`TopologyError`."""
    try:
        data = load_json_file(path, what="topology file")
    except ConfigError as exc:
        raise TopologyError(str(exc)) from None
    return topology_from_dict(data, source=f"file:{path}")


def topology_to_dict(topo: Topology) -> dict:
    """Write a topology back in the file format (hosts explicit, islands per host or listed)."""
    leaves: list[dict] = []
    by_leaf: dict[str, list[str]] = {}
    leaf_pod: dict[str, str] = {}
    gpus: dict[str, int] = {}
    for p in topo.ranks:
        if p.host not in gpus:
            by_leaf.setdefault(p.leaf, []).append(p.host)
            leaf_pod[p.leaf] = p.pod
        gpus[p.host] = gpus.get(p.host, 0) + 1
    common = max(set(gpus.values()), key=list(gpus.values()).count)
    for lname, hosts in by_leaf.items():
        leaves.append({
            "name": lname,
            "pod": leaf_pod[lname],
            "hosts": [h if gpus[h] == common else {"host": h, "gpus": gpus[h]} for h in hosts],
        })
    multi = {}
    for iname, ranks in topo.islands.items():
        hs = list(dict.fromkeys(topo.ranks[r].host for r in ranks))
        if len(hs) > 1:
            multi[iname] = hs
    sizes = {len(r) for r in topo.islands.values()}
    out: dict[str, Any] = {
        "format": FORMAT,
        "name": topo.name,
        "gpus_per_node": common,
        "tiers": {k: v.to_json() for k, v in topo.tiers.items()},
        "leaves": leaves,
    }
    per_host_split = all(
        "/i" in topo.ranks[r[0]].island for r in topo.islands.values()
    ) and len(sizes) == 1
    if per_host_split:
        out["island_size"] = sizes.pop()
    if multi:
        out["islands"] = [{"name": k, "hosts": v} for k, v in multi.items()]
    if topo.gpu is not None:
        out["gpu"] = topo.gpu
    return out
