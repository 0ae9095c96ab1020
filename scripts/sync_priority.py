"""SYNC tail with a reconciliation in flight, on the emulated 2 x 2 cluster (docs/benchmarks.md).

    .venv/bin/python scripts/sync_priority.py --uplink-mbit 40 --steps 40 --repeats 2   # root: netns

For each repeat and each variant, builds the emulated cluster (configs/topologies/virtual-2x2.json,
node uplinks shaped to ``--uplink-mbit``) and trains ``GroupedReducer`` in `selective` (async
reconciliation every 2 steps, blocking drift promotion off, SYNC = the last layer) on a 4-layer MLP
(about 1.1 M parameters: the reconciliation of the LOCAL 3/4 crosses the slow tier in chunks of the
bucket size). Every rank records, per step, the SYNC tail: the time from its last SYNC bucket's
submission (its last SYNC gradient) to the completion of its last SYNC reduction
(``Engine.stats()["schedule"]``), split by whether an asynchronous reconciliation was outstanding
when the step's SYNC reductions began. Variants:

* ``rule``: the dispatcher's rule: the chunks that fit (measured, agreed) go into the window before
  the next step's first SYNC bucket, the rest after every bucket of that step;
* ``held``: every chunk after every bucket of the next step (no window): SYNC is never delayed, but
  the reconciliation no longer overlaps the forward pass;
* ``launch``: every chunk at its launch, ahead of the next step's buckets (what the rule prevents:
  SYNC queues behind whatever is left).
(``Dispatcher.reconcile_release``; ``held`` and ``launch`` exist only for this ablation.)

Prints a Markdown table (median over ranks of the per-rank mean, and the spread over repeats) and
writes the raw numbers with ``--json``. The 10% goal of docs/reducer.md: ``rule`` with/without <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "configs" / "topologies" / "virtual-2x2.json"


def worker(out_dir: str, steps: int, variant: str, bucket_mb: float) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from topo_integrations import GroupedReducer, TopoAlignConfig

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TopoAlignConfig.model_validate({
        "mode": "selective", "topology": {"source": "file", "file": str(TOPOLOGY)},
        "sync": {"last_n_layers": 1, "always_sync": [], "top_fraction": 0.0},
        "local": {"reconcile_interval": 2, "async_reconcile": True, "promote_drift_fraction": 0.0},
        "importance": {"refresh_interval": 100000},
        "communication": {"bucket_size_mb": bucket_mb}, "fallback": {"timeout_s": 300}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(),
                          nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 256))
    red = GroupedReducer(model, cfg)
    red.engine.dispatcher.reconcile_release = {"rule": "window", "held": "held", "launch": "launch"}[variant]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(32, 256, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        red.finish_grad_sync()
        opt.step()
        red.after_optimizer_step(opt)
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    rows = [r for r in red.engine.dispatcher.schedule if r["step"] > 2]  # after warm-up
    st = red.stats()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "rows": rows, "step_s": elapsed / steps,
                   "sync_fraction": st["sync_fraction"],
                   "inter_bytes_per_step": sum(st["total"]["bytes"]["inter"].values()) / steps}, fh)
    red.close()
    dist.destroy_process_group()


def _summary(out_dir: Path) -> dict:
    per_rank = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    res = {}
    for key, flag in (("with", True), ("without", False)):
        means = []
        for r in per_rank:
            xs = [row["sync_tail_s"] for row in r["rows"] if row["reconcile_in_flight"] is flag]
            if xs:
                means.append(statistics.mean(xs))
        res[key] = statistics.median(means) if means else None
    res["ratio"] = res["with"] / res["without"] if res["with"] and res["without"] else None
    res["step_s"] = statistics.median(r["step_s"] for r in per_rank)
    res["inter_mb_per_step"] = statistics.median(r["inter_bytes_per_step"] for r in per_rank) / 1e6
    res["sync_fraction"] = per_rank[0]["sync_fraction"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--uplink-mbit", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("OUT_DIR", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.steps, a.worker[1], a.bucket_mb)
        return 0
    from topo_integrations.emulate import EmulatedCluster
    from topo_integrations.topology.file_source import load_topology_file

    runs: dict[str, list[dict]] = {"rule": [], "held": [], "launch": []}
    for rep in range(a.repeats):
        for variant in runs:  # interleaved, so drift of the machine hits every variant
            with tempfile.TemporaryDirectory() as tmp, \
                    EmulatedCluster(load_topology_file(str(TOPOLOGY)), uplink_mbit=a.uplink_mbit) as cl:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--steps", str(a.steps),
                       "--bucket-mb", str(a.bucket_mb), "--worker", tmp, variant]
                res = cl.launch(cmd, mode="per-rank", timeout=1800)
                if res.exit_code != 0:
                    print(f"{variant} repeat {rep}: the job failed: {res.reason}", file=sys.stderr)
                    return 1
                runs[variant].append(_summary(Path(tmp)))
            print(f"repeat {rep} {variant}: {runs[variant][-1]}", file=sys.stderr)

    def cell(vals, fmt):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "n/a"
        med = statistics.median(vals)
        return f"{fmt(med)} [{fmt(min(vals))}-{fmt(max(vals))}]"

    ms = lambda v: f"{v * 1e3:.0f}"  # noqa: E731
    print("| variant | SYNC tail, reconciliation in flight (ms) | SYNC tail, none in flight (ms) | ratio | "
          "step (s) | slow-tier MB/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant, rs in runs.items():
        print(f"| {variant} | {cell([r['with'] for r in rs], ms)} | {cell([r['without'] for r in rs], ms)} | "
              f"{cell([r['ratio'] for r in rs], lambda v: f'{v:.2f}')} | "
              f"{cell([r['step_s'] for r in rs], lambda v: f'{v:.3f}')} | "
              f"{cell([r['inter_mb_per_step'] for r in rs], lambda v: f'{v:.2f}')} |")
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
