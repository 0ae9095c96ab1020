#!/usr/bin/env python
"""Compare the cost model's predicted communication time with times measured on the emulated cluster.

    # 1. turn the per-rank JSON lines of scripts/emulate_allreduce.py into one preset entry
    .venv/bin/python scripts/calibrate_costmodel.py collect --name virtual-2x2 \\
        --topology configs/topologies/virtual-2x2.json --lines run-2x2.jsonl --out measured.json \\
        [--append] [--tiers '{"leaf": {"latency_us": 15}}']
    #    --append: add the run to the preset's repeats (median and spread); --tiers: store a tier override
    #    (what the emulator really gives, e.g. no netem: no link latency) with the preset
    # 2. compare (prints a markdown table; --write-doc puts it into docs/costmodel.md)
    .venv/bin/python scripts/calibrate_costmodel.py compare measured.json [--write-doc] [--tolerance 0.25]

Measured-results JSON (``topo-align/calibration/v1``; documented in docs/costmodel.md, "Calibration")::

    {"format": "topo-align/calibration/v1",
     "machine": "2-core CPU, emulated cluster (netns + tc), gloo",
     "presets": [
       {"name": "virtual-2x2",
        "topology": "configs/topologies/virtual-2x2.json",   # relative to the repository root, or absolute
        "bytes": 4000000,                                      # bytes all-reduced per rank per step
        "rank_order": "file",                                  # optional (default file: as the emulator numbers ranks)
        "tiers": {"island": {"bandwidth_gbps": 2.6, "latency_us": 20}},   # optional: what the emulator really
                                                               # gives a tier (loopback is not shaped)
        "measured": {                                          # seconds per step, one number or a list of repeats
          "ring": [0.41, 0.43, 0.40],                          # aliases: flat -> ring
          "hier2-b2b": 0.12                                    # aliases: hierarchical -> hier2-b2b
        },
        "node_tx_bytes": {"ring": 6000000, "hier2-b2b": 2000000}   # optional: bytes the busiest node sent per step
       }]}

Predicted = one all-reduce of ``bytes`` per rank over all ranks of the topology (pure data parallel),
``CommCost.comm_s()`` of topo_integrations.sim. The comparison passes when every
|predicted - measured| / measured <= tolerance (exit 0; else 1; bad input 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from topo_integrations.config import ConfigError, load_json_file  # noqa: E402
from topo_integrations.sim import SimError, Workload, dp_groups  # noqa: E402
from topo_integrations.sim.algorithms import ALGORITHMS  # noqa: E402
from topo_integrations.sim.model import Fabric, apply_rank_order  # noqa: E402
from topo_integrations.sim.scenario import SimOptions, _cost  # noqa: E402
from topo_integrations.topology import TopologyError, load_topology_file  # noqa: E402

FORMAT = "topo-align/calibration/v1"
ALIASES = {"flat": "ring", "hierarchical": "hier2-b2b"}
BEGIN, END = "<!-- calibration:begin -->", "<!-- calibration:end -->"
DOC = os.path.join(ROOT, "docs", "costmodel.md")


class CalibrationError(ValueError):
    pass


def _seconds(v, where: str) -> tuple[float, float]:
    """(median, spread = max - min) of a number or a list of numbers."""
    vals = v if isinstance(v, list) else [v]
    if not vals or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                           for x in vals):
        raise CalibrationError(f"{where} = {v!r}; expected a positive number of seconds or a non-empty list of them")
    return float(statistics.median(vals)), float(max(vals) - min(vals))


def predict(topo_path: str, nbytes: float, algorithm: str, rank_order: str = "file",
            tiers: dict | None = None) -> tuple[float, float]:
    """(seconds, bytes sent by the busiest host) of one all-reduce of ``nbytes`` per rank."""
    topo = load_topology_file(topo_path)
    if tiers:
        if not isinstance(tiers, dict):
            raise CalibrationError(f"tiers = {tiers!r}; expected {{tier: {{bandwidth_gbps, latency_us}}}}")
        from topo_integrations.topology import topology_from_dict, topology_to_dict

        d = topology_to_dict(topo)
        for name, spec in tiers.items():
            if name not in d["tiers"] or not isinstance(spec, dict):
                raise CalibrationError(f"tiers.{name} = {spec!r}; expected a tier of {list(d['tiers'])} with numbers")
            d["tiers"][name] = {**d["tiers"][name], **spec}
        topo = topology_from_dict(d, source=topo.source)
    topo = apply_rank_order(topo, rank_order)
    fab = Fabric.from_topology(topo)
    groups = dp_groups(topo.world_size, 1, 1)
    wl = Workload(params=nbytes / 4, grad_dtype="fp32", compute_s=0.0)
    cost = _cost(algorithm, fab, groups, wl, SimOptions(), None)
    phases = cost.all_phases()
    busiest = float(sum(p.load_nic for p in phases).max(initial=0.0)) if phases else 0.0
    return cost.comm_s(), busiest


def compare(data, *, tolerance: float) -> tuple[str, bool]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(
            "measured results: format = "
            f"{data.get('format') if isinstance(data, dict) else data!r}; expected {FORMAT!r}"
        )
    presets = data.get("presets")
    if not isinstance(presets, list) or not presets:
        raise CalibrationError("measured results: presets must be a non-empty list")
    lines = [
        f"Machine: {data.get('machine', 'unknown')}. Tolerance {tolerance:.0%}. Predicted = simulated (alpha-beta).\n",
        "| preset | algorithm | bytes/rank | measured s (spread) | predicted s | error | within | "
        "node tx measured | node tx predicted |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    ok = True
    for i, p in enumerate(presets):
        where = f"presets[{i}]"
        if not isinstance(p, dict):
            raise CalibrationError(f"{where}: expected an object")
        name = p.get("name", f"preset{i}")
        topo = p.get("topology")
        if not isinstance(topo, str):
            raise CalibrationError(f"{where}.topology = {topo!r}; expected a path to a topology file")
        if not os.path.isabs(topo):
            topo = os.path.join(ROOT, topo)
        nbytes = p.get("bytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes > 0:
            raise CalibrationError(f"{where}.bytes = {nbytes!r}; expected a positive number")
        measured = p.get("measured")
        if not isinstance(measured, dict) or not measured:
            raise CalibrationError(f"{where}.measured = {measured!r}; expected {{algorithm: seconds}}")
        tx = p.get("node_tx_bytes", {}) or {}
        for alg, val in measured.items():
            key = ALIASES.get(alg, alg)
            if key not in ALGORITHMS or key in ("nccl", "selective"):
                raise CalibrationError(f"{where}.measured: algorithm {alg!r}; expected one of "
                                       f"{[a for a in ALGORITHMS if a not in ('nccl', 'selective')] + list(ALIASES)}")
            med, spread = _seconds(val, f"{where}.measured.{alg}")
            pred, pred_tx = predict(topo, float(nbytes), key, p.get("rank_order", "file"), p.get("tiers"))
            err = (pred - med) / med
            good = abs(err) <= tolerance
            ok &= good
            mtx = tx.get(alg, tx.get(key))
            lines.append(
                f"| {name} | {ALGORITHMS[key]} | {nbytes:.4g} | {med:.4g} ({spread:.2g}) | {pred:.4g} | "
                f"{err:+.1%} | {'yes' if good else 'NO'} | {'-' if mtx is None else f'{mtx:.4g}'} | {pred_tx:.4g} |"
            )
    return "\n".join(lines) + "\n", ok


def collect(args) -> int:
    """Build one preset from scripts/emulate_allreduce.py output (one JSON line per rank)."""
    phases: dict[str, list[float]] = {}
    tx: dict[str, int] = {}
    numel = iters = None
    with open(args.lines, encoding="utf-8") as fh:
        for ln in fh:
            ln = ln.strip()
            start = ln.find('{"rank"')
            if start < 0:
                continue
            rec = json.loads(ln[start:])
            numel, iters = rec["numel"], rec["iters"]
            for ph, v in rec["phases"].items():
                phases.setdefault(ph, []).append(v["seconds"] / iters)
                tx[ph] = max(tx.get(ph, 0), int(v.get("node_tx_bytes", 0) / iters))
    if numel is None:
        raise CalibrationError(f"{args.lines}: no per-rank JSON lines of scripts/emulate_allreduce.py found")
    preset = {"name": args.name, "topology": args.topology, "bytes": numel * 4,
              # the step ends when the slowest rank finishes
              "measured": {ph: max(v) for ph, v in phases.items()}, "node_tx_bytes": tx}
    if args.tiers:
        preset["tiers"] = json.loads(args.tiers)
    data = {"format": FORMAT, "machine": args.machine, "presets": []}
    if os.path.exists(args.out):
        data = load_json_file(args.out, what="measured results")
    old = [p for p in data["presets"] if p.get("name") == args.name]
    if args.append and old:
        # another run of the same preset: keep every run as a repeat (median and spread in the table)
        if old[0].get("bytes") != preset["bytes"]:
            raise CalibrationError(f"{args.lines}: bytes = {preset['bytes']}, but preset {args.name!r} in "
                                   f"{args.out} has {old[0].get('bytes')}; append runs of the same size only")
        for ph, v in preset["measured"].items():
            prev = old[0]["measured"].get(ph, [])
            preset["measured"][ph] = (prev if isinstance(prev, list) else [prev]) + [v]
            preset["node_tx_bytes"][ph] = max(tx[ph], old[0].get("node_tx_bytes", {}).get(ph, 0))
        preset.setdefault("tiers", old[0].get("tiers"))
        if preset["tiers"] is None:
            del preset["tiers"]
    data["presets"] = [p for p in data["presets"] if p.get("name") != args.name] + [preset]
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    print(json.dumps(preset))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="cost model vs emulated cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("measured")
    c.add_argument("--tolerance", type=float, default=0.25)
    c.add_argument("--write-doc", action="store_true")
    k = sub.add_parser("collect")
    k.add_argument("--name", required=True)
    k.add_argument("--topology", required=True)
    k.add_argument("--lines", required=True, help="stdout of the emulated run (one JSON line per rank)")
    k.add_argument("--out", required=True)
    k.add_argument("--machine", default="2-core CPU, emulated cluster (netns + tc), gloo")
    k.add_argument("--append", action="store_true",
                   help="add this run to the preset's repeats instead of replacing the preset")
    k.add_argument("--tiers", help='JSON tier override stored with the preset, e.g. \'{"leaf": {"latency_us": 15}}\'')
    args = ap.parse_args(argv)
    try:
        if args.cmd == "collect":
            return collect(args)
        data = load_json_file(args.measured, what="measured results")
        table, ok = compare(data, tolerance=args.tolerance)
    except (CalibrationError, ConfigError, SimError, TopologyError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"calibrate_costmodel: {exc}", file=sys.stderr)
        return 2
    print(table)
    if args.write_doc:
        with open(DOC, encoding="utf-8") as fh:
            text = fh.read()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        cmd = f"`.venv/bin/python scripts/calibrate_costmodel.py compare {args.measured} --write-doc`"
        with open(DOC, "w", encoding="utf-8") as fh:
            fh.write(head + BEGIN + f"\nGenerated by {cmd}.\n\n" + table + END + tail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
