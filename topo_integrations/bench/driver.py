"""Run the systems side by side on one emulated cluster and measure them (docs/benchmarks.md).

Phases:
  1. data: build the byte-level dataset once (train.data) and cut exactly the samples the run needs
     into two .npz files, so every system reads identical batches without touching megatron-core;
  2. availability: a system whose framework or adapter does not import is recorded as
     ``not run (reason)``;
  3. one ``EmulatedCluster`` for the whole invocation; per system, one at a time: fork one worker
     per rank (ranks.py), read every link's counters when rank 0 marks the start and the end of its
     training window (a poller thread answers the marks), collect the worker's result;
  4. statistics and the report (report.py).
Failures of one system (a crash, a timeout) are recorded as ``failed (reason)`` and the next runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..topology.file_source import load_topology_file
from ..topology.planner import plan_groups
from . import systems
from .budget import budget_for, run_order, train_seconds
from .presets import PRESETS, REFERENCE, Preset
from .systems import DEFAULT_SYSTEMS, SYSTEMS, Layout, availability, averaging_period, is_local, resolve, theory_bytes

__all__ = ["PRESETS", "Preset", "BenchSpec", "BenchError", "run_bench", "prepare_data", "REPO_ROOT"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BenchError(ValueError):
    """Bad benchmark input; the message names the field, the value and what is accepted."""


COMM_SHARE_SYSTEM = REFERENCE
UNSHAPED_MBIT = 10_000.0
"""Rate of every link in the unshaped runs of --comm-share: 50x the presets' uplinks, so what is left
of a step is compute, the loopback tier and the kernel's TCP work."""


@dataclass
class BenchSpec:
    preset: str = "2x2"
    systems: Sequence[str] = DEFAULT_SYSTEMS
    steps: int = 40
    micro_batch: int = 8
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq_length: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 6
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    reconcile_interval: int | None = None
    """Post-local SGD's averaging period and topo-align's ``local.reconcile_interval``; None: post-local
    SGD averages every ``LOCALSGD_PERIOD`` steps and topo-align runs its own default."""
    sync_last_n_layers: int = 1
    async_reconcile: bool = True
    localsgd_warmup: int | None = None
    """Global-DDP steps before post-local SGD turns local (default: the LR warm-up)."""
    eval_batches: int = 4
    target_loss: float | None = None
    timeout_s: float = 900.0
    """Per system."""
    out_dir: str = "runs/bench"
    data_dir: str | None = None
    uplink_mbit: float | None = None
    topology: str | None = None
    """Overrides the preset's topology file."""
    group_by: str | None = None
    corpus_max_bytes: int = 4 * 1024 * 1024
    topo_set: dict = field(default_factory=dict)
    """Dotted ``topo_align`` keys set for every topo-align system (``--topo-set KEY=VALUE``)."""
    repeats: int = 1
    """Runs per system, interleaved (A B C A B C ...); the report gives the median run and the spread."""
    comm_share: bool = False
    """Also run the reference (stock DeepSpeed ZeRO-0) with every link unshaped, ``repeats`` times, and
    report the share of its shaped step spent in communication: 1 - unshaped / shaped median step."""
    lr_schedule: str = "cosine"
    """``cosine``: warm-up, then cosine to ``min_lr_ratio`` at ``steps``; ``constant``: warm-up, then
    ``lr`` (the only fair one when systems take different step counts, ``equal_budget``)."""
    eval_interval: int | None = None
    """Validation loss every this many steps (and before the first, after the last) on the held-out
    batches; outside the clock and the byte counters (worker.py). None: only after the last step."""
    equal_budget: bool = False
    """Every system trains for the same wall-clock budget (``budget_s``, else the reference's training
    time for ``steps`` steps in the same round) and takes as many steps as fit."""
    budget_s: float | None = None
    """The budget in training seconds; with it the reference runs to the budget too."""
    max_steps: int | None = None
    """Cap on the steps of one run under ``equal_budget`` (default 8 x ``steps``); data is cut for it."""

    def check(self) -> None:
        if self.preset not in PRESETS:
            raise BenchError(f"--preset {self.preset!r}: accepted: {', '.join(PRESETS)}")
        unknown = [s for s in self.systems if resolve(s) is None]
        if unknown:
            raise BenchError(f"--systems: unknown {', '.join(unknown)}; accepted: {', '.join(SYSTEMS)}, "
                             "post-local-sgd-hN, torchft-diloco-hN, torchft-localsgd-hN (N >= 1)")
        if not self.systems:
            raise BenchError("--systems: give at least one system")
        for name in ("steps", "micro_batch", "layers", "hidden", "heads", "seq_length", "reconcile_interval",
                     "eval_batches", "repeats", "eval_interval", "max_steps"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise BenchError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must be at least 1")
        if self.hidden % self.heads:
            raise BenchError(f"--hidden {self.hidden}: must be a multiple of --heads {self.heads}")
        if not self.lr > 0:
            raise BenchError(f"--lr {self.lr!r}: must be positive")
        if self.uplink_mbit is not None and not 0.01 <= self.uplink_mbit <= 1e7:
            raise BenchError(f"--uplink-mbit {self.uplink_mbit!r}: expected a number in [0.01, 1e7] (Mbit/s)")
        if self.target_loss is not None and not self.target_loss > 0:
            raise BenchError(f"--target-loss {self.target_loss!r}: must be positive")
        if self.topo_set:
            from ..config import ConfigError, TopoAlignConfig

            try:
                TopoAlignConfig.model_validate({"enabled": True}).with_overrides(self.topo_set)
            except (ConfigError, ValueError) as exc:
                raise BenchError(f"--topo-set: {str(exc).splitlines()[0]}") from None
        self._check_budget()
        if self.comm_share and COMM_SHARE_SYSTEM not in self.systems:
            raise BenchError(f"--comm-share: needs {COMM_SHARE_SYSTEM} among --systems (it is the system measured)")

    def _check_budget(self) -> None:
        if self.lr_schedule not in ("cosine", "constant"):
            raise BenchError(f"--lr-schedule {self.lr_schedule!r}: accepted: cosine, constant")
        if self.budget_s is not None and not self.budget_s > 0:
            raise BenchError(f"--budget-s {self.budget_s!r}: must be positive (training seconds)")
        if not self.equal_budget:
            return
        if self.lr_schedule != "constant":
            raise BenchError("--lr-schedule cosine: under an equal wall-clock budget the systems take different "
                             "step counts, so a schedule over --steps favours some; use constant")
        if self.budget_s is None and REFERENCE not in self.systems:
            raise BenchError(f"--systems: the budget is {REFERENCE}'s time for --steps steps; add {REFERENCE} "
                             "or give --budget-s")
        if self.step_cap < self.steps:
            raise BenchError(f"--max-steps {self.max_steps}: must be at least --steps {self.steps}")

    @property
    def step_cap(self) -> int:
        """The most steps one run may take (what the training data is cut for)."""
        if not self.equal_budget:
            return self.steps
        return self.max_steps if self.max_steps is not None else 8 * self.steps

    @property
    def topology_file(self) -> str:
        path = self.topology or PRESETS[self.preset].topology
        return path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)


# ------------------------------------------------------------------------------------------ data

def prepare_data(spec: BenchSpec, world: int, log: Callable[[str], None] = print) -> tuple[str, str, dict]:
    """The train/validation samples of this run as .npz (cached by shape); returns paths + manifest."""
    with warnings.catch_warnings():
        # megatron-core's dataset code notes at import that it runs without Transformer Engine/Apex:
        # expected here (CPU), and not the benchmark's concern.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from ..train.data import build_gpt_datasets, prepare_dataset

    data_dir = spec.data_dir or os.path.join(spec.out_dir, "data")
    n_train = spec.step_cap * world * spec.micro_batch
    n_val = spec.eval_batches * spec.micro_batch
    key = f"seq{spec.seq_length}-seed{spec.seed}-n{n_train}-v{n_val}-c{spec.corpus_max_bytes}"
    train_npz, val_npz = (os.path.join(data_dir, f"{key}-{s}.npz") for s in ("train", "val"))
    prefix, manifest = prepare_dataset(data_dir, max_bytes=spec.corpus_max_bytes)
    if os.path.exists(train_npz) and os.path.exists(val_npz):
        return train_npz, val_npz, manifest
    log(f"bench: cutting {n_train} training and {n_val} validation samples from {prefix}")
    train_ds, valid_ds = build_gpt_datasets(prefix, seq_length=spec.seq_length, seed=spec.seed,
                                            train_samples=n_train, valid_samples=n_val,
                                            cache_dir=os.path.join(data_dir, "cache"))
    for ds, n, path in ((train_ds, n_train, train_npz), (valid_ds, n_val, val_npz)):
        items = [ds[i % len(ds)] for i in range(n)]
        arrays = {k: np.stack([np.asarray(it[k]) for it in items]) for k in ("tokens", "labels", "loss_mask")}
        arrays["tokens"] = arrays["tokens"].astype(np.uint16)
        arrays["labels"] = arrays["labels"].astype(np.uint16)
        arrays["loss_mask"] = arrays["loss_mask"].astype(np.float32)
        np.savez(path + ".tmp.npz", **arrays)
        os.replace(path + ".tmp.npz", path)
    return train_npz, val_npz, manifest


# ------------------------------------------------------------------------------------------ run

class _Poller(threading.Thread):
    """Answers the workers' marks: reads the cluster's counters, then writes the ack file."""

    def __init__(self, cluster, ctl_dir: str):
        super().__init__(daemon=True)
        self.cluster, self.ctl = cluster, ctl_dir
        self.snaps: dict = {}
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            # The worker's marks: start, end, and pause<k>/resume<k> around each evaluation.
            names = [f[len("mark-"):] for f in os.listdir(self.ctl) if f.startswith("mark-") and not f.endswith(".tmp")]
            for name in names:
                if name not in self.snaps:
                    try:
                        self.snaps[name] = (time.time(), self.cluster.counters())
                    except Exception as exc:  # noqa: BLE001 - reported in the result
                        self.error = f"counters at {name}: {exc}"
                        self.snaps[name] = (time.time(), None)
                    with open(os.path.join(self.ctl, f"ack-{name}"), "w") as fh:
                        fh.write("ok")
            self._halt.wait(0.01)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _layout(topo, group_by: str, middle_level: bool = False) -> Layout:
    """The preset's mode-less plan: the groups of post-local SGD, torchft and ``results['layout']``."""
    return systems.plan_layout(topo, plan_groups(topo, group_by=group_by, middle_level=middle_level))


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    out = {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
           "torch": torch.__version__, "gpu": "none (CPU, gloo)"}
    for mod in ("deepspeed", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001
            out[mod] = "not importable"
    try:
        out["load_before"] = os.getloadavg()[0]
    except OSError:
        pass
    return out


def run_bench(spec: BenchSpec, *, log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Run every system of ``spec`` on one emulated cluster; returns (and writes) ``results.json``."""
    from ..emulate import EmulatedCluster
    from ..emulate.netns import unavailable_reason
    from .ranks import RankStarter

    spec.check()
    preset = PRESETS[spec.preset]
    topo = load_topology_file(spec.topology_file)
    group_by = spec.group_by or preset.group_by
    layout = _layout(topo, group_by, preset.middle_level)
    theory_layouts = systems.theory_layouts(  # per system: its own plan (a topo-align system's mode)
        spec.systems, topo, log=log, topology_file=spec.topology_file, group_by=group_by,
        middle_level=preset.middle_level, topo_set=spec.topo_set, sync_last_n_layers=spec.sync_last_n_layers,
        reconcile_interval=spec.reconcile_interval)
    world = topo.world_size
    os.makedirs(spec.out_dir, exist_ok=True)
    reason = unavailable_reason()
    if reason:
        raise BenchError(f"cannot emulate a cluster: {reason}")
    train_npz, val_npz, manifest = prepare_data(spec, world, log)

    results: dict = {
        "format": "topo-align/bench/v1",
        "command": command,
        "spec": asdict(spec) | {"systems": list(spec.systems)},
        "preset": spec.preset,
        "preset_description": preset.description,
        "topology": topo.name,
        "topology_file": os.path.relpath(spec.topology_file, REPO_ROOT),
        "group_by": group_by,
        "layout": {
            "hosts": list(layout.hosts),
            "leaves": list(layout.leaves),
            "groups": [list(g) for g in layout.groups] if layout.groups else None,
            "leaf_rails": [list(g) for g in layout.leaf_rails], "spine_rails": [list(g) for g in layout.spine_rails],
        },
        "machine": machine_description(),
        "dataset": manifest,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "systems": [],
    }
    uplink = spec.uplink_mbit if spec.uplink_mbit is not None else preset.uplink_mbit
    cluster = EmulatedCluster(topo, uplink_mbit=uplink)
    with cluster, RankStarter(spec.systems, log) as starter:
        launch = starter.launch
        results["emulation"] = {
            "notes": list(cluster.notes), "mtu": cluster.layout.mtu, "ranks": starter.how,
            "nodes": [{"host": n.host, "ranks": list(n.ranks), "uplink_mbit": n.uplink.rate_mbit,
                       "uplink_delay_ms": n.uplink.delay_ms} for n in cluster.layout.nodes],
            "spines": [{"leaf": s.leaf, "rate_mbit": s.shape.rate_mbit, "delay_ms": s.shape.delay_ms}
                       for s in cluster.layout.spines],
        }
        entries = {}
        for key in spec.systems:
            system = resolve(key)
            entry = {"key": key, "label": system.label, "framework": system.framework, "note": system.note,
                     "planned_flat": getattr(theory_layouts.get(key), "groups", ()) is None}  # its mode's plan
            why = availability(system)
            if why:
                entry.update(status="not run", reason=why)
                log(f"bench: {key}: not run ({why})")
            else:
                entry.update(status="pending", runs=[])
            entries[key] = entry
            results["systems"].append(entry)
        # Interleaved (A B C A B C ...): a slow minute of the shared machine hits one run of each
        # system rather than every run of one.
        # With an equal budget the reference runs first in every round: its time is the round's budget.
        for rep in range(spec.repeats):
            round_budget = None
            for key in run_order(spec.systems, spec.equal_budget, spec.budget_s):
                entry, i = entries[key], list(spec.systems).index(key)
                if entry["status"] == "not run":
                    continue
                tag = key if spec.repeats == 1 else os.path.join(key, f"run{rep + 1}")
                budget, why = budget_for(key, round_budget, equal_budget=spec.equal_budget, budget_s=spec.budget_s)
                one = {"status": "failed", "reason": why} if why else _run_one(
                    cluster, launch, spec, key, i, layout, group_by, train_npz, val_npz, log, tag=tag, budget_s=budget,
                    theory_layout=theory_layouts.get(key))
                if spec.equal_budget and key == REFERENCE and spec.budget_s is None and one["status"] == "ok":
                    round_budget = train_seconds(one["result"])
                    log(f"bench: round {rep + 1}: budget {round_budget:.1f} s ({REFERENCE}, {spec.steps} steps)")
                entry["runs"].append({"repeat": rep + 1, **one})
                _merge_runs(entry)
                _write(os.path.join(spec.out_dir, "results.json"), results)
        if spec.comm_share and entries[COMM_SHARE_SYSTEM]["status"] != "not run":
            results["comm_share"] = {"system": COMM_SHARE_SYSTEM, "unshaped_mbit": UNSHAPED_MBIT, "runs": []}
            with _unshaped(cluster):
                for rep in range(spec.repeats):
                    one = _run_one(cluster, launch, spec, COMM_SHARE_SYSTEM, 0, layout, group_by, train_npz,
                                   val_npz, log, tag=os.path.join(COMM_SHARE_SYSTEM, f"unshaped{rep + 1}"),
                                   evaluate=False)
                    one.pop("theory", None)
                    results["comm_share"]["runs"].append({"repeat": rep + 1, **one})
                    _write(os.path.join(spec.out_dir, "results.json"), results)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    from .report import summarize

    summarize(results, target_loss=spec.target_loss)
    _write(os.path.join(spec.out_dir, "results.json"), results)
    return results


def _merge_runs(entry: dict) -> None:
    """The entry's status from its runs: ok when one ran; else the last failure's."""
    ok = [r for r in entry["runs"] if r.get("status") == "ok"]
    if ok:
        entry["status"] = "ok"
        entry.pop("reason", None)
    else:
        entry.update(status="failed", reason=entry["runs"][-1].get("reason", ""))


class _unshaped:
    """Every node uplink and spine link at UNSHAPED_MBIT inside the block; the planned shapes after."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.saved: list = []

    def __enter__(self):
        c = self.cluster
        for n in c.layout.nodes:
            self.saved.append((c.set_link, n.host, c.link_shape(n.host).rate_mbit))
            c.set_link(n.host, rate_mbit=UNSHAPED_MBIT)
        for sp in c.layout.spines:
            self.saved.append((c.set_spine, sp.leaf, c.link_shape(f"{sp.leaf}:spine").rate_mbit))
            c.set_spine(sp.leaf, rate_mbit=UNSHAPED_MBIT)
        return self

    def __exit__(self, *exc):
        for fn, name, rate in self.saved:
            fn(name, rate_mbit=rate)


def _run_one(cluster, launch, spec: BenchSpec, key: str, index: int, layout: Layout, group_by: str,
             train_npz: str, val_npz: str, log, *, tag: str | None = None, budget_s: float | None = None,
             evaluate: bool = True, theory_layout: Layout | None = None) -> dict:
    sys_dir = os.path.abspath(os.path.join(spec.out_dir, tag or key))
    ctl = os.path.join(sys_dir, "ctl")
    os.makedirs(ctl, exist_ok=True)
    for name in os.listdir(ctl):
        os.remove(os.path.join(ctl, name))
    for stale in ("result.json",):
        if os.path.exists(os.path.join(sys_dir, stale)):
            os.remove(os.path.join(sys_dir, stale))
    wspec = {
        "system": key, "steps": spec.steps, "micro_batch": spec.micro_batch, "layers": spec.layers,
        "hidden": spec.hidden, "heads": spec.heads, "seq_length": spec.seq_length, "lr": spec.lr,
        "min_lr_ratio": spec.min_lr_ratio, "warmup_steps": spec.warmup_steps, "weight_decay": spec.weight_decay,
        "clip": spec.clip, "seed": spec.seed, "reconcile_interval": spec.reconcile_interval,
        "sync_last_n_layers": spec.sync_last_n_layers, "async_reconcile": spec.async_reconcile,
        "localsgd_warmup": spec.warmup_steps if spec.localsgd_warmup is None else spec.localsgd_warmup,
        "eval_batches": spec.eval_batches, "timeout_s": max(60.0, spec.timeout_s),
        "train_npz": os.path.abspath(train_npz), "val_npz": os.path.abspath(val_npz),
        "out_dir": sys_dir, "ctl_dir": ctl, "topology_file": spec.topology_file, "group_by": group_by,
        "middle_level": PRESETS[spec.preset].middle_level, "topo_set": dict(spec.topo_set),
        "groups": [list(g) for g in layout.groups] if layout.groups else None,
        "nodes": len(set(layout.hosts)),
        "lr_schedule": spec.lr_schedule, "eval_interval": spec.eval_interval if evaluate else None,
        "equal_budget": spec.equal_budget, "budget_s": budget_s, "max_steps": spec.step_cap,
        "local_method": is_local(key), "averaging_period": averaging_period(key) or None,
    }
    spec_path = os.path.join(sys_dir, "spec.json")
    _write(spec_path, wspec)
    what = f"{budget_s:.1f} s of training" if budget_s is not None else f"{spec.steps} steps"
    log(f"bench: {tag or key}: running {what} on {len(layout.hosts)} ranks "
        f"(load {os.getloadavg()[0]:.1f}) ...")
    poller = _Poller(cluster, ctl)
    poller.start()
    env_note = {"load_start": os.getloadavg()[0]}  # other jobs on the shared cores skew step times
    t0 = time.monotonic()
    with open(os.path.join(sys_dir, "output.log"), "w", encoding="utf-8") as out:
        try:
            res = launch(cluster, [sys.executable, "-u", "-m", "topo_integrations.bench.worker", spec_path],
                         mode="per-rank", timeout=spec.timeout_s, port=29500 + (index % 50) * 7, out=out)
        finally:
            poller.stop()
    wall = time.monotonic() - t0
    env_note["load_end"] = os.getloadavg()[0]
    entry: dict = {"wall_s": wall, "log": os.path.relpath(os.path.join(sys_dir, "output.log")), **env_note}
    result_path = os.path.join(sys_dir, "result.json")
    if res.exit_code != 0 or not os.path.exists(result_path):
        tail = _tail(os.path.join(sys_dir, "output.log"))
        entry.update(status="failed", reason=f"{res.reason}; {tail}")
        log(f"bench: {key}: failed ({res.reason}); see {entry['log']}")
        return entry
    with open(result_path, encoding="utf-8") as fh:
        r = json.load(fh)
    entry.update(status="ok", result=r)
    if poller.error or any(v[1] is None for v in poller.snaps.values()) or not {"start", "end"} <= set(poller.snaps):
        entry["counters_error"] = poller.error or "a mark was not answered"
    else:
        entry["measured"] = _measured(poller.snaps, int(r.get("steps_taken", spec.steps)))
    th = theory_bytes(key, theory_layout, r["params"], r.get("info", {})) if theory_layout is not None else None
    if th is not None:
        entry["theory"] = {"cross_node_bytes_per_step": th["node"], "cross_leaf_bytes_per_step": th["leaf"]}
    log(f"bench: {tag or key}: done in {wall:.0f} s (load {env_note['load_end']:.1f})")
    return entry


def _measured(snaps: dict, steps: int) -> dict:
    """Counter differences over the training window less its pauses (evaluations: marks
    ``pause<k>`` / ``resume<k>``), per step."""
    (ta, a), (tb, b) = snaps["start"], snaps["end"]
    d, window = b.minus(a), tb - ta
    for name in sorted(n for n in snaps if n.startswith("pause")):
        (tp, p), (tr, q) = snaps[name], snaps["resume" + name[len("pause"):]]
        d, window = d.minus(q.minus(p)), window - (tr - tp)
    return {
        "window_s": window, "steps": steps, "pauses": sum(1 for n in snaps if n.startswith("pause")),
        "cross_node_bytes": d.cross_node_bytes, "cross_leaf_bytes": d.cross_leaf_bytes,
        "intra_node_bytes": d.intra_node_bytes,
        "cross_node_bytes_per_step": d.cross_node_bytes / steps,
        "cross_leaf_bytes_per_step": d.cross_leaf_bytes / steps,
        "intra_node_bytes_per_step": d.intra_node_bytes / steps,
        "links": d.to_json()["links"],
    }


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [ln.rstrip() for ln in fh if ln.strip()]
    except OSError:
        return "no output"
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    pick = (errs[-1:] if errs else []) or lines[-n:]
    return " | ".join(pick)[-400:]


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)
        fh.write("\n")
    os.replace(path + ".tmp", path)
