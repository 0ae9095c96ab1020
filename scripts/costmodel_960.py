#!/usr/bin/env python
"""The 960 x A100 SuperPOD scenario of docs/costmodel.md, simulated with topo_integrations.sim.

    .venv/bin/python scripts/costmodel_960.py              # print the tables
    .venv/bin/python scripts/costmodel_960.py --write-doc  # also replace them in docs/costmodel.md

Everything here is simulated (alpha-beta model), not measured. Inputs: configs/topologies/
dgx-a100-superpod-960{,-2to1}.json; GPT-3 175B (96 layers), bf16 gradients, 1536 x 2048 tokens per
step at 40% MFU of 312 TFLOP/s; the default "topo_align" block (README.md, "Config reference") for selective.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from topo_integrations.config import resolve_sync  # noqa: E402
from topo_integrations.sim import ALGORITHMS, SimOptions, Workload, simulate  # noqa: E402
from topo_integrations.topology import load_topology_file  # noqa: E402

BEGIN, END = "<!-- costmodel_960:begin -->", "<!-- costmodel_960:end -->"
DOC = os.path.join(ROOT, "docs", "costmodel.md")
KEYS = ["ring", "tree", "nccl", "hier2", "hier2-b2b", "hier3", "hier3-b2b", "selective", "localsgd"]
FABRICS = [("1:1", "leaf"), ("1:1", "scattered"), ("2:1", "leaf"), ("2:1", "scattered")]
LAYOUTS = [("pure DP (TP1 x PP1 x DP960)", 1, 1), ("TP8 x PP8 x DP15", 8, 8)]
# The design's first estimate (made before this model; NCCL latencies 6/14 us, pipelined times),
# shown beside this model's figures in docs/costmodel.md 2.3.
RESEARCH = {
    ("pure", "1:1", "leaf"): {
        "ring": 3.655,
        "tree": 3.930,
        "hier2": 3.619,
        "hier2-b2b": 6.282,
        "hier3": 3.616,
        "hier3-b2b": 6.279,
    },
    ("pure", "2:1", "scattered"): {
        "ring": 6.134,
        "tree": 6.077,
        "hier2": 6.080,
        "hier2-b2b": 6.282,
        "hier3": 3.616,
        "hier3-b2b": 6.431,
    },
    ("3d", "1:1", "leaf"): {"ring": 0.426},
}


def _buckets(res) -> str:
    """The bucket sizes this layout ran with (``auto``: the plugin's algorithms at its group count)."""
    note = next((n for n in res.notes if n.startswith("buckets auto at ")), None)
    if note is None:
        return "25 MiB buckets"
    n, mb = note[len("buckets auto at "):].split(" groups: ")[0], note.split(": ")[1].split(" MiB")[0]
    return f"25 MiB buckets (`auto` for hierarchical back-to-back and selective at {n} groups: {mb} MiB)"


def topologies():
    base = os.path.join(ROOT, "configs", "topologies")
    return {"1:1": load_topology_file(os.path.join(base, "dgx-a100-superpod-960.json")),
            "2:1": load_topology_file(os.path.join(base, "dgx-a100-superpod-960-2to1.json"))}


def workload(tp: int, pp: int) -> Workload:
    return Workload(175e9, "bf16", tp=tp, pp=pp, mfu=0.40, peak_tflops=312.0, tokens_per_step=1536 * 2048,
                    num_layers=96)


def run_all():
    topos = topologies()
    out = {}
    for lname, tp, pp in LAYOUTS:
        for over, order in FABRICS:
            for overlap in (True, False):
                out[(lname, over, order, overlap)] = simulate(
                    topos[over], workload(tp, pp), SimOptions(algorithms=tuple(KEYS), rank_order=order, overlap=overlap)
                )
    return out


def _cell(res, key, fmt):
    try:
        return fmt(res.row(key))
    except KeyError:
        return "n/a"


def tables(results) -> str:
    parts = []
    cols = " | ".join(f"{o} spine, {r} order" for o, r in FABRICS)
    sep = "|---|" + "---:|" * len(FABRICS)
    for lname, _, _ in LAYOUTS:
        any_res = results[(lname, "1:1", "leaf", True)]
        w = any_res.workload
        parts.append(f"#### {lname}: {w['grad_bytes_per_gpu'] / 1e9:.3g} GB of bf16 gradient per GPU, "
                     f"compute {any_res.compute_s:.2f} s/step (backward {any_res.backward_s:.2f} s)\n")
        parts.append("One all-reduce of the whole gradient per step (no buckets, no overlap), seconds; "
                     "in brackets the bottleneck tier:\n")
        parts.append(f"| algorithm | {cols} |\n{sep}")
        labels = dict(ALGORITHMS)
        for k in KEYS:
            cells = [
                _cell(results[(lname, o, r, True)], k, lambda x: f"{x.comm_s:.3f} ({x.bottleneck})") for o, r in FABRICS
            ]
            parts.append(f"| {labels.get(k, k)} | " + " | ".join(cells) + " |")
        parts.append("")
        for overlap in (True, False):
            what = (f"{_buckets(any_res)} launched during backward (overlap on)" if overlap
                    else f"{_buckets(any_res)} launched after backward (overlap off)")
            parts.append(
                f"Step time, {what}: seconds (speed-up vs flat ring / vs NCCL tuner / vs 2-level NCCL-style):\n"
            )
            parts.append(f"| algorithm | {cols} |\n{sep}")
            for k in KEYS:
                cells = []
                for o, r in FABRICS:
                    res = results[(lname, o, r, overlap)]
                    try:
                        nccl = res.row("nccl").step_s
                    except KeyError:
                        nccl = float("nan")
                    cells.append(_cell(res, k, lambda x: f"{x.step_s:.2f} ({x.speedup_vs_ring:.2f}x / "
                                                         f"{nccl / x.step_s:.2f}x / {x.speedup_vs_hier2:.2f}x)"))
                parts.append(f"| {labels.get(k, k)} | " + " | ".join(cells) + " |")
            parts.append("")
        notes = sorted({n for (ln, *_), res in results.items() if ln == lname for n in res.notes})
        for n in notes:
            parts.append(f"- note: {n}")
        parts.append("")
    # Traffic
    parts.append("#### Traffic per GPU per step (pure DP, 1:1 spine), GB; change vs flat ring\n")
    parts.append(
        "| algorithm | NVLink | NIC (leaf + spine) | NIC vs ring | spine only (leaf order) | spine only (scattered) |\n"
        "|---|---:|---:|---:|---:|---:|"
    )
    lname = LAYOUTS[0][0]
    lead, scat = results[(lname, "1:1", "leaf", True)], results[(lname, "1:1", "scattered", True)]
    ring = lead.row("ring").tier_bytes_per_gpu
    ring_nic = ring["leaf"] + ring["spine"]
    for k in KEYS:
        if k == "nccl":
            continue
        b, bs = lead.row(k).tier_bytes_per_gpu, scat.row(k).tier_bytes_per_gpu
        nic = b["leaf"] + b["spine"]
        parts.append(f"| {lead.row(k).label} | {b['island'] / 1e9:.1f} | {nic / 1e9:.2f} | {nic / ring_nic - 1:+.0%} | "
                     f"{b['spine'] / 1e9:.3f} | {bs['spine'] / 1e9:.2f} |")
    parts.append("")
    # Against the first estimate
    parts.append(
        "#### Against the design's first estimate (one all-reduce, pipelined where it applies), seconds\n"
    )
    parts.append("| case | algorithm | first estimate | this model | difference |\n|---|---|---:|---:|---:|")
    for (lay, over, order), vals in RESEARCH.items():
        lname = LAYOUTS[0][0] if lay == "pure" else LAYOUTS[1][0]
        res = results[(lname, over, order, True)]
        for k, v in vals.items():
            mine = res.row(k).comm_s
            parts.append(
                f"| {lname}, {over}, {order} | {res.row(k).label} | {v:.3f} | {mine:.3f} | {mine / v - 1:+.1%} |"
            )
    parts.append("")
    return "\n".join(parts)


def verdicts(results) -> str:
    """The numbers the doc's verdict quotes, computed rather than typed."""
    lines = []
    best = {}
    for (lname, over, order, overlap), res in results.items():
        for k in ("hier2-b2b", "hier3", "hier3-b2b", "selective", "localsgd"):
            try:
                r = res.row(k)
            except KeyError:
                continue
            nccl = res.row("nccl").step_s
            best.setdefault(k, []).append((nccl / r.step_s, r.speedup_vs_ring, lname, over, order, overlap))
    for k, v in best.items():
        top = max(x[0] for x in v)
        worst = min(x[0] for x in v)
        lines.append(f"- step speed-up of `{k}` vs the NCCL tuner over the {len(v)} cases where it applies: "
                     f"best {top:.2f}x, worst {worst:.2f}x")
    lead = results[(LAYOUTS[0][0], "1:1", "leaf", True)]
    ring, tree, h2, sel = (lead.row(k) for k in ("ring", "tree", "hier2", "selective"))
    lines.append(
        f"- one whole-gradient all-reduce, pure DP, 1:1, leaf order: selective {sel.comm_s:.2f} s vs flat ring "
        f"{ring.comm_s:.2f} s ({ring.comm_s / sel.comm_s:.2f}x), tree {tree.comm_s:.2f} s "
        f"({tree.comm_s / sel.comm_s:.2f}x), 2-level {h2.comm_s:.2f} s ({h2.comm_s / sel.comm_s:.2f}x)"
    )
    lines.append("- latency of one all-reduce (paid per bucket), pure DP, 1:1: " + ", ".join(
        f"{k} {lead.row(k).latency_s * 1e3:.2f} ms" for k in ("ring", "tree", "hier2", "hier3")))
    td = results[(LAYOUTS[1][0], "1:1", "leaf", False)]
    lines.append(f"- TP8 x PP8 x DP15, 1:1, leaf order, overlap off: DP gradient sync is "
                 f"{td.row('ring').exposed_s / td.row('ring').step_s:.1%} of the step (flat ring); selective "
                 f"{td.row('selective').comm_s:.3f} s vs ring {td.row('ring').comm_s:.3f} s per step")
    ls = lead.row("localsgd").tier_bytes_per_gpu
    rn = lead.row("ring").tier_bytes_per_gpu
    sn = lead.row("selective").tier_bytes_per_gpu
    lines.append(f"- selective vs post-local SGD (H = {SimOptions().localsgd_period}), bytes through the NICs per GPU "
                 f"(pure DP, 1:1, leaf order): {(sn['leaf'] + sn['spine']) / (ls['leaf'] + ls['spine']) - 1:+.0%}")
    lines.append(f"- selective vs flat ring, bytes through the NICs per GPU (pure DP, 1:1, leaf order): "
                 f"{(sn['leaf'] + sn['spine']) / (rn['leaf'] + rn['spine']) - 1:+.0%}; all bytes on all tiers: "
                 f"{sum(sn.values()) / sum(rn.values()) - 1:+.0%}")
    return "\n".join(lines)


def sensitivity() -> str:
    """Selective's NIC bytes vs the flat ring as its knobs change (pure DP, 1:1, leaf order)."""
    topo = topologies()["1:1"]
    wl = workload(1, 1)
    ring = simulate(topo, wl, SimOptions(algorithms=("ring",))).row("ring").tier_bytes_per_gpu
    ring_nic = ring["leaf"] + ring["spine"]
    # The knobs at a fixed top fraction: `auto`'s value below 4 islands (from 4 on `auto` makes every
    # tensor SYNC on the int8 wire: the last row).
    d = SimOptions()
    few = resolve_sync("auto", "auto", 1)[1]
    rows = ["| SYNC dtype | reconcile dtype | promotion | H = 1 | H = 2 | H = 4 | H = 8 | H = 16 |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for sd, rd, pf, tf in (("fp32", "fp32", 0.0, few), ("bf16", "bf16", 0.0, few),
                           ("bf16", "int8", d.promote_fraction, few), ("int8", "int8", d.promote_fraction, few),
                           ("int8", "int8", 0.0, few), ("auto", "int8", d.promote_fraction, "auto")):
        cells = []
        for h in (1, 2, 4, 8, 16):
            o = SimOptions(algorithms=("selective",), sync_dtype=sd, reconcile_dtype=rd, promote_fraction=pf,
                           reconcile_interval=h, top_fraction=tf)
            r = simulate(topo, wl, o).row("selective").tier_bytes_per_gpu
            cells.append(f"{(r['leaf'] + r['spine']) / ring_nic - 1:+.0%}")
        label = "auto (int8, every tensor)" if sd == "auto" else sd
        rows.append(f"| {label} | {rd} | {pf:g} | " + " | ".join(cells) + " |")
    base = few + min(1.0, d.last_n_layers / 96)
    return ("\n#### Selective: NIC bytes per step vs flat ring as the knobs change (pure DP, 1:1, leaf order; "
            f"SYNC share {few:.0%} + last {d.last_n_layers} of 96 layers = {base:.1%}, plus the "
            f"drift-promotion budget where given; Adam's moments every {d.moments_interval}th reconciliation "
            f"in {d.moments_dtype}; the last row is the default at these 120 islands, `sync.dtype` and "
            f"`sync.top_fraction` `auto`: every tensor SYNC on the int8 wire, nothing to reconcile)\n\n"
            + "\n".join(rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--write-doc", action="store_true", help=f"replace the text between the markers in {DOC}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run_all()
    took = time.perf_counter() - t0
    body = (f"Generated by `.venv/bin/python scripts/costmodel_960.py --write-doc` (simulated; 32 scenarios in "
            f"{took:.1f} s on the 2-core CPU build machine, no GPU).\n\n" + tables(results) + sensitivity()
            + "\n#### Computed verdict numbers\n\n"
            + verdicts(results) + "\n")
    print(body)
    if args.write_doc:
        with open(DOC, encoding="utf-8") as fh:
            text = fh.read()
        if BEGIN not in text or END not in text:
            print(f"{DOC}: markers {BEGIN} / {END} not found", file=sys.stderr)
            return 2
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(DOC, "w", encoding="utf-8") as fh:
            fh.write(head + BEGIN + "\n" + body + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
