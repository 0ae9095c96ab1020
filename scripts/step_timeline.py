"""Where a training step's time goes: per phase, and on the engine's issuing queue (emulated, CPU).

    .venv/bin/python scripts/step_timeline.py --out docs/data/step-timeline.json   # measure (~2 min, idle machine)
    .venv/bin/python scripts/step_timeline.py --from docs/data/step-timeline.json  # print the tables

Runs the bench's deep GPT (``topo-align bench --model deep``: 16 layers x 64, 0.84M parameters,
micro-batch 4 of 64 tokens, AdamW, clipping at 1) on the emulated 2 x 2 cluster (``topo-align
emulate``, node uplinks at ``--uplink-mbit``), ``--steps`` steps per system, built as the bench
builds it (bench/trainers.py) on random tokens (timing does not depend on the data). Every rank
times the phases of each step (forward, backward, ``finish_grad_sync``, clipping, the optimizer,
``after_optimizer_step``; post-local SGD's all-reduce runs inside DDP's backward) and DP position 0
records every item the engine's schedule issues (reducer/schedule/schedule.py: what, start, end).
The systems: PyTorch post-local SGD at H = 16 (the peer that reached flat quality first at 2 x 2),
the lean LOCAL class `method: auto` takes there (its keys pinned, H = 16), and `method: auto`.
The tables: per system the median over steps of each phase (the slowest rank's), the mean and
median step; then the queue of one ordinary step and of the first reconciliation step after
the warm-up, in milliseconds from the step's start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPOLOGY = "configs/topologies/virtual-2x2.json"
SYSTEMS = {
    "post-local-sgd-h16": ("post-local-sgd-h16", {}),
    "lean local class, H 16": ("topo-selective", {
        "sync.dtype": "int8", "sync.top_fraction": 0.05, "sync.last_n_layers": 1,
        "local.promote_drift_fraction": 0.0, "local.reconcile_interval": 16}),
    "method auto": ("topo-auto", {}),
}
"""Label -> (bench system key, ``--topo-set`` keys)."""
PHASES = ("forward", "backward", "finish", "clip", "optimizer", "after")
WARM = 40
"""Steps left out of the medians (auto chooses at step 5; the first reconciliations have no timing)."""


def _spec(key: str, topo_set: dict, steps: int) -> dict:
    from topo_integrations.bench.cli import MODELS
    from topo_integrations.bench.systems import averaging_period, is_local

    deep = MODELS["deep"]
    return {"system": key, "steps": steps, "micro_batch": deep["micro_batch"], "layers": deep["layers"],
            "hidden": deep["hidden"], "heads": deep["heads"], "seq_length": deep["seq_length"], "lr": 3e-3,
            "min_lr_ratio": 0.1, "warmup_steps": 20, "weight_decay": 0.1, "clip": 1.0, "seed": 1234,
            "reconcile_interval": None, "sync_last_n_layers": deep["sync_last_n_layers"], "async_reconcile": True,
            "localsgd_warmup": 20, "topology_file": str(ROOT / TOPOLOGY), "group_by": "island", "middle_level": False,
            "topo_set": topo_set, "groups": [[0, 1], [2, 3]], "nodes": 2, "lr_schedule": "constant",
            "local_method": is_local(key), "averaging_period": averaging_period(key) or None}


# -- one rank ---------------------------------------------------------------------------------------


def rank_main(spec_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from topo_integrations.bench import trainers
    from topo_integrations.bench.base import lr_at_step
    from topo_integrations.reducer.schedule import schedule as sched

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    items: list[tuple[str, float, float]] = []
    issue = sched.Schedule._execute

    def timed(self, it):  # the issuing thread: one item at a time, in release order
        t = time.perf_counter()
        issue(self, it)
        items.append((it.what, t, time.perf_counter()))

    sched.Schedule._execute = timed
    sysm = trainers.build(spec)
    red = getattr(sysm, "reducer", None)
    vocab = sysm.model.cfg.vocab_size
    g = torch.Generator().manual_seed(rank)
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    starts, bwd_ends = [], []
    for step in range(spec["steps"]):
        sysm.set_lr(lr_at_step(step, spec))
        tok = torch.randint(vocab, (spec["micro_batch"], spec["seq_length"] + 1), generator=g)
        b = {"tokens": tok[:, :-1], "labels": tok[:, 1:], "loss_mask": torch.ones(tok[:, 1:].shape)}
        t = t0 = time.perf_counter()
        starts.append(t0)
        marks = []
        sysm.opt.zero_grad(set_to_none=True)
        loss = sysm.net(b["tokens"], b["labels"], b["loss_mask"])
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        bwd_ends.append(marks[-1])
        if red is not None:
            red.finish_grad_sync()
        marks.append(time.perf_counter())
        sysm._clip()
        marks.append(time.perf_counter())
        sysm.opt.step()
        marks.append(time.perf_counter())
        if red is not None:
            red.after_optimizer_step(sysm.opt)
        marks.append(time.perf_counter())
        for p, m in zip(PHASES, marks):
            phases[p].append(m - t)
            t = m
    if red is not None:
        red.engine.drain()
    # The slowest rank's phase and step times (a step is done when every rank is done with it).
    flat = torch.tensor([v for p in PHASES for v in phases[p]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    n = spec["steps"]
    per = {p: flat[i * n:(i + 1) * n].tolist() for i, p in enumerate(PHASES)}
    st = torch.tensor([starts[i + 1] - starts[i] for i in range(n - 1)], dtype=torch.float64)
    dist.all_reduce(st, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {"phases_ms": {p: 1e3 * statistics.median(v[WARM:]) for p, v in per.items()},
               "step_ms": {"median": 1e3 * statistics.median(st.tolist()[WARM:]),
                           "mean": 1e3 * statistics.mean(st.tolist()[WARM:])},
               "steps": n, "queue": _queues(items, starts, bwd_ends)}
        if red is not None:
            s = red.stats()
            out["sync_fraction"] = s["sync_elements"] / max(1, s["sync_elements"] + s["local_elements"])
            out["method_line"] = s.get("method_line")
        Path(out_path).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _queues(items, starts, bwd_ends) -> dict:
    """The issued items of one ordinary step and of the first reconciliation step after the warm-up."""
    def of(i: int) -> list:
        t0, t1 = starts[i], starts[i + 1] if i + 1 < len(starts) else float("inf")
        return [[w, 1e3 * (a - t0), 1e3 * (b - t0)] for w, a, b in items if t0 <= a < t1]

    out = {}
    for i in range(WARM, len(starts) - 1):
        q = of(i)
        kind = "reconciliation" if any(w.startswith("reconciliation") for w, _, _ in q) else "ordinary"
        if kind not in out:
            out[kind] = {"step": i, "backward_end_ms": 1e3 * (bwd_ends[i] - starts[i]),
                         "step_ms": 1e3 * (starts[i + 1] - starts[i]), "items": q}
    return out


# -- the driver -------------------------------------------------------------------------------------


def measure(uplink_mbit: float, steps: int, timeout_s: float) -> dict:
    out = {"command": f"scripts/step_timeline.py --uplink-mbit {uplink_mbit:g} --steps {steps}",
           "uplink_mbit": uplink_mbit, "topology": TOPOLOGY, "warm_steps": WARM, "systems": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (key, topo_set) in SYSTEMS.items():
            spec, res = Path(tmp, "spec.json"), Path(tmp, "result.json")
            spec.write_text(json.dumps(_spec(key, topo_set, steps)))
            res.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "topo_integrations.emulate", "--topology", str(ROOT / TOPOLOGY),
                   "--uplink-mbit", f"{uplink_mbit:g}", "--timeout", f"{timeout_s:g}", "--",
                   sys.executable, str(Path(__file__).resolve()), "--rank-main", str(spec), str(res)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0 or not res.exists():
                raise SystemExit(f"step_timeline: {label}: exit {p.returncode}\n{p.stderr[-2000:]}")
            out["systems"][label] = {"system": key, "topo_set": topo_set, **json.loads(res.read_text())}
            print(f"step_timeline: {label}: done", file=sys.stderr)
    return out


def tables(data: dict) -> str:
    """The phase table and the two queues of each topo-align system, as markdown."""
    rows = ["| system | " + " | ".join(PHASES) + " | step: median / mean | SYNC share |",
            "|---|" + "---:|" * (len(PHASES) + 2)]
    for label, s in data["systems"].items():
        ph = " | ".join(f"{s['phases_ms'][p]:.1f}" for p in PHASES)
        share = f"{s['sync_fraction']:.0%}" if "sync_fraction" in s else "-"
        rows.append(f"| {label} | {ph} | {s['step_ms']['median']:.1f} / {s['step_ms']['mean']:.1f} | {share} |")
    text = ["Milliseconds, the slowest rank's median over steps "
            f"{data['warm_steps'] + 1}-{next(iter(data['systems'].values()))['steps']} (emulated 2 x 2, node uplinks "
            f"{data['uplink_mbit']:g} Mbit/s, 2-core CPU; `{data['command']}`):", "", *rows]
    for label, s in data["systems"].items():
        for kind, q in s.get("queue", {}).items():
            if not q["items"]:  # not a topo-align engine: nothing goes through its queue
                continue
            text += ["", f"{label}, {kind} step {q['step'] + 1} (backward ends at {q['backward_end_ms']:.0f} ms, "
                     f"the next step starts at {q['step_ms']:.0f} ms): the issuing queue, ms from the step's start", "",
                     "| start | end | item |", "|---:|---:|---|"]
            text += [f"| {a:.0f} | {b:.0f} | {w} |" for w, a, b in q["items"]]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-main", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--uplink-mbit", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=300.0, help="per system, seconds")
    ap.add_argument("--out", help="write the measurement (JSON) here")
    ap.add_argument("--from", dest="src", help="print the tables of a measurement instead of measuring")
    a = ap.parse_args(argv)
    if a.rank_main:
        rank_main(*a.rank_main)
        return 0
    if a.steps <= WARM + 1:
        ap.error(f"--steps {a.steps}: must exceed the {WARM} warm-up steps by at least 2")
    data = json.loads(Path(a.src).read_text()) if a.src else measure(a.uplink_mbit, a.steps, a.timeout)
    if a.out:
        Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    print(tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
