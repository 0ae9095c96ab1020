"""Shared by test_pretrain_deepspeed.py and test_pretrain_megatron.py: one 4-rank world runs an
entry point in every mode plus a stop/resume trio, briefly (tiny GPT, 32-token samples).

The world starts once per module (imports of DeepSpeed and megatron-core cost seconds per rank on
2 cores); each run's summary, or its traceback, comes back per rank and the tests assert on them
and on the files the runs wrote.
"""

from __future__ import annotations

import csv
import os
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = os.path.join(ROOT, "configs", "topologies", "virtual-2x2.json")

# Small and fast: a 1.5 MB slice of the corpus, 2 x 32 tokens per rank per step.
BASE = ["--micro-batch-size", "2", "--seq-length", "32", "--eval-batches", "1", "--eval-interval", "2",
        "--log-interval", "1", "--warmup-steps", "1", "--virtual-nodes", "2", "--corpus-max-bytes", "1500000",
        "--lr", "1e-3"]

RUNS = {
    # The selective run doubles as the uninterrupted reference of the resume trio below.
    "selective": ["--train-steps", "6", "--save-interval", "2"],
    # Islands from the topology file (node0: ranks 0-1, node1: ranks 2-3) instead of virtual hostnames.
    "hierarchical": ["--train-steps", "4", "--save-interval", "0", "--topo-align-mode", "hierarchical",
                     "--no-tensorboard", "--virtual-nodes", "0", "--topology", TOPOLOGY],
    "flat": ["--train-steps", "4", "--save-interval", "0", "--topo-align-mode", "flat", "--no-tensorboard"],
    "stock": ["--train-steps", "4", "--save-interval", "0", "--no-topo-align", "--no-tensorboard"],
    # A run that stops after step 5 (its last checkpoint: step 4), then its --resume, which must redo
    # step 5 and continue exactly like the uninterrupted selective run.
    "killed": ["--train-steps", "6", "--save-interval", "2", "--stop-after", "5", "--no-tensorboard"],
    "resumed": ["--train-steps", "6", "--save-interval", "2", "--resume", "--no-tensorboard"],
}
STEPS = {"selective": 6}
RUN_NAMES = {"killed": "res", "resumed": "res"}


def rank_main(rank: int, world: int, module: str, runs_dir: str) -> dict:
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    entry = importlib.import_module(module)
    out: dict = {}
    for name, extra in RUNS.items():
        t0 = time.perf_counter()
        argv = [*BASE, "--runs-dir", runs_dir, "--run-name", RUN_NAMES.get(name, name), *extra]
        try:
            if "deepspeed" in module:
                import deepspeed.utils.groups as dg

                dg.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global
            out[name] = entry.run(entry.build_parser().parse_args(argv))
        except BaseException:  # noqa: BLE001 - reported by the test that needs this run
            out[name] = {"error": traceback.format_exc()}
        out.setdefault("_times", {})[name] = round(time.perf_counter() - t0, 2)
    return out


def csv_losses(path: str) -> dict[int, float]:
    with open(path, newline="", encoding="utf-8") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh) if r["loss"]}


def ok(results: list[dict], name: str) -> dict:
    for r in results:
        assert "error" not in r[name], r[name]["error"]
    return results[0][name]


def assert_mode_runs(results: list[dict], runs_dir: str, name: str, *, reducer: bool) -> None:
    s = ok(results, name)
    steps = STEPS.get(name, 4)
    assert s["steps"] == steps and s["first_val_loss"] > s["final_val_loss"]
    assert all(r[name]["final_val_loss"] == s["final_val_loss"] for r in results)  # one number, every rank
    assert s["topo_active"] is reducer  # flat and stock leave the reduction to the framework
    if reducer:
        assert s["bytes_per_step"]["inter"] > 0
        assert s["inter_group_bytes_per_step"] < s["flat_allreduce_bytes_per_step"]
    else:
        assert s["bytes_per_step"] == {} and s["inter_vs_flat"] is None
    run_dir = os.path.join(runs_dir, name)
    assert sorted(csv_losses(os.path.join(run_dir, "metrics.csv"))) == list(range(1, steps + 1))
    assert os.path.isfile(os.path.join(run_dir, "summary.json"))
