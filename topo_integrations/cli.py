"""The ``topo-align`` command (docs/cli.md).

    topo-align show [SOURCE...] [--json] [--plot FILE.png]   (no SOURCE: this node, as `auto` reads it)
    topo-align capture DIR
    topo-align plan SOURCE... [--json] [--group-by island|leaf] [--min-tier-ratio R] [--middle-level]
    topo-align hostfile SOURCE... [--slots N] [-o FILE]
    topo-align schema
    topo-align doctor [SOURCE...] [--json] [--sysfs-root DIR]
    topo-align simulate|emulate|bench ...   (optional modules)

A SOURCE is KIND:PATH (docs/cli.md). Bad input anywhere: exit status 2 and one line on stderr
(``topo-align: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, NoReturn, Sequence

__all__ = ["main", "build_parser", "CORE_COMMANDS", "OPTIONAL_COMMANDS"]

CORE_COMMANDS = ("show", "plan", "hostfile", "schema", "doctor", "capture")
# Subcommands other parts provide: module exposing add_arguments(parser) and run(args) -> int.
OPTIONAL_COMMANDS = {
    "simulate": ("topo_integrations.sim.cli", "cost-model simulation of a topology (topo_integrations.sim)"),
    "emulate": ("topo_integrations.emulate.cli", "emulated multi-node cluster on one Linux host"),
    "bench": ("topo_integrations.bench.cli", "benchmark the reducer on an emulated cluster"),
}


class UsageError(ValueError):
    """Bad command-line use; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_source_opts(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("sources", nargs="+" if required else "*", metavar="SOURCE",
                   help="KIND:PATH with KIND in file, slurm, hostfile, nvidia-smi, nccl-xml, sysfs-ib, capture "
                        "(slurm: topology.conf[,NODELIST]; capture: DIR[,DIR...]); several combine")
    p.add_argument("--nodes", default=None, metavar="N|HOSTLIST",
                   help="replicate a single-node source (nvidia-smi, nccl-xml) over N hosts or a hostlist")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="ranks per host for slurm/hostfile sources without a node source (default 8 / slots)")


def _add_plan_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-by", choices=("island", "leaf"), default="island",
                   help="intra group: NVLink island (default) or all ranks under a leaf")
    p.add_argument("--min-tier-ratio", type=float, default=1.3, metavar="R",
                   help="tiers count as different when their bandwidths differ by at least R (default 1.3)")
    p.add_argument("--middle-level", action="store_true", help="plan the 3-level hierarchy (island, leaf, spine)")


def build_parser(load_optional: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; optional subcommands get their real arguments only when in ``load_optional``
    (importing them may be slow), else a placeholder that accepts anything."""
    parser = _Parser(prog="topo-align", description="Topology-aware gradient reduction: inspect, plan, check.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"topo-align {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("show", help="print a topology (table, --json, or --plot FILE.png); no SOURCE: this node")
    _add_source_opts(p, required=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--plot", metavar="FILE.png", default=None, help="draw hosts, islands and leaves, coloured by intra group"
    )
    _add_plan_opts(p)

    p = sub.add_parser("plan", help="plan intra/inter groups and the rank order")
    _add_source_opts(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (the whole plan)")
    _add_plan_opts(p)

    p = sub.add_parser("hostfile", help="write the recommended rank order as a DeepSpeed hostfile")
    _add_source_opts(p)
    p.add_argument("--slots", type=int, default=None, metavar="N", help="slots per host (default: the host's ranks)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write here instead of stdout")

    sub.add_parser("schema", help="print the JSON Schema of the \"topo_align\" config block")

    p = sub.add_parser("capture", help="write this node's facts (sysfs, nvidia-smi/rocm-smi, Slurm) into DIR "
                                       "for a bug report or a replay (TOPO_ALIGN_SYSROOT=DIR)")
    p.add_argument("dir", metavar="DIR", help="a new (or empty) directory")

    p = sub.add_parser("doctor", help="check NCCL/UCX settings, IB ports and whether the tiers differ enough")
    _add_source_opts(p, required=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--sysfs-root", default=None, metavar="DIR", help="InfiniBand sysfs root (default /sys/class/infiniband)"
    )
    p.add_argument(
        "--min-tier-ratio",
        type=float,
        default=1.3,
        metavar="R",
        help="tier ratio that counts as different (default 1.3)",
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="validate a topo_align config (the block, or a DeepSpeed config holding it)")
    p.add_argument("--probe", action="store_true",
                   help="run a probe job (torchrun on this host, or --probe-emulate) timing every group's links")
    p.add_argument("--probe-nproc", type=int, default=2, metavar="N", help="ranks of the local probe job (default 2)")
    p.add_argument("--probe-emulate", default=None, metavar="TOPO.json",
                   help="run the probe job on the emulated cluster of this topology file (root)")

    for name, (module, help_text) in OPTIONAL_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_optional=name)
        if name in load_optional:
            mod = _import_optional(name)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


class _NotBuilt(Exception):
    pass


def _import_optional(name: str) -> Any:
    module = OPTIONAL_COMMANDS[name][0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise _NotBuilt(f"topo-align {name}: not built yet") from None
        raise _NotBuilt(f"topo-align {name}: cannot load {module} (missing module {exc.name!r})") from None
    except ImportError as exc:
        raise _NotBuilt(f"topo-align {name}: cannot load {module} ({exc})") from None


# -- commands ------------------------------------------------------------------------------------

def _load(args: argparse.Namespace):
    from .topology.sources import load_sources

    if not args.sources:  # `show` alone: this node, read as `auto` reads it (TOPO_ALIGN_SYSROOT replays one)
        from .topology.capture import topology_of_nodes
        from .topology.machine import Machine

        if args.nodes is not None:
            raise UsageError("--nodes replicates a SOURCE; give one (or none to show this node)")
        return topology_of_nodes([Machine.from_env()], gpus_per_node=args.gpus_per_node, name="this node",
                                 source="auto")
    opts: dict[str, Any] = {}
    if args.nodes is not None:
        opts["nodes"] = args.nodes
    if args.gpus_per_node is not None:
        opts["gpus_per_node"] = args.gpus_per_node
    return load_sources(args.sources, **opts)


def _check_ratio(r: float) -> None:
    if not (r == r and 1.0 <= r <= 1e6):
        raise UsageError(f"--min-tier-ratio {r!r}; expected a number in [1, 1000000]")


def _plan(args: argparse.Namespace, topo):
    from .topology.planner import plan_groups

    _check_ratio(args.min_tier_ratio)
    return plan_groups(topo, group_by=args.group_by, min_tier_ratio=args.min_tier_ratio, middle_level=args.middle_level)


def _shape(groups) -> dict:
    sizes = sorted({len(g) for g in groups})
    return {"count": len(groups), "sizes": sizes}


def plan_shape(plan) -> dict:
    """Counts and sizes of each group kind, e.g. ``{"intra_groups": {"count": 120, "sizes": [8]}}``."""
    return {
        k: _shape(getattr(plan, k))
        for k in ("intra_groups", "inter_groups", "leaf_groups", "leaf_rails", "spine_rails")
    }


def _console():
    from rich.console import Console

    return Console(soft_wrap=False, width=max(100, int(os.environ.get("COLUMNS", "0") or 0)))


def _cmd_show(args: argparse.Namespace) -> int:
    from .topology.hostlist import compress_hostlist
    from .topology.planner import PlanError

    topo = _load(args)
    try:
        plan, plan_note = _plan(args, topo), None
    except PlanError as exc:  # unequal islands: still show the topology, coloured by island
        plan, plan_note = None, str(exc)
    if args.plot:
        from .plot import plot_topology

        plot_topology(topo, plan, args.plot)
    summary = topo.summary()
    leaves = []
    for lname, ranks in topo.leaves.items():
        hosts = list(dict.fromkeys(topo.ranks[r].host for r in ranks))
        leaves.append({"leaf": lname, "pod": topo.ranks[ranks[0]].pod, "hosts": compress_hostlist(hosts),
                       "n_hosts": len(hosts), "ranks": len(ranks)})
    if args.json:
        from .topology.report import host_rows

        print(json.dumps({"topology": summary, "leaves": leaves, "hosts": host_rows(topo)[:1000], "plot": args.plot,
                          "plan_error": plan_note}, indent=2, sort_keys=True))
        return 0
    from rich.table import Table

    from .topology.report import format_topology

    con = _console()
    print(format_topology(topo), flush=True)  # plain text: one line per host, never wrapped
    lt = Table(title="leaves")
    for col in ("leaf", "pod", "hosts", "n hosts", "ranks"):
        lt.add_column(col)
    for row in leaves[:64]:
        lt.add_row(row["leaf"], row["pod"], row["hosts"], str(row["n_hosts"]), str(row["ranks"]))
    con.print(lt)
    if len(leaves) > 64:
        con.print(f"... and {len(leaves) - 64} more leaves (use --json)")
    if plan_note:
        con.print(f"cannot plan: {plan_note}")
    if args.plot:
        con.print(f"plot written to {args.plot}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    topo = _load(args)
    plan = _plan(args, topo)
    shape = plan_shape(plan)
    if args.json:
        print(json.dumps({"topology": topo.summary(), "shape": shape, "plan": plan.to_json()}, sort_keys=True))
        return 0
    from rich.table import Table

    con = _console()
    con.print(f"[bold]{topo.name}[/bold]: {'hierarchical' if plan.hierarchical else 'flat'} -- {plan.reason}")
    t = Table()
    for col in ("groups", "count", "size", "example"):
        t.add_column(col)
    for k, v in shape.items():
        groups = getattr(plan, k)
        ex = ",".join(map(str, groups[0][:8])) + (",..." if groups and len(groups[0]) > 8 else "") if groups else ""
        t.add_row(k, str(v["count"]), "/".join(map(str, v["sizes"])), ex)
    con.print(t)
    con.print(
        f"middle level: {'on' if plan.middle_level else 'off'}; tier ratio {plan.tier_ratio:.2f}x "
        f"({plan.intra_tier} {plan.intra_bandwidth_gbps:g} GB/s vs "
        f"{plan.inter_tier} {plan.inter_bandwidth_gbps:g} GB/s)"
    )
    for note in plan.notes:
        con.print(f"note: {note}")
    return 0


def _cmd_hostfile(args: argparse.Namespace) -> int:
    from .topology.hostfile import format_hostfile
    from .topology.planner import recommended_host_order

    if args.slots is not None and not 1 <= args.slots <= 4096:
        raise UsageError(f"--slots {args.slots}; expected an integer in [1, 4096]")
    topo = _load(args)
    order, _ = recommended_host_order(topo)
    counts = {h: len(r) for h, r in topo.hosts.items()}
    text = format_hostfile([(h, args.slots or counts[h]) for h in order])
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_capture(args: argparse.Namespace) -> int:
    from .topology.capture import capture_node
    from .topology.machine import Machine

    facts = capture_node(args.dir, Machine.from_env())
    print(f"captured {facts.host}: {facts.device_count} GPU(s) ({facts.islands_from}), {len(facts.nics)} NIC port(s) "
          f"-> {args.dir} (replay: TOPO_ALIGN_SYSROOT={args.dir} or `topo-align show capture:{args.dir}`)")
    for m in facts.missing:
        print(f"not found: {m}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from .config import TopoAlignConfig

    print(json.dumps(TopoAlignConfig.model_json_schema(), indent=2, sort_keys=True))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import run_doctor
    from .topology.sysfs_ib import DEFAULT_SYSFS_ROOT

    _check_ratio(args.min_tier_ratio)
    topo = _load(args) if args.sources else None
    root = args.sysfs_root or DEFAULT_SYSFS_ROOT
    if args.sysfs_root and not os.path.isdir(args.sysfs_root):
        raise UsageError(f"--sysfs-root {args.sysfs_root!r}: not a directory")
    findings, ports = run_doctor(os.environ, sysfs_root=root, topo=topo, min_tier_ratio=args.min_tier_ratio)
    if args.config:  # a bad block is bad input: ConfigError -> exit 2, one line
        from .config import TopoAlignConfig
        from .doctor import Finding

        cfg = TopoAlignConfig.from_file(args.config)
        findings.append(Finding("ok", "config", f"{args.config}: valid topo_align block (mode {cfg.mode!r})"))
    if args.probe or args.probe_emulate:  # diagnostics.py: group-to-group latency and bandwidth
        from .diagnostics import check_gpu_links, run_probe_job
        from .doctor import Finding

        findings += check_gpu_links()
        res = run_probe_job(nproc=args.probe_nproc, emulate_topology=args.probe_emulate)
        findings += [Finding(**f) for f in res["findings"]]
    errors = sum(f.level == "error" for f in findings)
    if args.json:
        print(json.dumps({"findings": [f.to_json() for f in findings], "ib_ports": [p.to_json() for p in ports],
                          "errors": errors}, indent=2, sort_keys=True))
    else:
        from rich.table import Table

        t = Table(title="topo-align doctor")
        for col in ("level", "what", "detail", "fix"):
            t.add_column(col, overflow="fold")
        style = {"error": "red", "warn": "yellow", "ok": "green", "info": ""}
        for f in findings:
            t.add_row(f"[{style[f.level]}]{f.level}[/]" if style[f.level] else f.level, f.what, f.detail, f.fix)
        _console().print(t)
    return 1 if errors else 0


_COMMANDS = {
    "show": _cmd_show,
    "plan": _cmd_plan,
    "hostfile": _cmd_hostfile,
    "schema": _cmd_schema,
    "doctor": _cmd_doctor,
    "capture": _cmd_capture,
}


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split()) or "failed"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = [a for a in argv if not a.startswith("-")][:1]
    try:
        try:
            parser = build_parser(load_optional=[w for w in wanted if w in OPTIONAL_COMMANDS])
        except _NotBuilt as exc:
            print(_one_line(str(exc)), file=sys.stderr)
            return 2
        args = parser.parse_args(argv)
        if getattr(args, "_optional", None):
            mod = getattr(args, "_module", None)
            if mod is None:  # only when the command name was not the first plain argument
                mod = _import_optional(args._optional)
            return int(mod.run(args) or 0)
        return _COMMANDS[args.command](args)
    except _NotBuilt as exc:
        print(_one_line(str(exc)), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if isinstance(exc.code, int) else 0
    except (ValueError, OSError, RecursionError) as exc:
        print(f"topo-align: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("topo-align: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
