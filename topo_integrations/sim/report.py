"""Render a `SimResult`: a rich table, JSON, a markdown table (docs) and a PNG plot."""

from __future__ import annotations

import json
import math

from .model import SIM_TIERS
from .scenario import SimResult

__all__ = ["render_table", "to_json_text", "markdown_table", "plot_png", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.3g} B"


def _x(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}x"


def _header(res: SimResult) -> str:
    t, w = res.topology, res.workload
    return (f"simulated: {t['name']} ({t['world_size']} GPUs, {t['hosts']} hosts, {t['leaves']} leaves, "
            f"rank order {res.options['rank_order']}); {w['params']:.3g} params, {w['grad_dtype']} grads, "
            f"TP{w['tp']} x PP{w['pp']} x DP{w['dp']} -> {fmt_bytes(w['grad_bytes_per_gpu'])} DP gradient per GPU; "
            f"compute {res.compute_s:.3f} s/step (backward {res.backward_s:.3f} s)")


def render_table(res: SimResult, console=None) -> None:
    """Print the table with rich (plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=200)
    console.print(_header(res), highlight=False)
    tab = Table(show_lines=False)
    for col in ("algorithm", "comm s", "bottleneck", *(f"{t} GB/GPU" for t in SIM_TIERS),
                *(f"{t} s" for t in SIM_TIERS), "buckets", "exposed s", "step s", "vs ring", "vs hier2"):
        tab.add_column(col, justify="left" if col in ("algorithm", "bottleneck") else "right")
    for r in res.rows:
        tab.add_row(
            r.label, f"{r.comm_s:.3f}", r.bottleneck,
            *(f"{r.tier_bytes_per_gpu[t] / 1e9:.3f}" for t in SIM_TIERS),
            *(f"{r.tier_seconds[t]:.3f}" for t in SIM_TIERS),
            str(r.n_buckets), f"{r.exposed_s:.3f}", f"{r.step_s:.3f}", _x(r.speedup_vs_ring), _x(r.speedup_vs_hier2),
        )
    console.print(tab)
    if res.method:
        console.print(res.method["line"].removeprefix("topo_align: "), highlight=False, soft_wrap=True)
    for n in res.notes:
        console.print(f"note: {n}", highlight=False)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def to_json_text(res: SimResult) -> str:
    return json.dumps(_clean(res.to_json()), indent=2, sort_keys=False)


def markdown_table(res: SimResult, keys: list[str] | None = None) -> str:
    """A compact markdown table for docs: comm time, bytes crossing the spine, exposed, step, speedups."""
    lines = [
        "| algorithm | comm s (1 collective) | bottleneck | NIC GB/GPU (leaf+spine) | spine GB/GPU | "
        "busiest NIC s | busiest uplink s | exposed s | step s | vs ring | vs hier2 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.rows:
        if keys and r.key not in keys:
            continue
        b = r.tier_bytes_per_gpu
        lines.append(
            f"| {r.label} | {r.comm_s:.3f} | {r.bottleneck} | {(b['leaf'] + b['spine']) / 1e9:.3f} | "
            f"{b['spine'] / 1e9:.3f} | {r.tier_seconds['leaf']:.3f} | {r.tier_seconds['spine']:.3f} | "
            f"{r.exposed_s:.3f} | {r.step_s:.3f} | {_x(r.speedup_vs_ring)} | {_x(r.speedup_vs_hier2)} |"
        )
    return "\n".join(lines)


def plot_png(res: SimResult, path: str) -> None:
    """Two panels: busy seconds per tier (one collective), and step time split into compute and exposed comm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.key for r in res.rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(SIM_TIERS)
    for i, t in enumerate(SIM_TIERS):
        ax1.bar([x + i * width for x in range(len(labels))], [r.tier_seconds[t] for r in res.rows], width, label=t)
    ax1.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30, ha="right")
    ax1.set_ylabel("busiest resource, s per step")
    ax1.set_title("link busy time per tier (simulated)")
    ax1.legend()
    ax2.bar(labels, [res.compute_s] * len(labels), label="compute")
    ax2.bar(labels, [r.exposed_s for r in res.rows], bottom=[res.compute_s] * len(labels), label="exposed comm")
    ax2.set_ylabel("s per step")
    ax2.set_title("step time (simulated)")
    ax2.tick_params(axis="x", rotation=30)
    ax2.legend()
    t = res.topology
    fig.suptitle(f"{t['name']}: {t['world_size']} GPUs, rank order {res.options['rank_order']}, "
                 f"TP{res.workload['tp']} PP{res.workload['pp']} DP{res.workload['dp']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
