"""The long-horizon report: equal wall-clock budgets, validation curves, "flat quality" (docs/benchmarks.md).

For a run with validation curves (``--eval-interval``, the ``2x2-long`` preset): per system and run
the time at which the validation curve first reaches flat quality (the reference's final validation
loss x ``QUALITY_MARGIN``, interpolated between evaluations), the final validation loss (after the
system's own final reconciliation), the steps taken in the budget and the measured slow-tier bytes
per step; the goal verdicts of selective against its peers; the validation-loss-against-wall-time
plot. Headline figures are the median over the runs (a run that never reaches the target counts as
infinitely slow); every run's figure is listed beside it.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .budget import not_below, time_to
from .fmt import fmt_bytes
from .presets import REFERENCE
from .systems import averaging_period, torchft_period

__all__ = ["QUALITY_MARGIN", "COMM_SHARE_MIN", "is_long", "summarize_long", "long_md", "plot_val"]

QUALITY_MARGIN = 1.01
"""Flat quality: the reference's final validation loss x 1.01."""
COMM_SHARE_MIN = 0.70
"""The preset's condition: stock ZeRO-0 spends at least this share of its step communicating."""
SELECTIVE = ("topo-selective", "ds-topo-selective", "ds-topo-selective-z1")
STOCK_PEERS = ("ds-zero0", "ds-zero2", "megatron-ddp", "megatron-distopt", "ddp", "ddp-fp16")


def is_long(results: dict) -> bool:
    return bool(results.get("spec", {}).get("eval_interval"))


def _median(xs: list[float | None]) -> float | None:
    v = float(np.median([math.inf if x is None else x for x in xs])) if xs else math.inf
    return None if math.isinf(v) else v


def _runs(e: dict) -> list[dict]:
    return [r for r in e.get("runs", []) if r.get("status") == "ok"] or ([e] if "result" in e else [])


def summarize_long(results: dict, ok: dict) -> list[dict]:
    """Fill ``e['long']`` for every system that ran and ``results['long']``; return the goal rows."""
    ref = ok.get(REFERENCE)
    flat = ref["result"]["val_loss"] if ref else None
    target = QUALITY_MARGIN * flat if flat is not None else None
    results["long"] = {"reference": REFERENCE, "flat_final_val": flat, "flat_quality": target}
    for e in ok.values():
        per = []
        for r in _runs(e):
            res = r["result"]
            hit = time_to(res["val_curve"], target) if target is not None and res.get("val_curve") else None
            per.append({"repeat": r.get("repeat"), "time_to_quality_s": hit[0] if hit else None,
                        "step_at_quality": hit[1] if hit else None, "final_val": res["val_loss"],
                        "steps": res.get("steps_taken", len(res["step_times_s"])), "budget_s": res.get("budget_s"),
                        "stopped": res.get("stopped"),
                        "bytes_per_step": (r.get("measured") or {}).get("cross_node_bytes_per_step")})
        e["long"] = {"runs": per, **{k: _median([p[k] for p in per]) for k in
                                     ("time_to_quality_s", "final_val", "steps", "bytes_per_step")}}
    pl = [k for k in ok if averaging_period(k) is not None]
    if pl:  # post-local SGD's best period in this run: soonest at flat quality, then lowest final loss
        best = min(pl, key=lambda k: (ok[k]["long"]["time_to_quality_s"] or math.inf, ok[k]["long"]["final_val"]))
        results["long"]["localsgd_best"] = best
    return _goals(results, ok)


def _peers(ok: dict) -> list[str]:
    return [k for k in ok if k in STOCK_PEERS or averaging_period(k) is not None or torchft_period(k) is not None]


def _goals(results: dict, ok: dict) -> list[dict]:
    goals = []
    cs = results.get("comm_share") or {}
    if cs:
        share = cs.get("share")
        goals.append({"goal": f"preset: stock ZeRO-0 spends >= {COMM_SHARE_MIN:.0%} of its step communicating",
                      "systems": (REFERENCE,), "met": None if share is None else bool(share >= COMM_SHARE_MIN),
                      "detail": cs.get("detail", "not measured")})
    asked = {e["key"] for e in results["systems"]}
    target = results["long"]["flat_quality"]
    for key in (k for k in SELECTIVE if k in asked):
        e = ok.get(key)
        rows = [("reaches flat quality sooner than every peer", _sooner), ("final validation loss within 1% of flat",
                _final), ("below every peer on the validation curves from a quarter of the run on", _below),
                ("slow-tier bytes per step <= post-local SGD (H=4)", _bytes), (">= 2x stock ZeRO-0 step throughput",
                                                                               _speed)]
        for text, fn in rows:
            g = {"goal": f"{key}: {text}", "systems": (key,)}
            if e is None or target is None:
                g.update(met=None, detail=f"not measured: {key if e is None else REFERENCE} did not run")
            else:
                g.update(fn(key, e, ok, results))
            goals.append(g)
    return goals


def _t(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


def _sooner(key: str, e: dict, ok: dict, results: dict) -> dict:
    peers = {k: ok[k]["long"]["time_to_quality_s"] for k in _peers(ok)}
    a = e["long"]["time_to_quality_s"]
    txt = ", ".join(f"{k} {_t(t)}" for k, t in peers.items())
    if not peers:
        return {"met": None, "detail": "not measured: no peer ran"}
    met = a is not None and all(t is None or a < t for t in peers.values())
    return {"met": bool(met), "detail": f"{_t(a)} (target {results['long']['flat_quality']:.4f}); peers: {txt}"}


def _final(key: str, e: dict, ok: dict, results: dict) -> dict:
    flat, v = results["long"]["flat_final_val"], e["long"]["final_val"]
    return {"met": bool(v <= QUALITY_MARGIN * flat), "detail": f"{v:.4f} vs {flat:.4f} ({(v / flat - 1) * 100:+.2f}%)"}


def _below(key: str, e: dict, ok: dict, results: dict) -> dict:
    mine = e["result"]["val_curve"]
    budget = e["result"].get("budget_s") or mine[-1][1]
    where = []
    for k in _peers(ok):
        spans = not_below(mine, ok[k]["result"]["val_curve"], budget / 4, math.inf)
        where += [f"{k} {a:.1f}-{b:.1f} s" for a, b in spans]
    detail = (f"from {budget / 4:.1f} s on (a quarter of the {budget:.1f} s budget), median-step runs: "
              + ("below every peer throughout" if not where else "not below " + ", ".join(where)))
    return {"met": not where, "detail": detail}


def _bytes(key: str, e: dict, ok: dict, results: dict) -> dict:
    pl = ok.get("post-local-sgd")
    a, b = e["long"]["bytes_per_step"], (pl or {}).get("long", {}).get("bytes_per_step")
    if a is None or b is None:
        return {"met": None, "detail": "not measured: " + ("post-local-sgd did not run" if pl is None
                                                           else "no byte counters")}
    return {"met": bool(a <= b), "detail": f"{fmt_bytes(a)} vs {fmt_bytes(b)} per step ({(a / b - 1) * 100:+.0f}%)"}


def _speed(key: str, e: dict, ok: dict, results: dict) -> dict:
    base = ok.get(REFERENCE)
    sp = base["summary"]["step_median_s"] / e["summary"]["step_median_s"]
    return {"met": bool(sp >= 2.0), "detail": f"{sp:.2f}x (median step {e['summary']['step_median_s']:.3f} s vs "
                                               f"{base['summary']['step_median_s']:.3f} s)"}


def long_md(results: dict) -> str:
    """The equal-budget table (one row per system) and the post-local SGD period line."""
    lg = results.get("long") or {}
    head = ["| system | time to flat quality | final val loss | vs flat | slow-tier bytes/step | steps in the budget "
            "| budget |", "|---|---|---|---|---|---|---|"]
    for e in results["systems"]:
        if "long" not in e:
            continue
        L, runs = e["long"], e["long"]["runs"]
        several = len(runs) > 1

        def each(k, f, runs=runs, several=several):
            return f" (runs: {', '.join(f(r[k]) for r in runs)})" if several else ""

        flat = lg.get("flat_final_val")
        rel = f"{(L['final_val'] / flat - 1) * 100:+.2f}%" if flat else "–"
        head.append(f"| {e['label']} | {_t(L['time_to_quality_s'])}{each('time_to_quality_s', _t)} "
                    f"| {L['final_val']:.4f}{each('final_val', lambda v: f'{v:.4f}')} | {rel} "
                    f"| {fmt_bytes(L['bytes_per_step'])} | {L['steps']:.0f}{each('steps', lambda v: str(v))} "
                    f"| {', '.join(_t(r['budget_s']) if r['budget_s'] else 'sets it' for r in runs)} |")
    out = "\n".join(head)
    if lg.get("flat_quality") is not None:
        out = (f"Flat quality: {lg['flat_quality']:.4f} = {QUALITY_MARGIN} x {REFERENCE}'s final validation loss "
               f"{lg['flat_final_val']:.4f}. Headline figures are the median over the runs.\n\n" + out)
    if lg.get("localsgd_best"):
        out += f"\n\nPost-local SGD's best averaging period in this run: `{lg['localsgd_best']}`."
    return out


def plot_val(results: dict, img_dir: str, stem: str) -> str | None:
    """Validation loss against training wall time, every system (its median-step run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in results["systems"] if e.get("status") == "ok" and e.get("result", {}).get("val_curve")]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8))
    cmap = plt.get_cmap("tab20")
    for i, e in enumerate(ok):
        c = np.asarray(e["result"]["val_curve"], dtype=float)
        style = "-" if e.get("framework") == "topo-align" else "--"
        ax.plot(c[:, 1], c[:, 2], style, marker=".", ms=3, color=cmap(i % 20), label=e["label"], lw=1.3)
    target = (results.get("long") or {}).get("flat_quality")
    if target:
        ax.axhline(target, color="grey", ls=":", lw=0.9, label=f"flat quality ({target:.3f})")
    ax.set_xlabel("training wall time (s, slowest rank; evaluations left out)")
    ax.set_ylabel("validation loss (held-out)")
    ax.set_title(f"Validation loss vs wall time, equal budget, emulated {results['preset']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = os.path.join(img_dir, f"{stem}-val-vs-time.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
