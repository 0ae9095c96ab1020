"""DeepSpeed ZeRO-1/2 `selective`: how much of the SYNC rail reduction overlaps backward.

4 gloo ranks on this machine, 2 virtual nodes x 2 (fake hostnames), CPU. For each ZeRO stage the same
model and data run twice: SYNC chunks issued at the optimizer step only (``serial``: the path before
issue 30) and as DeepSpeed's island buckets finish during backward (``overlap``: the default,
topo_integrations/deepspeed/rail.py). Per step and rank it records the step time (forward + backward
+ step), the time from the end of backward (``engine.backward`` returned) to the end of the last
SYNC chunk (0 when SYNC finished first), and the dispatcher's ``sync_tail_s`` (last SYNC submission
to last SYNC completion). A step's figure is its slowest rank's; the table gives median (min-max)
over the measured steps (the first two are warm-up).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ds_sync_overlap.py --steps 12 --out runs/ds-sync-overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

WARMUP = 2


def _case(rank: int, a: dict, stage: int, overlap: bool) -> dict:
    import torch
    import torch.distributed as dist

    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H

    w = a["width"]
    block = H.topo_block("selective", sync={"top_fraction": 0.2},
                         local={"reconcile_interval": 10**6})  # no reconciliation inside the window
    cfg = H.ds_config(stage, micro=a["batch"], topo=block,
                      zero_optimization={"overlap_comm": True, "reduce_bucket_size": a["bucket"]})
    model = H.Net(d_in=w, width=w, depth=a["depth"], d_out=w)
    eng, *_ = tds.initialize(model=model, optimizer=H.make_optimizer("adamw", model.parameters()), config=cfg)
    rail = eng.optimizer.topo_rail
    rail.overlap = overlap
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(a["steps"] + WARMUP):
        x = torch.randn(a["batch"], w, generator=g)
        y = torch.tanh(x)
        dist.barrier()
        t0 = time.perf_counter()
        loss = eng(x, y)
        eng.backward(loss)
        t_bwd = time.perf_counter()
        eng.step()
        t1 = time.perf_counter()
        fig = rail.figures[-1]
        tail = eng.topo_align.engine.dispatcher.schedule[-1]["sync_tail_s"]
        if step >= WARMUP:
            rows.append([t1 - t0, max(0.0, fig["t_sync_end"] - t_bwd), tail, fig["early"] / fig["chunks"]])
    chunks = rail.figures[-1]["chunks"]
    eng.destroy()
    import deepspeed.utils.groups as dg

    dg.mpu = None  # the next engine must not inherit this one's island mpu
    return {"rows": rows, "chunks": chunks}


def _rank_main(rank: int, world: int, a: dict) -> dict:
    warnings.filterwarnings("ignore")
    os.environ["TOPO_ALIGN_HOSTNAME"] = f"vnode{rank // 2}"
    from topo_integrations.deepspeed import harness as H

    H.prepare_cpu()
    return {f"{stage}/{'overlap' if ov else 'serial'}": _case(rank, a, stage, ov)
            for stage in a["stages"] for ov in (False, True)}


def _spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    xs = [x * scale for x in xs]
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps per case (after 2 warm-up steps)")
    ap.add_argument("--stages", default="1,2", help="ZeRO stages, comma-separated (1, 2)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket", type=int, default=300_000, help="DeepSpeed reduce_bucket_size (elements)")
    ap.add_argument("--out", default=None, help="write per-step, per-rank figures as JSON")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if not set(stages) <= {1, 2} or args.steps < 1:
        print("ds_sync_overlap: --stages takes 1 and/or 2, --steps at least 1", file=sys.stderr)
        return 2
    a = dict(vars(args), stages=stages)
    from topo_integrations.testing import run_world

    t0 = time.time()
    out = run_world(4, _rank_main, a, timeout=1800, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    print(f"4 gloo ranks (2 virtual nodes x 2), CPU; model {args.depth} x {args.width}, batch {args.batch}, "
          f"bucket {args.bucket}; {args.steps} steps per case; {time.time() - t0:.0f} s")
    print("| ZeRO | SYNC issued | chunks | step s | backward end -> SYNC end, ms | sync_tail_s, ms | early |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for key in out[0]:
        per_rank = [o[key]["rows"] for o in out]
        slowest = [[max(r[s][k] for r in per_rank) for k in range(3)] for s in range(len(per_rank[0]))]
        early = min(r[s][3] for r in per_rank for s in range(len(r)))
        cols = list(zip(*slowest))
        stage, mode = key.split("/")
        summary[key] = {"step_s": cols[0], "exposed_s": cols[1], "sync_tail_s": cols[2], "early_min": early}
        chunks = max(o[key]["chunks"] for o in out)
        print(f"| {stage} | {mode} | {chunks} | {_spread(cols[0])} | {_spread(cols[1], 1e3, '{:.1f}')} "
              f"| {_spread(cols[2], 1e3, '{:.1f}')} | {early:.0%} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": a, "summary": summary,
                                              "per_rank": [{k: v["rows"] for k, v in o.items()} for o in out]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
