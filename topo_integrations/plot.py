"""`topo-align show --plot FILE.png`: hosts as boxes grouped by leaf, ranks as dots coloured by the
intra group of the plan, each host labelled with its GPUs and NICs when known, and the tiers in use
with their bandwidth and origin under the title (matplotlib, Agg backend; no display needed)."""

from __future__ import annotations

from .topology.model import Topology, TopologyError
from .topology.planner import Plan
from .topology.report import tier_rows

__all__ = ["plot_topology", "MAX_PLOT_RANKS"]

MAX_PLOT_RANKS = 20_000


def plot_topology(topo: Topology, plan: Plan | None, path: str) -> None:
    """Draw ``topo``; ranks are coloured by ``plan``'s intra group, or by island when ``plan`` is None."""
    if not str(path).lower().endswith(".png"):
        raise TopologyError(f"--plot {path!r}: expected a file name ending in .png")
    if topo.world_size > MAX_PLOT_RANKS:
        raise TopologyError(f"--plot: {topo.world_size} ranks; at most {MAX_PLOT_RANKS} can be drawn")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise TopologyError("--plot needs matplotlib: pip install 'topo-align[plot]'") from None

    groups = plan.intra_groups if plan is not None else tuple(tuple(v) for v in topo.islands.values())
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    cmap = plt.get_cmap("tab20")
    leaves = list(topo.leaves.items())
    hosts_per_leaf = [list(dict.fromkeys(topo.ranks[r].host for r in ranks)) for _, ranks in leaves]
    max_hosts = max(len(h) for h in hosts_per_leaf)
    max_gpus = max(len(v) for v in topo.hosts.values())
    fig_w = min(4 + max_hosts * 0.35, 40)
    fig_h = min(1.5 + len(leaves) * (0.3 + 0.08 * max_gpus), 60)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    hosts = topo.hosts
    labels = {f.host: f"{f.host}\n{f.device_count} GPU\n" + "+".join(
        f"{n.rate_gbit:g}G" for n in f.fast_nics()) for f in topo.nodes}
    xs: list[float] = []
    ys: list[float] = []
    colours: list = []
    for li, ((lname, _), hnames) in enumerate(zip(leaves, hosts_per_leaf)):
        y0 = -li * (max_gpus + 2)
        ax.add_patch(Rectangle((-0.6, y0 - max_gpus - 0.4), max_hosts + 0.2, max_gpus + 0.8,
                               fill=False, linestyle="--", edgecolor="grey"))
        ax.text(-0.8, y0 - max_gpus / 2, lname, ha="right", va="center", fontsize=8)
        for hi, h in enumerate(hnames):
            ax.add_patch(
                Rectangle((hi - 0.4, y0 - max_gpus - 0.2), 0.8, max_gpus + 0.4, fill=False, edgecolor="black", lw=0.5)
            )
            if h in labels and max_hosts <= 16:
                ax.text(hi, y0 - max_gpus - 0.6, labels[h], ha="center", va="top", fontsize=5)
            for r in hosts[h]:
                p = topo.ranks[r]
                xs.append(hi)
                ys.append(y0 - p.local_rank - 0.5)
                colours.append(cmap(group_of.get(r, 0) % 20))
    ax.scatter(xs, ys, s=12, c=colours, zorder=3)
    ax.set_xlim(-3, max_hosts + 0.5)
    ax.set_ylim(-(len(leaves)) * (max_gpus + 2), 1)
    ax.set_axis_off()
    if plan is None:
        kind = f"{len(groups)} islands (unequal: no plan)"
    else:
        kind = f"{len(plan.intra_groups)} intra groups ({plan.group_by})" if plan.hierarchical else "flat plan"
    tiers = ", ".join(f"{t['tier']} {t['effective_gbps']:.4g} GB/s ({t['origin']})" for t in tier_rows(topo)
                      if t["present"])
    ax.set_title(f"{topo.name}: {topo.world_size} ranks; colour = {kind}\n{tiers or 'one rank'}", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)
