"""Slurm ``topology.conf`` (``topology/tree``, and ``topology/block`` blocks) + a job's node list.

    SwitchName=su1 Nodes=dgx[001-020] LinkSpeed=200
    SwitchName=spine Switches=su[1-6]

Leaves are the switches with ``Nodes=`` (or ``BlockName=`` blocks); a leaf's pod is the switch that
lists it in ``Switches=`` (``pod0`` when none does). On a rail-optimised SuperPOD the usual practice
is one logical leaf per scalable unit (docs/topology-format.md, ``slurm``); that is what the leaves
then mean.
Keys are case-insensitive as in Slurm; ``LinkSpeed`` is accepted and ignored (Slurm ignores it too).

The node list (``SLURM_JOB_NODELIST`` syntax, e.g. ``dgx[001-020,045]``) gives the job's hosts in
rank order; without one, every node of the file is used in file order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .hostlist import expand_hostlist
from .layout import HostSpec, read_source_text
from .model import TopologyError

__all__ = ["SlurmTree", "parse_topology_conf", "slurm_hosts", "load_slurm_hosts"]

_KEYS = {"switchname", "nodes", "switches", "linkspeed", "blockname", "blocksizes"}
_PAIR = re.compile(r"^([A-Za-z]+)=(\S*)$")


@dataclass(frozen=True)
class SlurmTree:
    leaf_of: dict[str, str]
    """host -> leaf switch (or block)"""
    pod_of_leaf: dict[str, str]
    hosts: tuple[str, ...]
    """Every host of the file, in file order."""


def parse_topology_conf(text: str, *, source: str = "topology.conf") -> SlurmTree:
    if not isinstance(text, str):
        raise TopologyError(f"{source}: expected text, got {type(text).__name__}")
    leaf_of: dict[str, str] = {}
    hosts: list[str] = []
    children: dict[str, list[str]] = {}
    switch_line: dict[str, int] = {}
    leaves: list[str] = []
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kv: dict[str, str] = {}
        for tok in line.split():
            m = _PAIR.match(tok)
            if not m or m.group(1).lower() not in _KEYS:
                raise TopologyError(
                    f"{source}: line {i}: {tok!r}; accepted: SwitchName=, Nodes=, Switches=, LinkSpeed= "
                    "(topology/tree) or BlockName=, Nodes=, BlockSizes= (topology/block)"
                )
            key = m.group(1).lower()
            if key in kv:
                raise TopologyError(f"{source}: line {i}: {m.group(1)}= given twice")
            if not m.group(2):
                raise TopologyError(f"{source}: line {i}: {m.group(1)}= has no value")
            kv[key] = m.group(2)
        if "blocksizes" in kv and len(kv) == 1:
            continue
        name = kv.get("switchname") or kv.get("blockname")
        if not name or ("switchname" in kv and "blockname" in kv):
            raise TopologyError(f"{source}: line {i}: expected exactly one SwitchName= or BlockName= per line")
        if name in switch_line:
            raise TopologyError(f"{source}: line {i}: switch {name!r} already defined on line {switch_line[name]}")
        switch_line[name] = i
        if "nodes" in kv and "switches" in kv:
            raise TopologyError(
                f"{source}: line {i}: switch {name!r} has both Nodes= and Switches=; a switch has one or the other"
            )
        if "nodes" in kv:
            try:
                names = expand_hostlist(kv["nodes"])
            except TopologyError as exc:
                raise TopologyError(f"{source}: line {i}: Nodes=: {exc}") from None
            for h in names:
                if h in leaf_of:
                    raise TopologyError(
                        f"{source}: line {i}: node {h!r} is already under switch {leaf_of[h]!r}; "
                        "topology/tree is a strict tree"
                    )
                leaf_of[h] = name
                hosts.append(h)
            leaves.append(name)
        elif "switches" in kv:
            if "blockname" in kv:
                raise TopologyError(f"{source}: line {i}: BlockName= takes Nodes=, not Switches=")
            try:
                children[name] = expand_hostlist(kv["switches"])
            except TopologyError as exc:
                raise TopologyError(f"{source}: line {i}: Switches=: {exc}") from None
        else:
            raise TopologyError(f"{source}: line {i}: switch {name!r} has neither Nodes= nor Switches=")
    if not leaves:
        raise TopologyError(f"{source}: no switch with Nodes=; expected lines like 'SwitchName=s1 Nodes=dgx[001-020]'")
    parent: dict[str, str] = {}
    for up, kids in children.items():
        for k in kids:
            if k not in switch_line:
                raise TopologyError(f"{source}: line {switch_line[up]}: Switches= names {k!r}, which no line defines")
            if k in parent:
                raise TopologyError(f"{source}: line {switch_line[up]}: switch {k!r} is already under {parent[k]!r}")
            parent[k] = up
    pod_of_leaf = {leaf: parent.get(leaf, "pod0") for leaf in leaves}
    return SlurmTree(leaf_of, pod_of_leaf, tuple(hosts))


def slurm_hosts(tree: SlurmTree, nodelist: str | None, *, source: str, gpus: int | None = None) -> list[HostSpec]:
    """The job's hosts in node-list order (all of the file's when ``nodelist`` is None)."""
    if nodelist is None or not nodelist.strip():
        names = list(tree.hosts)
    else:
        try:
            names = expand_hostlist(nodelist)
        except TopologyError as exc:
            raise TopologyError(f"{source}: node list: {exc}") from None
    out = []
    for h in names:
        leaf = tree.leaf_of.get(h)
        if leaf is None:
            raise TopologyError(f"{source}: node {h!r} of the node list is under no switch of the topology.conf")
        out.append(HostSpec(h, gpus, leaf, tree.pod_of_leaf[leaf]))
    return out


def load_slurm_hosts(spec: str, *, gpus: int | None = None) -> list[HostSpec]:
    """``topology.conf[,NODELIST]`` -> hosts; the node list is everything after the first comma."""
    path, _, nodelist = spec.partition(",")
    where = f"slurm:{path}"
    tree = parse_topology_conf(read_source_text(path, where=where), source=where)
    return slurm_hosts(tree, nodelist or None, source=where, gpus=gpus)
