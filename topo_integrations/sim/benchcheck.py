"""Price the systems of a `topo-align bench` run with the cost model and compare with what it measured.

`topo-align simulate --bench RESULTS.json` reads the bench's results file as data (the layering keeps
the simulator and the bench apart), rebuilds the emulated cluster as the cost model sees it and
prices every system that has a counterpart in the model:

* topology: the run's topology file with the node uplinks it was shaped to (``emulation.nodes``:
  the uplink rate shared by the node's ranks) and the tiers the emulator really provides (section 3
  of docs/costmodel.md: loopback 0.34 GB/s, 13 us; rate-shaped links, 15-18 us one way);
* compute per step: the bench's own unshaped ZeRO-0 step (``comm_share``), else ``--compute-s``;
* each system's algorithm, wire dtypes and overlap as the bench runs it (``SYSTEM_MODELS``); for
  selective the SYNC share, intervals and dtypes the run reported; for post-local SGD its period and
  its warm-up steps (plain DDP over every rank), blended in by step count.

Measured step time is the mean over the run (training time / steps: periodic averaging and
reconciliation included, which is what sets how many steps fit a wall-clock budget); bytes are the
cross-node bytes per step the uplink counters saw against the model's leaf-tier bytes of all ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..topology.file_source import topology_from_dict
from .model import SimError
from .scenario import SimOptions, simulate
from .workload import Workload

__all__ = ["EMULATOR_TIERS", "SYSTEM_MODELS", "BenchRow", "check_bench", "bench_topology", "render_markdown",
           "trim_results"]

EMULATOR_TIERS = {"island": {"bandwidth_gbps": 0.34, "latency_us": 13},
                  "host": {"bandwidth_gbps": 0.34, "latency_us": 13},
                  "leaf": {"latency_us": 15}, "spine": {"latency_us": 18}}
"""What the emulator gives on this machine (docs/costmodel.md, "Calibration against the emulated cluster")."""

SYSTEM_MODELS: dict[str, tuple[str, dict]] = {
    # DeepSpeed without ZeRO all-reduces the fp32 gradients after backward, in buckets.
    "ds-zero0": ("ring", {"overlap": False}),
    "ddp": ("ring", {}),
    "megatron-ddp": ("ring", {}),
    "topo-flat": ("ring", {}),
    "ddp-fp16": ("ring", {"grad_dtype": "fp16"}),
    # Distributed optimizer with instances = nodes: reduce-scatter in the node, shard all-reduce across.
    "megatron-distopt": ("hier2-b2b", {}),
    "topo-hier": ("hier2-b2b", {}),
    "ds-topo-hier": ("hier2-b2b", {}),
    "topo-selective": ("selective", {}),
    "ds-topo-selective": ("selective", {}),
    "ds-topo-selective-z1": ("selective", {}),
    "post-local-sgd": ("localsgd", {}),
}
"""Bench system -> (cost-model algorithm, workload/option overrides); ``post-local-sgd-hN`` maps to
``localsgd`` with period N."""


@dataclass
class BenchRow:
    key: str
    label: str
    algorithm: str
    measured_step_s: float
    measured_median_s: float
    predicted_step_s: float
    measured_bytes: float
    predicted_bytes: float

    @property
    def step_err(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0

    @property
    def bytes_err(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1.0 if self.measured_bytes else float("nan")


def bench_topology(results: dict, root: Path) -> dict:
    """The topology dict of the bench run: its file, uplinks as shaped, the emulator's real tiers."""
    path = root / results["topology_file"]
    try:
        topo = json.loads(path.read_text())
    except OSError as exc:
        raise SimError(f"topology file {path}: cannot read ({exc.strerror or exc}); the results name it "
                       "relative to the repository root: run from there") from None
    nodes = results.get("emulation", {}).get("nodes") or []
    rates = {float(n["uplink_mbit"]) / len(n["ranks"]) for n in nodes if n.get("ranks")}
    if len(rates) != 1:
        raise SimError(f"{len(rates)} distinct per-rank uplink rates in the results' emulation.nodes; expected one")
    tiers = {name: {**topo["tiers"][name], **spec} for name, spec in EMULATOR_TIERS.items()}
    per_rank_gbps = rates.pop() / 8e3  # Mbit/s -> GB/s
    tiers["leaf"]["bandwidth_gbps"] = tiers["spine"]["bandwidth_gbps"] = per_rank_gbps
    return {**topo, "tiers": tiers}


def _model_of(key: str) -> tuple[str, dict, int | None]:
    if key.startswith("post-local-sgd-h") and key[len("post-local-sgd-h"):].isdigit():
        return "localsgd", {}, int(key[len("post-local-sgd-h"):])
    algo, over = SYSTEM_MODELS.get(key, (None, {}))
    return algo, over, None


def check_bench(results: dict, *, root: Path = Path("."),
                compute_s: float | None = None) -> tuple[list[BenchRow], list[str]]:
    """Predicted against measured step time and cross-node bytes per step for every system of ``results``."""
    if results.get("format") != "topo-align/bench/v1":
        raise SimError(f"bench results format = {results.get('format')!r}; expected 'topo-align/bench/v1'")
    topo = topology_from_dict(bench_topology(results, root), source="bench results")
    share = results.get("comm_share") or {}
    compute = compute_s if compute_s is not None else share.get("unshaped_median_s")
    if not compute:
        raise SimError("compute per step unknown: the results have no comm_share (run the bench with "
                       "--comm-share) and no --compute-s was given")
    notes = [f"compute per step {compute:.3f} s (" + ("--compute-s)" if compute_s is not None else
                                                    "the bench's unshaped ZeRO-0 step)")]
    spec = results.get("spec", {})
    rows = []
    for sysd in results.get("systems", []):
        key = sysd["key"]
        summ, res = sysd.get("summary") or {}, sysd.get("result") or {}
        algo, over, period = _model_of(key)
        if sysd.get("status") != "ok" or not summ.get("steps"):
            notes.append(f"{key}: not run ({sysd.get('status')})")
            continue
        if algo is None:
            notes.append(f"{key}: no counterpart in the cost model")
            continue
        wl = Workload(params=float(res.get("params") or summ["params"]), grad_dtype=over.get("grad_dtype", "fp32"),
                      compute_s=float(compute), num_layers=int(spec.get("layers", 1)))
        opt = replace(SimOptions(), algorithms=(algo,), overlap=over.get("overlap", True), rank_order="file")
        info = res.get("info") or {}
        if algo == "selective":
            # The SYNC share the run ended with (promotion spent) and the settings it reported.
            opt = replace(opt, top_fraction=0.0, last_n_share=float(info["sync_fraction"]), promote_fraction=0.0,
                          sync_dtype=info.get("sync_dtype", opt.sync_dtype),
                          reconcile_dtype=info.get("reconcile_dtype", opt.reconcile_dtype),
                          reconcile_interval=int(info.get("reconcile_interval", opt.reconcile_interval)),
                          moments_interval=int(info.get("moments_interval", opt.moments_interval)),
                          moments_dtype=info.get("moments_dtype", "fp32"))
        if algo == "localsgd":
            opt = replace(opt, localsgd_period=period or int(info.get("averaging_period", 4)))
        sim = simulate(topo, wl, opt)
        row = sim.row(algo)
        steps = float(summ["steps"])
        step_s, nbytes = row.step_s, row.tier_bytes_per_gpu["leaf"] * topo.world_size
        if algo == "localsgd" and info.get("localsgd_warmup"):
            # Post-local SGD's first steps are plain DDP over every rank (its warm-up): blend them in.
            w = min(steps, float(info["localsgd_warmup"]))
            ddp = sim.row("ring")  # simulate() always prices the flat ring as its reference
            step_s = (w * ddp.step_s + (steps - w) * step_s) / steps
            nbytes = (w * ddp.tier_bytes_per_gpu["leaf"] * topo.world_size + (steps - w) * nbytes) / steps
        rows.append(BenchRow(
            key=key, label=sysd.get("label", key), algorithm=algo,
            measured_step_s=float(summ["train_s"]) / steps, measured_median_s=float(summ["step_median_s"]),
            predicted_step_s=step_s,
            measured_bytes=float((sysd.get("measured") or {}).get("cross_node_bytes_per_step", 0.0)),
            predicted_bytes=nbytes))
    return rows, notes


def render_markdown(rows: list[BenchRow], notes: list[str], tolerance: float) -> str:
    """A table of predicted against measured, and the count within ``tolerance``."""
    lines = ["| system | model | step s: measured mean (median) | predicted | error | cross-node MB/step: "
             "measured | predicted | error | within |", "|---|---|---|---|---|---|---|---|---|"]
    ok = 0
    for r in rows:
        good = abs(r.step_err) <= tolerance and abs(r.bytes_err) <= tolerance
        ok += good
        lines.append(f"| {r.label} | `{r.algorithm}` | {r.measured_step_s:.3f} ({r.measured_median_s:.3f}) | "
                     f"{r.predicted_step_s:.3f} | {r.step_err:+.0%} | {r.measured_bytes / 1e6:.2f} | "
                     f"{r.predicted_bytes / 1e6:.2f} | {r.bytes_err:+.0%} | {'yes' if good else 'no'} |")
    lines += ["", f"{ok} of {len(rows)} systems within {tolerance:.0%} on both step time and bytes."]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


_INFO_KEYS = ("sync_fraction", "sync_dtype", "reconcile_dtype", "reconcile_interval", "moments_interval",
              "moments_dtype", "averaging_period", "localsgd_warmup")


def trim_results(results: dict) -> dict:
    """The fields of a bench results file that `check_bench` reads (a few kB instead of MBs of curves),
    for keeping beside the docs (docs/data/)."""
    out = {k: results[k] for k in ("format", "command", "preset", "topology_file", "machine", "started", "finished")
           if k in results}
    out["spec"] = {k: results.get("spec", {}).get(k) for k in ("layers", "steps")}
    out["emulation"] = {"nodes": [{k: n.get(k) for k in ("host", "ranks", "uplink_mbit")}
                                  for n in results.get("emulation", {}).get("nodes", [])]}
    out["comm_share"] = {"unshaped_median_s": (results.get("comm_share") or {}).get("unshaped_median_s")}
    out["systems"] = []
    for s in results.get("systems", []):
        summ, res = s.get("summary") or {}, s.get("result") or {}
        info = res.get("info") or {}
        out["systems"].append({
            "key": s["key"], "label": s.get("label"), "status": s.get("status"),
            "summary": {k: summ.get(k) for k in ("steps", "train_s", "step_median_s", "params")},
            "result": {"params": res.get("params"), "info": {k: info[k] for k in _INFO_KEYS if k in info}},
            "measured": {"cross_node_bytes_per_step": (s.get("measured") or {}).get("cross_node_bytes_per_step")}})
    return out
