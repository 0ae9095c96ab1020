"""`topo-align emulate`: run a command on an emulated multi-node cluster (docs/emulation.md).

    topo-align emulate --topology configs/topologies/virtual-2x2.json [--timeout S] [--per-rank|--torchrun]
                       [--bytes-json OUT] [--mtu N] [--uplink-mbit R] [--port P] -- COMMAND...
    topo-align emulate --cleanup

Exit code: the command's (the first failing process's), 124 on timeout, 128+N when stopped by signal N
(Ctrl-C: 130), 2 on bad input or where namespaces cannot be made, 1 when building the network fails.
Every path removes the namespaces it made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from ..topology.file_source import load_topology_file
from ..topology.model import TopologyError
from .cluster import EmulatedCluster
from .netns import EmulationError, EmulationUnavailable, cleanup_leftovers, unavailable_reason
from .runner import MODES, launch
from .signals import Stopped, stop_signals_raise

__all__ = ["add_arguments", "run", "main"]

PROG = "topo-align emulate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", metavar="FILE", help="JSON topology file (docs/topology-format.md)")
    parser.add_argument("--timeout", type=float, metavar="S", help="kill the command after S seconds (exit 124)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--per-rank", dest="mode", action="store_const", const="per-rank",
                      help="one process per rank with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set (default)")
    mode.add_argument("--torchrun", dest="mode", action="store_const", const="torchrun",
                      help="one torchrun per node (COMMAND is a script and its arguments, or -m module)")
    parser.set_defaults(mode="per-rank")
    parser.add_argument("--bytes-json", metavar="OUT", help="write per-link byte counters of the run to OUT")
    parser.add_argument("--mtu", type=int, default=9000, help="MTU of every emulated link (default 9000)")
    parser.add_argument("--uplink-mbit", type=float, metavar="R",
                        help="set every node uplink to R Mbit/s instead of leaf bandwidth x ranks per node")
    parser.add_argument("--no-shape", action="store_true", help="no tc shaping (links at veth speed)")
    parser.add_argument("--port", type=int, default=29500, help="rendezvous port on the master node (default 29500)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces left by emulator runs that are no longer running, and exit")
    parser.add_argument("emulate_command", metavar="COMMAND", nargs=argparse.REMAINDER,
                        help="-- COMMAND... to run on every rank/node")


def _error(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout = {args.timeout!r}; expected a number of seconds > 0"
    if not (576 <= args.mtu <= 65535):
        return f"--mtu = {args.mtu!r}; expected an integer in [576, 65535]"
    if args.uplink_mbit is not None and not (math.isfinite(args.uplink_mbit) and 0.01 <= args.uplink_mbit <= 1e7):
        return f"--uplink-mbit = {args.uplink_mbit!r}; expected a number in [0.01, 1e7] (Mbit/s)"
    if not (1 <= args.port <= 65535):
        return f"--port = {args.port!r}; expected an integer in [1, 65535]"
    if args.mode not in MODES:
        return f"mode = {args.mode!r}; accepted: {list(MODES)}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run `topo-align emulate` with parsed ``args``; returns the exit code."""
    command = list(args.emulate_command or [])
    if command and command[0] == "--":
        command = command[1:]
    reason = unavailable_reason()
    if args.cleanup:
        if reason:
            _error(f"cannot clean up: {reason}")
            return 2
        rep = cleanup_leftovers()
        print(
            f"removed {len(rep.removed)} namespace(s)"
            + (f": {' '.join(rep.removed)}" if rep.removed else "")
            + (
                f"; left {len(rep.kept_live)} of running emulator(s): {' '.join(rep.kept_live)}"
                if rep.kept_live
                else ""
            )
        )
        return 0
    bad = _check_args(args)
    if bad:
        _error(bad)
        return 2
    if not args.topology:
        _error("--topology FILE is required (e.g. configs/topologies/virtual-2x2.json)")
        return 2
    if not command:
        _error("no command given; put it after `--`, e.g. -- python train.py")
        return 2
    if reason:
        _error(f"cannot emulate a cluster: {reason}")
        return 2
    try:
        topo = load_topology_file(args.topology)
    except TopologyError as exc:
        _error(str(exc))
        return 2

    t0 = time.monotonic()
    try:
        with stop_signals_raise():
            return _run_cluster(args, topo, command)
    except Stopped as stop:
        _error(f"stopped by signal {stop.signum} after {time.monotonic() - t0:.1f} s; emulated cluster removed")
        return 128 + stop.signum


def _run_cluster(args: argparse.Namespace, topo, command: list[str]) -> int:
    try:
        try:
            cluster = EmulatedCluster(topo, mtu=args.mtu, shape=not args.no_shape, uplink_mbit=args.uplink_mbit)
        except ValueError as exc:
            _error(str(exc))
            return 2
        with cluster:
            for note in cluster.notes:
                print(f"{PROG}: note: {note}", file=sys.stderr)
            before = cluster.counters()
            res = launch(cluster, command, mode=args.mode, timeout=args.timeout, port=args.port)
            delta = cluster.counters().minus(before)
            if args.bytes_json:
                _write_json(args.bytes_json, _report(args, topo.name, cluster, command, res, delta))
            tot = delta.to_json()["totals"]
            print(f"{PROG}: {topo.name}: {len(cluster.nodes)} nodes, {topo.world_size} ranks; {res.reason} "
                  f"(exit {res.exit_code}) in {res.elapsed_s:.1f} s; cross-node {tot['cross_node_bytes']} B, "
                  f"cross-leaf {tot['cross_leaf_bytes']} B, intra-node {tot['intra_node_bytes']} B", file=sys.stderr)
            return res.exit_code
    except EmulationUnavailable as exc:
        _error(str(exc))
        return 2
    except EmulationError as exc:
        _error(str(exc))
        return 1
    except OSError as exc:
        _error(f"cannot write --bytes-json: {exc}")
        return 1


def _report(args, name: str, cluster: EmulatedCluster, command: list[str], res, delta) -> dict[str, Any]:
    lay = cluster.layout
    return {
        "format": "topo-align/emulate-bytes/v1",
        "topology": name,
        "topology_file": args.topology,
        "mode": args.mode,
        "command": command,
        "exit_code": res.exit_code,
        "reason": res.reason,
        "elapsed_s": res.elapsed_s,
        "mtu": lay.mtu,
        "notes": cluster.notes,
        "nodes": [{"host": n.host, "ns": n.ns, "address": n.address, "leaf": n.leaf, "ranks": list(n.ranks),
                   "uplink_mbit": n.uplink.rate_mbit, "uplink_delay_ms": n.uplink.delay_ms} for n in lay.nodes],
        "spines": [{"leaf": s.leaf, "rate_mbit": s.shape.rate_mbit, "delay_ms": s.shape.delay_ms} for s in lay.spines],
        **delta.to_json(),
    }


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block, exit 2 (as `topo-align` does)
        _error(f"{message} (see `{PROG} --help`)")
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m topo_integrations.emulate``); `topo-align emulate` uses
    :func:`add_arguments` and :func:`run` instead."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
