"""Run a command across an emulated cluster with the right rendezvous settings, and supervise it.

Two modes:

- ``per-rank``: one process per rank, in its node's namespace, with the torchrun-style environment
  ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK MASTER_ADDR MASTER_PORT``;
- ``torchrun``: one ``python -m torch.distributed.run --nnodes N --node-rank i --nproc-per-node g
  --master-addr A --master-port P COMMAND...`` per node (COMMAND is what torchrun accepts: a script
  and its arguments, or ``-m module ...``).

Both add ``GLOO_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = the node's
interface (``eth0``), ``TOPO_ALIGN_HOSTNAME`` = the node's name (also its UTS host name), and
``OMP_NUM_THREADS=1`` unless set. Ranks are numbered as in the topology; MASTER_ADDR is the address of
the node holding rank 0.

Supervision (phases): 1. start every process in its own session; 2. poll: the first process to exit
non-zero ends the run with its code and the others are killed (like torchrun); 3. past the timeout all
are killed and the exit code is 124; 4. an exception (KeyboardInterrupt, a signal turned into one by
the CLI) kills all before it propagates. Output lines are forwarded with a ``[host r<rank>]`` prefix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, TextIO

from ..topology.model import Topology
from .layout import NODE_IFACE, Layout, NodeSpec
from .procs import kill_groups

__all__ = ["Cluster", "RunResult", "rank_env", "node_env", "launch", "MODES", "TIMEOUT_EXIT"]

MODES = ("per-rank", "torchrun")
TIMEOUT_EXIT = 124


class Cluster(Protocol):
    """What a launch needs of its cluster: an ``EmulatedCluster`` (cluster.py, whose ``launch`` calls
    this module's, so this module names the interface instead of importing the class)."""

    topology: Topology
    layout: Layout

    @property
    def nodes(self) -> tuple[NodeSpec, ...]: ...

    def node(self, key: str | int) -> NodeSpec: ...

    def popen(self, node: str | int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen: ...

    def fork(self, node: str | int, zygote, module: str, args: Sequence[str], *,
             env: Mapping[str, str] | None = None): ...


@dataclass
class RunResult:
    exit_code: int
    elapsed_s: float
    reason: str
    """``ok`` | ``failed: <who> exited <code>`` | ``timeout after S s``."""
    codes: dict[str, int | None] = field(default_factory=dict)


def _common_env(cluster: Cluster, node_index: int, port: int, base: dict[str, str]) -> dict[str, str]:
    node = cluster.nodes[node_index]
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({
        "MASTER_ADDR": cluster.layout.master.address,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(cluster.topology.world_size),
        "NNODES": str(len(cluster.nodes)),
        "GROUP_RANK": str(node.index),
        "NODE_RANK": str(node.index),
        "LOCAL_WORLD_SIZE": str(len(node.ranks)),
        "GLOO_SOCKET_IFNAME": NODE_IFACE,
        "TP_SOCKET_IFNAME": NODE_IFACE,
        "NCCL_SOCKET_IFNAME": NODE_IFACE,
        "TOPO_ALIGN_HOSTNAME": node.host,
        "TOPO_ALIGN_EMULATE_NODE_ADDR": node.address,
    })
    return env


def node_env(cluster: Cluster, node_index: int, *, port: int = 29500,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a per-node process (torchrun mode)."""
    return _common_env(cluster, node_index, port, dict(os.environ if base is None else base))


def rank_env(
    cluster: Cluster, rank: int, *, port: int = 29500, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of rank ``rank`` (per-rank mode)."""
    place = cluster.topology.ranks[rank]
    node = cluster.node(place.host)
    env = _common_env(cluster, node.index, port, dict(os.environ if base is None else base))
    env.update({"RANK": str(rank), "LOCAL_RANK": str(place.local_rank)})
    return env


def _forward(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _module_of(command: Sequence[str]) -> tuple[str, list[str]]:
    """``(module, args)`` of ``python [-u] -m MODULE ARGS...``, what a zygote can run."""
    argv = list(command[1:])
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    if len(argv) < 2 or argv[0] != "-m":
        raise ValueError(f"a zygote runs `python [-u] -m MODULE ...` commands, not {' '.join(command)!r}")
    return argv[1], argv[2:]


def launch(cluster: Cluster, command: Sequence[str], *, mode: str = "per-rank", timeout: float | None = None,
           port: int = 29500, out: TextIO | None = None, prefix_output: bool = True, zygote=None) -> RunResult:
    """Run ``command`` on every rank (or node) of ``cluster``; see the module docstring. With
    ``zygote`` (per-rank mode, a ``python [-u] -m MODULE ...`` command), every rank is forked from it
    instead of started as a new interpreter (zygote.py says what that keeps and what it changes)."""
    if mode not in MODES:
        raise ValueError(f"mode = {mode!r}; accepted: {list(MODES)}")
    if not command:
        raise ValueError("command is empty; give the command to run after `--`")
    if zygote is not None and mode != "per-rank":
        raise ValueError(f"a zygote forks ranks (mode 'per-rank'), not {mode!r}")
    module = _module_of(command) if zygote is not None else None
    out = out or sys.stdout
    lock = threading.Lock()
    jobs: list[tuple[str, list[str], dict[str, str], str]] = []  # (label, argv, env, node host)
    if mode == "per-rank":
        for r, place in enumerate(cluster.topology.ranks):
            jobs.append((f"{place.host} r{r}", list(command), rank_env(cluster, r, port=port), place.host))
    else:
        for node in cluster.nodes:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
                    "--node-rank", str(node.index), "--nproc-per-node", str(len(node.ranks)),
                    "--master-addr", cluster.layout.master.address, "--master-port", str(port), *command]
            jobs.append((node.host, argv, node_env(cluster, node.index, port=port), node.host))

    procs: list[tuple[str, subprocess.Popen]] = []
    threads: list[threading.Thread] = []
    t0 = time.monotonic()
    result: RunResult | None = None
    try:
        for label, argv, env, host in jobs:
            if module is not None:
                p = cluster.fork(host, zygote, module[0], module[1], env=env)
            else:
                p = cluster.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", bufsize=1)
            procs.append((label, p))
            th = threading.Thread(target=_forward, args=(p.stdout, f"[{label}] " if prefix_output else "", out, lock),
                                  daemon=True)
            th.start()
            threads.append(th)
        while result is None:
            failed = [(label, p.returncode) for label, p in procs if p.poll() not in (None, 0)]
            if failed:
                label, code = failed[0]
                code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as shells report
                result = RunResult(code, time.monotonic() - t0, f"failed: {label} exited {code}")
            elif all(p.returncode == 0 for _, p in procs):
                result = RunResult(0, time.monotonic() - t0, "ok")
            elif timeout is not None and time.monotonic() - t0 > timeout:
                result = RunResult(TIMEOUT_EXIT, time.monotonic() - t0, f"timeout after {timeout:g} s")
            else:
                time.sleep(0.05)
    finally:
        kill_groups([p for _, p in procs], grace_s=2.0)
        for th in threads:
            th.join(timeout=2.0)
    result.codes = {label: p.returncode for label, p in procs}
    return result
