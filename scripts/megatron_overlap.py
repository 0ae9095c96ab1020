"""How much of a step's LOCAL communication leaves during backward, Megatron DDP with overlap.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/megatron_overlap.py --steps 20 --repeats 2

4 gloo ranks on CPU as 2 virtual nodes x 2 (``TOPO_ALIGN_HOSTNAME``), a real megatron-core
GPTModel (``topo_integrations.megatron.testing``), `TopoAlignDDP` in `selective` with
``--overlap-grad-reduce`` (plain DDP, 2 microbatches). Every rank records, per step
(`ReleaseProbe`): the step time (forward, backward, reduction, optimizer step), how many LOCAL
collectives were released to the issuing thread and how many had started before Megatron's
``finish_grad_sync`` began (the end of backward), and the tail from there to the completion of
the step's last gradient collective. Prints the median over steps 2.. and ranks, per repeat, and
writes the raw numbers with ``--json``. Emulated: islands share one host, no slow link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(rank: int, world: int, steps: int, a: dict) -> list[dict]:
    import os

    os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank // 2}"
    import torch

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.megatron import cpu_compat

    cpu_compat.apply()
    from topo_integrations.megatron.testing import (
        ReleaseProbe,
        TinyGPT,
        build_gpt,
        init_parallel,
        make_optimizer,
        run_iteration,
        wrap_ddp,
    )

    torch.set_num_threads(1)
    cfg = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "top_fraction": a["top_fraction"]},
        # no drift promotion: the SYNC set stays the one chosen at start, the same in every run
        "local": {"reconcile_interval": 4, "async_reconcile": True, "promote_drift_fraction": 0.0},
        "importance": {"refresh_interval": 100000}})
    spec = TinyGPT(num_layers=a["layers"], hidden_size=a["hidden"], seq_length=a["seq_length"],
                   micro_batch_size=a["micro_batch"])
    init_parallel(1)
    model, mcfg = build_gpt(spec)
    ddp = wrap_ddp(model, mcfg, topo=cfg, overlap_grad_reduce=True, bucket_size=a["bucket_size"])
    opt = make_optimizer(ddp)
    probe = ReleaseProbe(ddp)
    recs = []
    for step in range(steps):
        probe.start()
        t0 = time.perf_counter()
        run_iteration(ddp, spec, rank, step, opt)
        rec = probe.step()
        rec["step_s"] = time.perf_counter() - t0
        rec["bucket_groups"] = len(ddp.bucket_groups)
        recs.append(rec)
    ddp.topo_close()
    return recs


def summary(per_rank: list[list[dict]]) -> dict:
    rows = [r for recs in per_rank for r in recs[2:]]  # step 0: first batch; step 1: warm-up

    def med(key):
        return statistics.median(r[key] for r in rows)

    return {"step_ms": 1000 * med("step_s"), "tail_ms": 1000 * med("tail_s"), "local": med("local"),
            "local_released_before": med("local_released_before"), "local_started_before": med("local_started_before"),
            "sync": med("sync"), "bucket_groups": rows[0]["bucket_groups"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bucket-size", type=int, default=40000, help="Megatron's --ddp-bucket-size (elements)")
    ap.add_argument("--top-fraction", type=float, default=0.15, help="sync.top_fraction (SYNC by importance)")
    ap.add_argument("--json", help="write the per-rank, per-step records here")
    a = ap.parse_args()
    from topo_integrations.testing import run_world

    runs = []
    for rep in range(a.repeats):
        per_rank = run_world(4, worker, a.steps, vars(a), timeout=1800,
                             env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        s = summary(per_rank)
        runs.append({"summary": s, "ranks": per_rank})
        print(f"repeat {rep}: step {s['step_ms']:.0f} ms, tail after backward {s['tail_ms']:.1f} ms, "
              f"LOCAL collectives {s['local']:g} per step: released before the end of backward "
              f"{s['local_released_before']:g}, started before it {s['local_started_before']:g} "
              f"(SYNC {s['sync']:g}, {s['bucket_groups']} bucket groups)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
