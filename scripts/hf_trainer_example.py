"""Hugging Face Trainer (or accelerate) + DeepSpeed + a "topo_align" block, on CPU ranks.

A tiny Llama causal LM (built from a config, nothing downloaded) trains on synthetic tokens through
``transformers.Trainer(args=TrainingArguments(deepspeed=CONFIG))``, or through a plain
``accelerate`` loop with ``--front accelerate``. The only topo-align line is
``topo_integrations.deepspeed.install()`` (README.md, "Hugging Face Trainer and Accelerate").

    python scripts/hf_trainer_example.py --config configs/hf/zero2-selective.json
        # starts 4 gloo ranks itself, as 2 virtual nodes x 2 ranks (fake hostnames)
    torchrun --standalone --nproc_per_node 4 scripts/hf_trainer_example.py --config ... --virtual-nodes 2
        # under a launcher: one process per rank, started by it

Rank 0 prints the engine, the loss and the slow-tier bytes against a flat all-reduce's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="DeepSpeed JSON config with a \"topo_align\" block")
    ap.add_argument("--front", choices=("trainer", "accelerate"), default="trainer")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when no launcher started this script")
    ap.add_argument("--virtual-nodes", type=int, default=2,
                    help="pretend the ranks sit on this many hosts (0: the real hostnames)")
    ap.add_argument("--dry-run", action="store_true", help="validate the config's block and exit")
    return ap.parse_args(argv)


def rank_main(rank: int, world: int, a: argparse.Namespace) -> dict:
    """One rank: fake hostname, install the hook, train, return what rank 0 reports."""
    if a.virtual_nodes:
        from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

        os.environ[HOSTNAME_ENV] = f"vnode{rank * a.virtual_nodes // world}"
    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness, hf_harness

    harness.prepare_cpu()
    tds.install()  # the one line: Trainer / Accelerator's deepspeed.initialize now honour the block
    model = hf_harness.tiny_causal_lm()
    t0 = time.perf_counter()
    if a.front == "trainer":
        with tempfile.TemporaryDirectory() as out:
            trainer = hf_harness.train_trainer(model, a.config, out, a.steps)
        engine, loss = trainer.model_wrapped, trainer.state.log_history[-1]["train_loss"]
    else:
        engine, _, losses = hf_harness.train_accelerate(model, a.config, a.steps)
        loss = losses[-1]
    seconds = time.perf_counter() - t0
    n = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    report = {"engine": type(engine).__name__, "seconds": round(seconds, 1), "loss": round(loss, 4), "params": n,
              "flat_inter_bytes": 4 * n * a.steps}  # one fp32 all-reduce of every gradient per step
    if hasattr(engine, "topo_align_stats"):
        stats = engine.topo_align_stats()
        report.update(mode=engine.topo_align.cfg.mode, inter_bytes=sum(stats["total"]["bytes"]["inter"].values()))
    return report


def main(argv=None) -> int:
    a = parse(argv)
    a.config = str(Path(a.config).resolve())
    import topo_integrations.deepspeed as tds

    block = tds.read_block(json.loads(Path(a.config).read_text()))  # a bad block stops here, named
    if os.environ.get("RANK", "0") == "0":
        print(f"config {a.config}: topo_align {'absent' if block is None else block.mode}; front {a.front}, "
              f"{a.steps} steps, {a.virtual_nodes or 'real'} nodes")
    if a.dry_run:
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ:  # torchrun / deepspeed / accelerate launch started this process
        import torch.distributed as dist

        dist.init_process_group("gloo")
        reports = [rank_main(dist.get_rank(), dist.get_world_size(), a)]
        if dist.get_rank():
            return 0
    else:
        from topo_integrations.testing import run_world

        reports = run_world(a.nproc, rank_main, a, timeout=900, env={"OMP_NUM_THREADS": "1"})
    print(json.dumps(reports[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
