#!/usr/bin/env python
"""Where hierarchical, selective and the peers each win, and what `method: auto` chooses: islands x
inter-island link speed (issues 31 and 38).

    .venv/bin/python scripts/costmodel_regions.py                          # print the tables
    .venv/bin/python scripts/costmodel_regions.py --markdown regions.md    # also write them to a file
    .venv/bin/python scripts/costmodel_regions.py --write-doc              # replace them in docs/costmodel.md

Everything here is simulated (the alpha-beta model of topo_integrations.sim, docs/costmodel.md), not
measured, and prices communication and its overlap with backward only, not model quality.

Fabric: N islands of 8 GPUs, each a DGX A100 node of configs/topologies/dgx-a100-superpod-960.json
(NVLink 230 GB/s per GPU, 2 us); islands under leaves of up to 20 nodes (the SuperPOD's scalable
units), 1:1 spine; the leaf and spine tiers run at the swept link speed per GPU (Gbit/s / 8 = GB/s),
with the file's latencies (7 / 10 us). Workload: docs/costmodel.md section 2's pure-DP GPT-3 175B
(`costmodel_960.workload(1, 1)`: 96 layers, bf16 gradients, 1536 x 2048 tokens per step at 40% MFU
of 312 TFLOP/s), the global batch fixed, so compute per step shrinks as islands are added.
Algorithms, with this release's `"topo_align"` defaults (config schema): `hier2-b2b` (the plugin's
`hierarchical`, cross-island phase in `communication.inter_dtype`), `selective`, and the peers
(sim/peers.py): post-local SGD (`localsgd`, its fp32 parameter average every 4 steps, blocking),
DiLoCo (`diloco`) at H = 16, 64 and 256, PowerSGD (`powersgd`) at rank 1 and 4. `method: auto`'s
choice per cell: sim/choose.py's `choose_for_groups` with the cell's figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from costmodel_960 import workload  # noqa: E402  (section 2's GPT-3 175B: the same workload by construction)

from topo_integrations.config import (  # noqa: E402
    BUCKET_MB_MIN,
    BUCKET_MB_PER_GROUP,
    MANY_GROUPS,
    TopoAlignConfig,
    resolve_bucket_mb,
    resolve_sync,
)
from topo_integrations.sim import SimError, SimOptions, simulate  # noqa: E402
from topo_integrations.sim.choose import MethodChoice, MethodInputs, choose_for_groups, local_options  # noqa: E402
from topo_integrations.sim.model import DTYPE_BYTES  # noqa: E402
from topo_integrations.sim.scenario import options_from_block  # noqa: E402
from topo_integrations.topology import plan_groups, topology_from_dict  # noqa: E402

BEGIN, END = "<!-- costmodel_regions:begin -->", "<!-- costmodel_regions:end -->"
DOC = os.path.join(ROOT, "docs", "costmodel.md")
SUPERPOD = os.path.join(ROOT, "configs", "topologies", "dgx-a100-superpod-960.json")
ISLANDS = (2, 4, 8, 16, 32, 64, 128)
GBITS = (1, 10, 25, 100, 200, 400)
NODES_PER_LEAF = 20  # a SuperPOD scalable unit
COLUMNS: dict[str, tuple[str, dict]] = {
    "hier2-b2b": ("hier2-b2b", {}),
    "selective": ("selective", {}),
    "localsgd": ("localsgd", {}),
    "diloco-h16": ("diloco", {"diloco_period": 16}),
    "diloco-h64": ("diloco", {"diloco_period": 64}),
    "diloco-h256": ("diloco", {"diloco_period": 256}),
    "powersgd-r1": ("powersgd", {"powersgd_rank": 1}),
    "powersgd-r4": ("powersgd", {"powersgd_rank": 4}),
}
"""Column of the map -> (simulator algorithm, its options); in tie order: the exact algorithm first."""
KEYS = tuple(COLUMNS)
NAMES = {"hier2-b2b": "hierarchical", "selective": "selective", "localsgd": "post-local SGD",
         "diloco-h16": "DiLoCo H=16", "diloco-h64": "DiLoCo H=64", "diloco-h256": "DiLoCo H=256",
         "powersgd-r1": "PowerSGD r=1", "powersgd-r4": "PowerSGD r=4"}
SHORT = {"hier2-b2b": "H", "selective": "S", "localsgd": "L", "diloco-h16": "D16", "diloco-h64": "D64",
         "diloco-h256": "D256", "powersgd-r1": "P1", "powersgd-r4": "P4"}
AUTO_SHORT = {"hierarchical": "hier.", "int8": "int8", "local": "local"}
TIE = 0.01
"""Step times within 1% of the fastest count as a tie (the model is not that precise: docs/costmodel.md 3-4)."""
COMMAND = ".venv/bin/python scripts/costmodel_regions.py"


@dataclass(frozen=True)
class Cell:
    islands: int
    gbit: float
    compute_s: float
    step_s: dict[str, float]
    slow_bytes: dict[str, float]
    """Bytes per GPU and step on every tier but the island (NVLink): what leaves the island."""
    sync_fraction: float
    """Selective's SYNC share as the model prices it (last-N layers and promotion budget included)."""
    auto: MethodChoice | None = None
    """`method: auto`'s choice here (sim/choose.py ``choose_for_groups``), None when not asked for."""
    auto_step_s: float = math.nan
    """The choice's step priced on this cell's fabric (algorithm `selective` with the keys it sets)."""

    @property
    def winners(self) -> list[str]:
        """The fastest algorithm and every one within TIE of it, exact algorithm first."""
        best = min(self.step_s.values())
        return [k for k in KEYS if self.step_s[k] <= best * (1.0 + TIE)]

    @property
    def runner_up(self) -> str | None:
        rest = [k for k in KEYS if k not in self.winners]
        return min(rest, key=lambda k: self.step_s[k]) if rest else None

    @property
    def auto_agrees(self) -> bool:
        """The choice's step is within TIE of the fastest column's."""
        return self.auto_step_s <= min(self.step_s.values()) * (1.0 + TIE)


def options(inter_dtype: str | None = None, localsgd_period: int = 4, bucket_mb: float | None = None) -> SimOptions:
    """This release's defaults (the config schema's `"topo_align"` block)."""
    opt = options_from_block(TopoAlignConfig(), SimOptions())
    kw = {"algorithms": ("hier2-b2b",), "localsgd_period": localsgd_period}
    if inter_dtype is not None:
        kw["inter_dtype"] = inter_dtype
    if bucket_mb is not None:
        kw["bucket_mb"] = bucket_mb
    return replace(opt, **kw)


def passes() -> list[tuple[tuple[str, ...], dict]]:
    """The columns in as few `simulate` calls as their options allow: ((algorithms), options) each."""
    out: list[tuple[list[str], dict]] = []
    for algo, over in COLUMNS.values():
        for algos, kw in out:
            if algo not in algos and all(kw.get(k, v) == v for k, v in over.items()):
                algos.append(algo)
                kw.update(over)
                break
        else:
            out.append(([algo], dict(over)))
    return [(tuple(a), kw) for a, kw in out]


def _buckets_text(opt: SimOptions) -> str:
    if opt.bucket_mb != "auto":
        return f"{opt.bucket_mb:g} MiB buckets launched during backward"
    return ("Buckets launched during backward, `communication.bucket_size_mb` `auto` for hierarchical and "
            f"selective ({BUCKET_MB_MIN:g} MiB up to {int(BUCKET_MB_MIN // BUCKET_MB_PER_GROUP)} islands, then "
            f"{BUCKET_MB_PER_GROUP:g} MiB per island: {resolve_bucket_mb('auto', 128):g} MiB at 128), "
            f"DDP's {BUCKET_MB_MIN:g} MiB for the peers' gradients")


def fabric(islands: int, gbit: float, base: dict):
    """``islands`` DGX A100 nodes of the SuperPOD file, leaf and spine at ``gbit`` Gbit/s per GPU."""
    d = copy.deepcopy(base)
    d["name"] = f"{islands}x8, {gbit:g} Gbit/s"
    for tier in ("leaf", "spine"):
        d["tiers"][tier]["bandwidth_gbps"] = gbit / 8.0
    d["tiers"]["spine"]["oversubscription"] = 1.0
    hosts = [f"dgx{i:03d}" for i in range(1, islands + 1)]
    d["leaves"] = [{"name": f"su{j // NODES_PER_LEAF + 1}", "hosts": hosts[j:j + NODES_PER_LEAF]}
                   for j in range(0, islands, NODES_PER_LEAF)]
    return topology_from_dict(d, source=f"costmodel_regions:{d['name']}")


def _superpod() -> dict:
    with open(SUPERPOD, encoding="utf-8") as f:
        return json.load(f)


def auto_choice(topo, islands: int, wl, opt: SimOptions, compute_s: float) -> tuple[MethodChoice, float]:
    """`method: auto` on this cell as the engine sees it (choose_for_groups: the islands, the plan's slow
    tier, the gradient, the compute), and the choice's step priced on the cell's own fabric."""
    plan = plan_groups(topo, group_by="island", mode="selective")
    slow, fast = topo.tiers[plan.inter_tier], topo.tiers[plan.intra_tier]
    inp = MethodInputs(islands, topo.world_size // islands, slow.effective_gbps, slow.latency_us,
                       f"{plan.inter_tier}, swept", wl.grad_elements, wl.grad_dtype, compute_s,
                       "6 x params x tokens / (GPUs x MFU x peak)", fast.effective_gbps, fast.latency_us,
                       replace(opt, last_n_share=opt.last_n_layers / wl.num_layers))  # as the engine: the last N
    c = choose_for_groups(inp)
    keys = {"sync_dtype": c.config["sync.dtype"], "top_fraction": c.config["sync.top_fraction"], "stream_fragments": 1}
    if c.method == "local":  # its last layer, no promotion budget, its H and fragments
        opt = local_options(inp.options)
        keys.update(reconcile_interval=c.config["local.reconcile_interval"],
                    stream_fragments=c.config["local.stream_fragments"])
    res = simulate(topo, wl, replace(opt, algorithms=("selective",), **keys))
    return c, res.row("selective").step_s


def sweep(islands=ISLANDS, gbits=GBITS, opt: SimOptions | None = None, auto: bool = True) -> list[Cell]:
    """Every cell priced: each column's step and slow-tier bytes, and (``auto``) `method: auto`'s choice."""
    opt = opt or options()
    base, wl = _superpod(), workload(1, 1)
    cells = []
    for n in islands:
        for g in gbits:
            topo = fabric(n, g, base)
            rows, res = {}, None
            for algos, over in passes():
                res = simulate(topo, wl, replace(opt, algorithms=algos, **over))
                for k, (algo, kw) in COLUMNS.items():
                    if algo in algos and all(over.get(a) == v for a, v in kw.items()):
                        rows.setdefault(k, res.row(algo))
            step = {k: rows[k].step_s for k in KEYS}
            slow = {k: sum(v for t, v in rows[k].tier_bytes_per_gpu.items() if t != "island") for k in KEYS}
            choice, auto_step = auto_choice(topo, n, wl, opt, res.compute_s) if auto else (None, math.nan)
            cells.append(Cell(n, g, res.compute_s, step, slow, res.workload["selective_sync_fraction"], choice,
                              auto_step))
    return cells


def _winner_cell(c: Cell) -> str:
    w = c.winners
    text = "all" if len(w) == len(KEYS) else " = ".join(SHORT[k] for k in w)
    text = f"**{text}**" if len(w) == 1 else text
    text += f" {c.step_s[w[0]]:.1f} s"
    if c.runner_up:
        text += f" ({SHORT[c.runner_up]} {c.step_s[c.runner_up] / c.step_s[w[0]]:.2f}x)"
    return text


def _auto_cell(c: Cell) -> str:
    m = c.auto
    text = AUTO_SHORT[m.method]
    if m.method == "local":
        text += f" {m.reconcile_interval}" + (" capped" if m.h_capped else "")
    ratio = c.auto_step_s / min(c.step_s.values())
    return f"**{text}** {ratio:.2f}x" if c.auto_agrees else f"{text} {ratio:.2f}x ({SHORT[c.winners[0]]})"


def _selective_text(cells: list[Cell], opt: SimOptions) -> str:
    """What selective runs with: `sync.dtype` / `sync.top_fraction` as resolved per island count."""
    parts = []
    for many, where in ((False, f"below {MANY_GROUPS} islands"), (True, f"from {MANY_GROUPS} islands on")):
        cs = [c for c in cells if (c.islands >= MANY_GROUPS) == many]
        if not cs:
            continue
        dtype, frac = resolve_sync(opt.sync_dtype, opt.top_fraction, cs[0].islands)
        if frac >= 1.0:
            parts.append(f"{where} every tensor SYNC on the {dtype} wire (`auto`)")
        else:
            parts.append(f"{where} SYNC share {cs[0].sync_fraction:.0%} (top fraction {frac:g}, last "
                         f"{opt.last_n_layers} layers and the promotion budget) on the {dtype} wire, LOCAL "
                         f"{opt.local_dtype}, {opt.reconcile_dtype} deltas every {opt.reconcile_interval} steps, "
                         f"{'async' if opt.async_reconcile else 'blocking'}")
    return "; ".join(parts)


def _intro(cells: list[Cell], opt: SimOptions, command: str) -> list[str]:
    inter = opt.inter_dtype or "the gradient dtype"
    t, wl = _superpod()["tiers"], workload(1, 1)
    return [
        f"Generated by `{command}` (simulated: the alpha-beta model; it prices communication and its overlap "
        "with backward only, **not** model quality: selective's LOCAL class, post-local SGD, DiLoCo and "
        "PowerSGD change the optimisation, and their quality cost is not in these figures; docs/convergence.md, "
        "\"Many islands\", measures a LOCAL class's at 2, 4 and 8 islands).",
        "",
        f"Workload: section 2's pure-DP GPT-3 ({wl.params / 1e9:g}B parameters, {wl.num_layers} layers, "
        f"{wl.grad_dtype} gradients, {wl.tokens_per_step:,.0f} tokens per step at {wl.mfu:.0%} MFU of "
        f"{wl.peak_tflops:g} TFLOP/s), TP1 x PP1; the global batch is fixed, so compute per step falls as "
        "1 / GPUs (last column of the step-time table). Fabric: islands of 8 GPUs = the DGX A100 nodes of "
        f"{os.path.relpath(SUPERPOD, ROOT)} (NVLink {t['island']['bandwidth_gbps']:g} GB/s per GPU, "
        f"{t['island']['latency_us']:g} us), leaves of up to {NODES_PER_LEAF} nodes, 1:1 spine, leaf and spine "
        f"at the column's link speed per GPU ({t['leaf']['latency_us']:g} / {t['spine']['latency_us']:g} us), "
        f"rank order by leaf. {_buckets_text(opt)}. The columns: "
        f"**H** hierarchical (`hier2-b2b`, its cross-island wire `communication.inter_dtype` {inter}); "
        f"**S** selective ({_selective_text(cells, opt)}); the peers (sim/peers.py, priced after their "
        f"warm-ups): **L** post-local SGD (`localsgd`: the gradient all-reduced in the island, the fp32 "
        f"parameters over all ranks every {opt.localsgd_period} steps, blocking); **D16**, **D64**, **D256** "
        "DiLoCo (`diloco`, as torchft runs it: the gradient all-reduced in the island, the fp32 pseudo-gradient "
        "of the whole model across islands every H = 16, 64 or 256 steps, blocking); **P1**, **P4** PowerSGD "
        "(`powersgd`, PyTorch's DDP hook at rank 1 or 4: per bucket the uncompressed vectors, then P, then Q in "
        "fp32, three chained ring all-reduces over all GPUs; the gradient's matrices assumed a GPT's, its "
        "compute not priced). Everything else: this release's `\"topo_align\"` defaults.",
    ]


AUTO_LEGEND = (
    "`method: auto`'s choice (sim/choose.py `choose_for_groups` with the cell's islands of 8, its slow tier as "
    "the plan sees it (bandwidth per GPU and latency), the gradient per GPU, the compute per step and the "
    "defaults above): hier. = `hierarchical` (every gradient, fp32 wire), int8 = every gradient on the int8 "
    "wire (what column S runs), local N = the LOCAL class reconciled every N steps (capped: at the longest "
    "interval the choice takes); then the choice's step, priced on the cell's fabric, over the fastest "
    "column's. Bold: within 1% of the fastest (auto agrees with the map); else the fastest in brackets.")


def render(cells: list[Cell], opt: SimOptions, command: str = COMMAND) -> str:
    islands = list(dict.fromkeys(c.islands for c in cells))
    gbits = list(dict.fromkeys(c.gbit for c in cells))
    at = {(c.islands, c.gbit): c for c in cells}
    cols = "| islands (GPUs) | " + " | ".join(f"{g:g} Gbit/s" for g in gbits) + " |"
    sep = "\n|---|" + "---:|" * len(gbits)
    out = _intro(cells, opt, command) + [
        "",
        "Winner by predicted step time, then its step time; in brackets the runner-up and its step time "
        "over the winner's. `H = S`: a tie (within 1%), all: the eight tie, bold: one winner alone.",
        "",
        cols + sep,
    ]
    for n in islands:
        out.append(f"| {n} ({8 * n}) | " + " | ".join(_winner_cell(at[(n, g)]) for g in gbits) + " |")
    if all(c.auto for c in cells):
        out += ["", AUTO_LEGEND, "", cols + sep]
        for n in islands:
            out.append(f"| {n} ({8 * n}) | " + " | ".join(_auto_cell(at[(n, g)]) for g in gbits) + " |")
    heads = " | ".join(SHORT[k] for k in KEYS)
    out += ["", "Step time, seconds (compute alone: last column):", "",
            f"| islands (GPUs) | Gbit/s | {heads} | compute |\n|---|---:|" + "---:|" * (len(KEYS) + 1)]
    for n in islands:
        for g in gbits:
            c = at[(n, g)]
            out.append(f"| {n} ({8 * n}) | {g:g} | " + " | ".join(f"{c.step_s[k]:.1f}" for k in KEYS)
                       + f" | {c.compute_s:.1f} |")
    out += ["", "Slow-tier bytes (everything leaving the island) per GPU and step, GB, in brackets over "
            "hierarchical's; the same at every link speed:", "",
            f"| islands (GPUs) | {heads} |\n|---|" + "---:|" * len(KEYS)]
    for n in islands:
        b = _bytes(at, n, gbits)
        h = b[KEYS[0]]
        out.append(f"| {n} ({8 * n}) | {_gb(h)} | " + " | ".join(f"{_gb(b[k])} ({_ratio(b[k] / h)})" for k in KEYS[1:])
                   + " |")
    out += ["", "Cells each algorithm wins (ties counted for every algorithm in them):", ""]
    for k in KEYS:
        won = [c for c in cells if k in c.winners]
        alone = [c for c in won if c.winners == [k]]
        where = ", ".join(f"{c.islands}@{c.gbit:g}" for c in alone) or "none"
        out.append(f"- {SHORT[k]} {NAMES[k]}: {len(won)} of {len(cells)} cells, {len(alone)} alone "
                   f"(islands@Gbit/s: {where})")
    if all(c.auto for c in cells):
        agree = [c for c in cells if c.auto_agrees]
        off = ", ".join(f"{c.islands}@{c.gbit:g}" for c in cells if not c.auto_agrees) or "none"
        out.append(f"- `method: auto` within 1% of the fastest: {len(agree)} of {len(cells)} cells "
                   f"(not in islands@Gbit/s: {off})")
    return "\n".join(out) + "\n"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x >= 1e9 else f"{x / 1e9:.2g}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1g}"


def _bytes(at: dict, n: int, gbits: list) -> dict[str, float]:
    """Slow-tier bytes of ``n`` islands; the model's bytes do not depend on the link speed (checked)."""
    first = at[(n, gbits[0])].slow_bytes
    for g in gbits[1:]:
        other = at[(n, g)].slow_bytes
        if any(not math.isclose(first[k], other[k], rel_tol=1e-9) for k in KEYS):
            raise SimError(f"{n} islands: slow-tier bytes differ between {gbits[0]:g} and {g:g} Gbit/s")
    return first


def write_doc(text: str, path: str = DOC) -> None:
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SimError(f"{path}: no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + text + END + tail)


def doc_block(path: str = DOC) -> str:
    """The tables as docs/costmodel.md holds them (between the markers)."""
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")


def _islands(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; expected a comma list of integers") from None
    if not v or min(v) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}; expected island counts >= 2 (one island has no slow tier)")
    return v


def _floats(text: str) -> tuple[float, ...]:
    try:
        v = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; expected a comma list of numbers") from None
    if not v or not all(math.isfinite(x) and x > 0 for x in v):
        raise argparse.ArgumentTypeError(f"{text!r}; expected positive numbers")
    return v


def _without_outputs(argv: list[str]) -> list[str]:
    """The arguments that change the tables (not where they are written)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--markdown":
            skip = True
        elif not (a.startswith("--markdown=") or a == "--write-doc"):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] + " Simulated.")
    p.add_argument("--islands", type=_islands, default=ISLANDS, help="comma list of island counts (8 GPUs each)")
    p.add_argument("--gbits", type=_floats, default=GBITS,
                   help="comma list of inter-island link speeds, Gbit/s per GPU")
    p.add_argument("--inter-dtype", choices=list(DTYPE_BYTES),
                   help="hierarchical's cross-island wire (default: communication.inter_dtype's default)")
    p.add_argument("--bucket-mb", type=lambda t: t if t == "auto" else _floats(t)[0],
                   help="bucket size, MiB, for every algorithm (default: communication.bucket_size_mb's "
                        "default, auto)")
    p.add_argument("--localsgd-period", type=int, default=4, help="post-local SGD's averaging period (default 4)")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables to PATH")
    p.add_argument("--write-doc", action="store_true", help=f"replace the tables in {os.path.relpath(DOC, ROOT)}")
    args = p.parse_args(argv)
    try:
        opt = options(args.inter_dtype, args.localsgd_period, args.bucket_mb)
        shown = list(argv if argv is not None else sys.argv[1:])
        command = " ".join([COMMAND, *_without_outputs(shown)])
        text = render(sweep(args.islands, args.gbits, opt), opt, command)
        if args.markdown:
            try:
                with open(args.markdown, "w", encoding="utf-8") as f:
                    f.write(text)
            except OSError as exc:
                raise SimError(f"--markdown {args.markdown}: cannot write ({exc.strerror or exc})") from None
        if args.write_doc:
            write_doc(text)
    except SimError as exc:
        print(f"costmodel_regions: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
