"""``topo-align capture DIR``: write this node's facts as a tree `Machine` can replay, and
``capture:DIR[,DIR...]``: the topology of captured nodes (one host per directory).

The tree (module docstring of `machine`) holds exactly what discovery reads -- sysfs files, the
outputs of the commands, the host name, the Slurm variables and topology.conf -- plus ``facts.json``,
what the node reported when it was captured (for a human reading a bug report; replay re-reads the
tree). Point ``TOPO_ALIGN_SYSROOT`` at it to make discovery see that node.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Sequence

from .discovered import topology_from_facts
from .facts import IB_ROOT, NET_ROOT, NodeFacts, collect_node_facts
from .machine import ENV_KEYS, Machine, command_file
from .model import Topology, TopologyError
from .node_gpus import NVIDIA_NAMES, NVIDIA_TOPO, ROCM_TOPO

__all__ = ["capture_node", "load_captures", "topology_of_nodes", "CAPTURED_COMMANDS"]

CAPTURED_COMMANDS = (NVIDIA_TOPO, NVIDIA_NAMES, ROCM_TOPO)
_IB_FILES = ("rate", "state", "phys_state", "link_layer")


def _write(dest: str, rel: str, text: str) -> None:
    path = os.path.join(dest, rel.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")


def _copy(machine: Machine, dest: str, path: str) -> None:
    try:
        text = machine.read(path, missing_ok=True)
    except TopologyError:  # e.g. the speed of a link that is down (EINVAL): not a fact
        return
    if text is not None:
        _write(dest, path, text)


def capture_node(dest: str, machine: Machine | None = None) -> NodeFacts:
    """Write the node ``machine`` reads (live by default) under ``dest``; returns its facts."""
    machine = machine or Machine(None)
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise TopologyError(f"capture: {dest!r} exists and is not an empty directory; give a new directory")
    facts = collect_node_facts(machine)  # first: a node whose facts are malformed is reported now
    os.makedirs(dest, exist_ok=True)
    _write(dest, "/etc/hostname", facts.host)
    for dev in machine.listdir(IB_ROOT):
        for port in machine.listdir(f"{IB_ROOT}/{dev}/ports"):
            for name in _IB_FILES:
                _copy(machine, dest, f"{IB_ROOT}/{dev}/ports/{port}/{name}")
    for iface in machine.listdir(NET_ROOT):
        base = f"{NET_ROOT}/{iface}"
        if machine.exists(f"{base}/device"):
            _write(dest, f"{base}/device", "captured: the interface is a physical device")
            _copy(machine, dest, f"{base}/operstate")
            _copy(machine, dest, f"{base}/speed")
    env = {k: machine.env(k) for k in ENV_KEYS if machine.env(k)}
    _write(dest, "/env.json", json.dumps(env, indent=2, sort_keys=True))
    if env.get("SLURM_JOB_ID"):
        conf = f"{os.path.dirname(env.get('SLURM_CONF') or '/etc/slurm/slurm.conf')}/topology.conf"
        if machine.exists(conf):
            _write(dest, "/etc/slurm/topology.conf", machine.read(conf) or "")
            if env.get("SLURM_CONF"):
                env["SLURM_CONF"] = "/etc/slurm/slurm.conf"
                _write(dest, "/env.json", json.dumps(env, indent=2, sort_keys=True))
    for argv in CAPTURED_COMMANDS:
        try:
            out = machine.command(argv)
        except TopologyError as exc:
            _write(dest, f"/commands/{command_file(argv)}.failed", str(exc))
            continue
        if out is not None:
            _write(dest, f"/commands/{command_file(argv)}.txt", out)
    _write(dest, "/facts.json", json.dumps(facts.to_json(), indent=2, sort_keys=True))
    return facts


def topology_of_nodes(machines: Sequence[Machine], *, gpus_per_node: int | None = None,
                      name: str = "captured", source: str = "capture") -> Topology:
    """The topology of the nodes ``machines`` read (one host each, in rank order); each host runs one
    rank per GPU (``gpus_per_node`` overrides; a node without GPUs runs one rank)."""
    facts: list[NodeFacts] = []
    seen: dict[str, str] = {}
    for m in machines:
        f = collect_node_facts(m)
        where = m.describe()
        if f.host in seen:
            raise TopologyError(f"{source}: host {f.host!r} appears twice ({seen[f.host]} and {where})")
        seen[f.host] = where
        n = gpus_per_node or f.device_count or 1
        if f.device_count and n > f.device_count:
            raise TopologyError(f"{source}: {n} ranks per node but host {f.host!r} ({where}) has {f.device_count} GPUs")
        facts += [replace(f, local_rank=lr) for lr in range(n)]
    return topology_from_facts(facts, name=name, source=source)


def load_captures(dirs: Sequence[str], *, gpus_per_node: int | None = None, name: str | None = None) -> Topology:
    """``capture:DIR[,DIR...]``: captured nodes, one host per directory (see `topology_of_nodes`)."""
    if not dirs:
        raise TopologyError("capture: no directory given; expected capture:DIR[,DIR...]")
    return topology_of_nodes([Machine(d) for d in dirs], gpus_per_node=gpus_per_node, name=name or "captured",
                             source="capture:" + ",".join(dirs))
