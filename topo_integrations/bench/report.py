"""Statistics, time to target loss, goal verdicts, the Markdown report and the PNG plots.

Definitions (docs/benchmarks.md repeats them):
- step time: per step, the slowest rank's wall time of that step; the first step (lazy allocation,
  first bucket set-up) is left out of the median and spread when there are more than 2 steps;
- final loss: mean training loss over ranks, averaged over the last ``w = max(2, steps // 10)`` steps;
- time to target: training wall time (slowest rank) at the first step whose trailing ``w``-step mean
  loss is at or below the target; the default target is 1.02 x the final loss of the reference
  (stock DeepSpeed ZeRO-0, else PyTorch DDP), i.e. "as good as the baseline ends, within 2%".
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from .fmt import fmt_bytes
from .systems import LOCALSGD_PERIOD

__all__ = ["summarize", "markdown", "plot", "fmt_bytes", "REFERENCES"]

REFERENCES = ("ds-zero0", "ddp", "megatron-ddp")


def _window(steps: int) -> int:
    return max(2, steps // 10)


def _smoothed(losses: Sequence[float], w: int) -> np.ndarray:
    x = np.asarray(losses, dtype=float)
    c = np.cumsum(np.insert(x, 0, 0.0))
    out = np.empty_like(x)
    for i in range(len(x)):
        lo = max(0, i + 1 - w)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def _stats(e: dict) -> dict:
    r = e["result"]
    t = np.asarray(r["step_times_s"], dtype=float)
    body = t[1:] if len(t) > 2 else t
    w = _window(len(r["losses"]))
    s = {
        "steps": len(t), "step_median_s": float(np.median(body)), "step_p25_s": float(np.percentile(body, 25)),
        "step_p75_s": float(np.percentile(body, 75)), "step_min_s": float(body.min()), "step_max_s": float(body.max()),
        "train_s": float(r["step_end_s"][-1]), "final_loss": float(np.mean(r["losses"][-w:])),
        "val_loss": r["val_loss"], "params": r["params"],
    }
    s["steps_per_s"] = 1.0 / s["step_median_s"]
    return s


SPREAD_LIMIT = 0.25
"""A row whose runs' median step times spread more than this ((max - min) / median) is flagged."""


def _median_run(e: dict) -> None:
    """With several runs (``--repeats``): the entry's result, bytes and load are those of the run with
    the median step time (the lower middle of an even count); ``repeats`` holds every run's median
    step, the spread (max - min) / median and whether it exceeds SPREAD_LIMIT."""
    runs = [r for r in e.get("runs", []) if r.get("status") == "ok"]
    if not runs:
        return
    meds = [_stats(r)["step_median_s"] for r in runs]
    order = sorted(range(len(runs)), key=meds.__getitem__)
    pick = runs[order[(len(order) - 1) // 2]]
    for k in ("result", "measured", "theory", "load_start", "load_end", "wall_s", "log", "counters_error"):
        e.pop(k, None)
        if k in pick:
            e[k] = pick[k]
    mid = float(np.median(meds))
    spread = (max(meds) - min(meds)) / mid if mid > 0 else 0.0
    e["repeats"] = {"n": len(runs), "failed": len(e["runs"]) - len(runs), "step_medians_s": meds,
                    "median_of_medians_s": mid, "spread": spread, "over_limit": spread > SPREAD_LIMIT,
                    "loads": [[r.get("load_start"), r.get("load_end")] for r in runs],
                    "picked_run": pick.get("repeat")}


def _comm_share(results: dict, ok: dict) -> None:
    """--comm-share: 1 - (unshaped median step) / (shaped median step) of the reference system."""
    cs = results.get("comm_share")
    if not cs:
        return
    runs = [r for r in cs.get("runs", []) if r.get("status") == "ok"]
    shaped = ok.get(cs["system"])
    if not runs or shaped is None:
        cs.update(share=None, detail="not measured: " + ("the unshaped runs failed" if not runs
                                                         else f"{cs['system']} did not run shaped"))
        return
    un = [_stats(r)["step_median_s"] for r in runs]
    cs["unshaped_step_medians_s"] = un
    cs["unshaped_median_s"] = float(np.median(un))
    cs["shaped_median_s"] = shaped["summary"]["step_median_s"]
    cs["share"] = 1.0 - cs["unshaped_median_s"] / cs["shaped_median_s"]
    cs["detail"] = (f"{cs['system']}: median step {cs['shaped_median_s']:.3f} s shaped vs "
                    f"{cs['unshaped_median_s']:.3f} s with every link at {cs['unshaped_mbit']:g} Mbit/s "
                    f"({len(un)} run(s)): {cs['share'] * 100:.0f}% of the step is communication; the unshaped "
                    f"step is {cs['unshaped_median_s'] / cs['shaped_median_s']:.2f} of the shaped one")


def summarize(results: dict, *, target_loss: float | None = None) -> dict:
    """Add ``summary`` to every system that ran, the target loss, times to target and goal verdicts."""
    for e in results["systems"]:
        _median_run(e)
    ok = {e["key"]: e for e in results["systems"] if e.get("status") == "ok"}
    for e in ok.values():
        e["summary"] = _stats(e)
    _comm_share(results, ok)
    ref = next((k for k in REFERENCES if k in ok), None)
    if target_loss is None and ref is not None:
        target_loss = 1.02 * ok[ref]["summary"]["final_loss"]
        results["target_rule"] = f"1.02 x final loss of {ref}"
    elif target_loss is not None:
        results["target_rule"] = "given (--target-loss)"
    results["target_loss"] = target_loss
    results["reference"] = ref
    for e in ok.values():
        r, s = e["result"], e["summary"]
        s["time_to_target_s"] = None
        s["steps_to_target"] = None
        if target_loss is not None:
            sm = _smoothed(r["losses"], _window(len(r["losses"])))
            hit = np.nonzero(sm <= target_loss)[0]
            if len(hit):
                s["steps_to_target"] = int(hit[0]) + 1
                s["time_to_target_s"] = float(r["step_end_s"][hit[0]])
        if ref is not None:
            s["speedup_vs_ref"] = ok[ref]["summary"]["step_median_s"] / s["step_median_s"]
            s["loss_vs_ref"] = s["final_loss"] / ok[ref]["summary"]["final_loss"] - 1.0
        m, th = e.get("measured"), e.get("theory")
        if m and th and th["cross_node_bytes_per_step"] > 0:
            s["measured_over_theory"] = m["cross_node_bytes_per_step"] / th["cross_node_bytes_per_step"]
    from .longrun import is_long, summarize_long

    results["goals"] = summarize_long(results, ok) if is_long(results) else _goals(results, ok)
    for g in results["goals"]:
        noisy = [k for k in g.get("systems", ()) if ok.get(k, {}).get("repeats", {}).get("over_limit")]
        if noisy:
            g["detail"] += (f" (spread over {SPREAD_LIMIT:.0%} across runs for {', '.join(noisy)}: "
                            "the verdict rests on noisy figures)")
    return results


def _goals(results: dict, ok: dict) -> list[dict]:
    """The verdicts for the topo-align systems this run asked for (a requested system that failed is
    'not measured: ... did not run')."""
    goals = []
    base = ok.get("ds-zero0")
    asked = {e["key"] for e in results["systems"]}
    for key in ("topo-selective", "ds-topo-selective", "ds-topo-selective-z1"):
        if key not in asked:
            continue
        e = ok.get(key)
        g = {"goal": f"{key}: >= 2x the step throughput of stock DeepSpeed ZeRO-0 at a final loss within 2%",
             "systems": (key, "ds-zero0")}
        if e is None or base is None:
            g.update(met=None, detail=f"not measured: {key if e is None else 'ds-zero0'} did not run")
        else:
            sp = base["summary"]["step_median_s"] / e["summary"]["step_median_s"]
            dl = e["summary"]["final_loss"] / base["summary"]["final_loss"] - 1
            g.update(met=bool(sp >= 2.0 and abs(dl) <= 0.02),
                     detail=f"{sp:.2f}x throughput (median step {e['summary']['step_median_s']:.3f} s vs "
                            f"{base['summary']['step_median_s']:.3f} s), final loss {dl * 100:+.2f}%")
        goals.append(g)
        goals.append(_bytes_goal(key, e, ok.get("post-local-sgd")))
        goals.append(_time_goal(key, e, ok, results.get("target_loss")))
    for key in ("topo-hier", "ds-topo-hier"):
        if key not in asked:
            continue
        e = ok.get(key)
        g = {"goal": f"{key}: measured bytes per tier (node cut, leaf cut) within 10% of the theoretical minimum",
             "systems": (key,)}
        if e is None or "measured_over_theory" not in e.get("summary", {}):
            why = "did not run" if e is None else "has no byte counters"
            g.update(met=None, detail=f"not measured: {key} {why}")
        else:
            parts, met = [], True
            for cut in ("node", "leaf"):
                m, th = e["measured"].get(f"cross_{cut}_bytes_per_step"), e["theory"].get(f"cross_{cut}_bytes_per_step")
                if not th or m is None:
                    continue
                q = m / th
                met = met and abs(q - 1) <= 0.10
                parts.append(f"cross-{cut} {fmt_bytes(m)}/step vs theory {fmt_bytes(th)}/step ({(q - 1) * 100:+.1f}%)")
            g.update(met=bool(met), detail="measured " + "; ".join(parts))
        goals.append(g)
    if results.get("layout", {}).get("groups", ...) is None:  # a flat preset: topo-align may fall back to flat
        for key, stock in (("topo-selective", "ddp"), ("ds-topo-selective", "ds-zero0")):
            if key not in asked or not _planned_flat(results, key):
                continue
            e, b = ok.get(key), ok.get(stock)
            g = {"goal": f"{key}: fallback to flat within 3% of {stock}'s median step", "systems": (key, stock)}
            if e is None or b is None:
                g.update(met=None, detail=f"not measured: {key if e is None else stock} did not run")
            else:
                over = e["summary"]["step_median_s"] / b["summary"]["step_median_s"] - 1
                g.update(met=bool(over <= 0.03), detail=f"{e['summary']['step_median_s']:.3f} s vs "
                                                        f"{b['summary']['step_median_s']:.3f} s ({over * 100:+.1f}%)")
            goals.append(g)
    return goals


def _planned_flat(results: dict, key: str) -> bool:
    """Whether the run planned system ``key`` flat (the driver records each system's own plan,
    ``planned_flat``): on islands of one rank ``selective`` keeps groups of one and a rail (issue
    31), so the "fallback to flat" goal does not apply to it. Results written before the field
    count as flat, the rule of the mode-less layout they recorded."""
    entry = next((e for e in results.get("systems", []) if e.get("key") == key), {})
    return entry.get("planned_flat", True)


PEERS = ("ds-zero0", "ds-zero2", "megatron-ddp", "megatron-distopt", "ddp", "ddp-fp16", "post-local-sgd")


def _bytes_goal(key: str, e: dict | None, pl: dict | None) -> dict:
    g = {"goal": f"{key}: fewer measured cross-node bytes per step than post-local SGD", "systems": (key,)}
    a = (e or {}).get("measured", {}).get("cross_node_bytes_per_step")
    b = (pl or {}).get("measured", {}).get("cross_node_bytes_per_step")
    if a is None or b is None:
        who, entry = (key, e) if a is None else ("post-local-sgd", pl)
        why = "did not run" if entry is None else "has no byte counters in this run"
        return g | {"met": None, "detail": f"not measured: {who} {why}"}
    return g | {"met": bool(a < b), "detail": f"{fmt_bytes(a)} vs {fmt_bytes(b)} per step ({(a / b - 1) * 100:+.0f}%)"}


def _time_goal(key: str, e: dict | None, ok: dict, target: float | None) -> dict:
    """Shorter time to the target than every peer that ran (stock frameworks, DDP, local SGD)."""
    peers = {k: ok[k]["summary"]["time_to_target_s"] for k in PEERS if k in ok}
    g = {"goal": f"{key}: shorter time to the target loss than every peer", "systems": (key, *peers)}
    if e is None or not peers:
        return g | {"met": None, "detail": "not measured: " + (f"{key} did not run" if e is None else "no peer ran")}
    a = e["summary"]["time_to_target_s"]
    reached = {k: t for k, t in peers.items() if t is not None}
    best = min(reached, key=reached.get) if reached else None
    peers_txt = ", ".join(f"{k} {t:.1f} s" if t is not None else f"{k} never" for k, t in peers.items())
    if a is None:
        return g | {"met": False, "detail": f"{key} did not reach the target {target:.4f}; peers: {peers_txt}"}
    return g | {"met": bool(best is None or a < reached[best]),
                "detail": f"{a:.1f} s; peers: {peers_txt}" + (f"; fastest peer {best}" if best else "")}


# ------------------------------------------------------------------------------------------ output

def _row(e: dict) -> str:
    if e.get("status") != "ok":
        return f"| {e['label']} | {e.get('status', '?')} ({e.get('reason', '')}) | | | | | | | |"
    s, m, th = e["summary"], e.get("measured") or {}, e.get("theory") or {}
    ttt = (
        f"{s['time_to_target_s']:.1f} s (step {s['steps_to_target']})"
        if s.get("time_to_target_s") is not None
        else "not reached"
    )
    rel = f"{s['speedup_vs_ref']:.2f}x" if "speedup_vs_ref" in s else "–"
    rep = e.get("repeats")
    runs = ""
    if rep and rep["n"] > 1:
        runs = (f"; {rep['n']} runs: medians {', '.join(f'{x:.3f}' for x in rep['step_medians_s'])}, spread "
                f"{rep['spread'] * 100:.0f}%" + (f" **> {SPREAD_LIMIT:.0%}: noisy**" if rep["over_limit"] else ""))
    return (f"| {e['label']} | {s['step_median_s']:.3f} s ({s['step_p25_s']:.3f}–{s['step_p75_s']:.3f}; "
            f"{s['step_min_s']:.3f}–{s['step_max_s']:.3f}{runs}) | {rel} "
            f"| {fmt_bytes(m.get('cross_node_bytes_per_step'))} | {fmt_bytes(th.get('cross_node_bytes_per_step'))} "
            f"| {_leaf(m, th)} "
            f"| {s['final_loss']:.4f} | {s['val_loss']:.4f} | {ttt} |")


def _eff(spec: dict, key: str, field: str):
    """The value topo-align's systems ran with: ``--topo-set KEY`` wins over the bench's own field,
    which wins over the schema default (``None``: the bench did not set the key)."""
    v = spec.get("topo_set", {}).get(key, spec.get(field))
    if v is None:
        from ..config import TopoAlignConfig

        section, name = key.split(".")
        v = getattr(getattr(TopoAlignConfig(), section), name)
    return v


def _selective_took(results: dict) -> str:
    """What selective ran with: the engine's effective config as the trainers recorded it (``auto``
    resolved at the group count), else the keys the bench set."""
    spec = results["spec"]
    last = _eff(spec, "sync.last_n_layers", "sync_last_n_layers")
    every = _eff(spec, "local.reconcile_interval", "reconcile_interval")
    info = next((e["result"]["info"] for e in results["systems"] if "selective" in e["key"]
                 and isinstance(e.get("result"), dict) and "sync_fraction" in e["result"].get("info", {})), None)
    if info is None:
        return f"last {last} layer(s) + head SYNC, reconcile every {every} steps"
    if info["sync_fraction"] >= 1.0:
        return f"every tensor SYNC on the {info.get('sync_dtype', 'fp32')} wire (nothing to reconcile)"
    return (f"last {last} layer(s) + head SYNC ({info['sync_fraction']:.2f} of the elements with the top "
            f"fraction) on the {info.get('sync_dtype', 'fp32')} wire, reconcile every {every} steps")


def _leaf(m: dict, th: dict) -> str:
    if not m.get("cross_leaf_bytes"):
        return "–"
    out = fmt_bytes(m.get("cross_leaf_bytes_per_step"))
    if th.get("cross_leaf_bytes_per_step"):
        out += f" (theory {fmt_bytes(th['cross_leaf_bytes_per_step'])})"
    return out


def table(results: dict) -> str:
    head = ("| system | step time: median (IQR; min–max) | throughput vs ref. | cross-node bytes/step, measured "
            "| theoretical min. (algorithm) | cross-leaf bytes/step | final train loss | val loss | time to target |\n"
            "|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [_row(e) for e in results["systems"]])


def goals_md(results: dict) -> str:
    out = []
    for g in results.get("goals", []):
        mark = {True: "**met**", False: "**missed**", None: "not measured"}[g["met"]]
        out.append(f"- {g['goal']}: {mark}. {g['detail']}.")
    return "\n".join(out)


def markdown(results: dict, images: dict[str, str] | None = None) -> str:
    spec, mach = results["spec"], results["machine"]
    em = results.get("emulation", {})
    lines = [
        f"### Preset `{results['preset']}`: {results['preset_description']}"
        + (f" — here every node uplink at {spec['uplink_mbit']:g} Mbit/s (`--uplink-mbit`)" if spec.get("uplink_mbit")
           else ""),
        "",
        f"Command: `{results.get('command') or 'n/a'}`",
        "",
        f"Machine: {mach.get('cpu')}, {mach.get('cores')} cores, no GPU; kernel {mach.get('kernel')}; "
        f"Python {mach.get('python')}, torch {mach.get('torch')}, deepspeed {mach.get('deepspeed')}, "
        f"megatron-core {mach.get('megatron.core')}; load average before the run {mach.get('load_before', 0):.1f} "
        f"(the cores are shared with other jobs). Run {results.get('started')} to {results.get('finished')}. "
        "**Emulated** cluster: Linux network namespaces, veth + bridges, `tc` HTB shaping; gloo over real TCP.",
        "",
        f"Topology `{results['topology_file']}` (group_by `{results['group_by']}`): "
        + ", ".join(f"{n['host']} ranks {n['ranks']} uplink {n['uplink_mbit']:g} Mbit/s" for n in em.get("nodes", []))
        + (
            "; spine " + ", ".join(f"{s['leaf']} {s['rate_mbit']:g} Mbit/s" for s in em.get("spines", []))
            if em.get("spines")
            else ""
        )
        + ". "
        + " ".join(em.get("notes", [])),
        "",
        f"Workload: GPT {spec['layers']} layers x {spec['hidden']} hidden, {spec['heads']} heads, sequence "
        f"{spec['seq_length']}, byte-level vocabulary; micro-batch {spec['micro_batch']} per rank, "
        + _steps_and_lr(spec) + f", clip {spec['clip']:g}, "
        f"seed {spec['seed']}; selective: {_selective_took(results)}; "
        f"post-local SGD: averaging period {spec.get('reconcile_interval') or LOCALSGD_PERIOD}, warm-up "
        f"{spec['localsgd_warmup'] if spec['localsgd_warmup'] is not None else spec['warmup_steps']} global steps. "
        + (f"topo_align keys set (--topo-set): {', '.join(f'`{k}={v}`' for k, v in spec['topo_set'].items())}. "
           if spec.get("topo_set") else "")
        + (f"Target loss {results['target_loss']:.4f} ({results.get('target_rule')})." if results.get("target_loss")
           else "No target loss (no reference system in this run)."),
        "",
        table(results),
        "",
        "Goals:",
        "",
        goals_md(results) or "- (no goal measurable in this run)",
        "",
    ]
    loads = [f"{e['key']} {_loads(e)}" for e in results["systems"] if "load_start" in e or e.get("runs")]
    if loads:
        lines.insert(-6, "1-minute load average of the machine at the start → end of each system's run (2 cores; "
                         "other jobs shared them): " + ", ".join(loads) + ".\n")
    cs = results.get("comm_share")
    if cs:
        lines.insert(-6, "Communication share: " + cs.get("detail", "not measured") + ".\n")
    params = sorted({e["summary"]["params"] for e in results["systems"] if e.get("status") == "ok"})
    if params:
        lines.insert(-6, f"Parameters: {', '.join(f'{p / 1e6:.3f}M' for p in params)} (megatron-core's GPTModel pads "
                         "the vocabulary to 264).\n")
    if results.get("long"):
        from .longrun import long_md

        lines[lines.index("Goals:"):lines.index("Goals:")] = ["Equal wall-clock budget:", "", long_md(results), ""]
    for name, path in (images or {}).items():
        lines += [f"![{name}]({path})", ""]
    return "\n".join(lines)


def _steps_and_lr(spec: dict) -> str:
    if spec.get("budget_s"):
        steps = f"{spec['budget_s']:g} s of training for every system (equal budget)"
    elif spec.get("equal_budget"):
        steps = f"every system trains for {REFERENCES[0]}'s wall time of {spec['steps']} steps (equal budget)"
    else:
        steps = f"{spec['steps']} steps"
    if spec.get("eval_interval"):
        steps += f", validation every {spec['eval_interval']} steps"
    if spec.get("lr_schedule") == "constant":
        return f"{steps}, AdamW lr {spec['lr']:g} (warm-up {spec['warmup_steps']}, then constant)"
    return f"{steps}, AdamW lr {spec['lr']:g} (warm-up {spec['warmup_steps']}, cosine to {spec['min_lr_ratio']:g}x)"


def _loads(e: dict) -> str:
    runs = [r for r in e.get("runs", []) if "load_start" in r] or ([e] if "load_start" in e else [])
    if not runs:
        return "–"
    return " / ".join(f"{r['load_start']:.0f}→{r['load_end']:.0f}" for r in runs)


def plot(results: dict, img_dir: str, stem: str) -> dict[str, str]:
    """loss vs wall time, and bytes per tier; returns {title: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    ok = [e for e in results["systems"] if e.get("status") == "ok"]
    out = {}
    if not ok:
        return out
    fig, ax = plt.subplots(figsize=(8, 4.8))
    cmap = plt.get_cmap("tab20")
    for i, e in enumerate(ok):
        r = e["result"]
        w = _window(len(r["losses"]))
        # topo-align's own rows solid, the peers dashed; 20 distinct colours
        style = "-" if e.get("framework") == "topo-align" else "--"
        ax.plot(r["step_end_s"], _smoothed(r["losses"], w), style, color=cmap(i % 20), label=e["label"], lw=1.4)
    if results.get("target_loss"):
        ax.axhline(results["target_loss"], color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("training wall time (s, slowest rank)")
    ax.set_ylabel(f"training loss ({_window(len(ok[0]['result']['losses']))}-step mean)")
    ax.set_title(f"Loss vs wall time, emulated {results['preset']} ({results['topology']})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    p = os.path.join(img_dir, f"{stem}-loss-vs-time.png")
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out["loss vs wall time"] = p

    fig, ax = plt.subplots(figsize=(9, 4.8))
    labels = [e["label"] for e in ok]
    x = np.arange(len(ok))
    tiers = [
        ("cross_node_bytes_per_step", "cross-node (measured)"),
        ("cross_leaf_bytes_per_step", "cross-leaf (measured)"),
        ("intra_node_bytes_per_step", "intra-node loopback (measured)"),
    ]
    bw = 0.22
    for j, (k, name) in enumerate(tiers):
        vals = [(e.get("measured") or {}).get(k, 0) / 1e6 for e in ok]
        if j == 1 and not any(vals):
            continue
        ax.bar(x + (j - 1) * bw, vals, bw, label=name)
    th = [(e.get("theory") or {}).get("cross_node_bytes_per_step") for e in ok]
    ax.scatter([x[i] - bw for i, v in enumerate(th) if v is not None], [v / 1e6 for v in th if v is not None],
               marker="_", s=300, color="black", label="cross-node theoretical min.", zorder=3)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("MB per training step")
    ax.set_title(f"Bytes per tier per step, emulated {results['preset']}")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(img_dir, f"{stem}-bytes-per-tier.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out["bytes per tier"] = p
    from .longrun import plot_val

    v = plot_val(results, img_dir, stem)
    if v:
        out["validation loss vs wall time"] = v
    return out
