"""accelerate (DDP or FSDP2) or the Trainer, with ``topo_integrations.hf.install(CONFIG)``, on CPU ranks.

A tiny Llama causal LM (built from a config, nothing downloaded) trains on synthetic tokens in a plain
accelerate loop (``--front accelerate``: ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``)
or through ``transformers.Trainer`` (``--front trainer``); the only topo-align line is
``topo_integrations.hf.install(CONFIG)`` (docs/hf.md). ``--compare-stock`` first trains the same steps
without topo-align and reports the largest parameter difference.

    accelerate launch --config_file configs/hf/accelerate-ddp.yaml scripts/hf_accelerate_example.py \\
        --config configs/hf/topo-align-hierarchical.json --virtual-nodes 2
    python scripts/hf_accelerate_example.py --config ...     # starts 4 gloo ranks itself

``--virtual-nodes N`` gives each rank a fake hostname (``TOPO_ALIGN_HOSTNAME``, N hosts) so that one
machine looks like N nodes. Rank 0 prints one JSON report (``--out FILE`` writes it too).
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
    ap.add_argument("--config", required=True, help="JSON file with the \"topo_align\" block")
    ap.add_argument("--front", choices=("accelerate", "trainer"), default="accelerate")
    ap.add_argument("--model", choices=("llama", "tiny"), default="llama",
                    help="llama: a tiny transformers Llama; tiny: a torch-only LM (starts faster; accelerate front)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation micro-steps")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when no launcher started this script")
    ap.add_argument("--virtual-nodes", type=int, default=2,
                    help="pretend the ranks sit on this many hosts (0: the real hostnames)")
    ap.add_argument("--compare-stock", action="store_true", help="train without topo-align first and compare")
    ap.add_argument("--out", help="also write rank 0's report to this JSON file")
    ap.add_argument("--dry-run", action="store_true", help="validate the config and exit")
    return ap.parse_args(argv)


def run(a: argparse.Namespace, out_dir: str):
    """One training run on this rank; returns (model, losses, attached record or None)."""
    import topo_integrations.hf as thf
    from topo_integrations.deepspeed.hf_harness import SyntheticTokens, tiny_causal_lm, training_args
    from topo_integrations.hf import harness

    if a.front == "accelerate":
        model = harness.TinyLM() if a.model == "tiny" else tiny_causal_lm()
        model, _, losses = harness.train_loop(harness.cpu_accelerator(gradient_accumulation_steps=a.accum),
                                              model, a.steps)
        return model, losses, thf.attached(model)
    from transformers import Trainer

    harness.cpu_accelerator()  # forget the previous run's accelerate state
    args = training_args(out_dir, None, a.steps, gradient_accumulation_steps=a.accum, logging_strategy="steps",
                         logging_steps=1, max_grad_norm=1.0)
    trainer = Trainer(model=tiny_causal_lm(), args=args, train_dataset=SyntheticTokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.model_wrapped, losses, thf.attached(trainer.model_wrapped)


def rank_main(rank: int, world: int, a: argparse.Namespace) -> dict:
    if a.virtual_nodes:
        from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

        os.environ[HOSTNAME_ENV] = f"vnode{rank * a.virtual_nodes // world}"
    import topo_integrations.hf as thf
    from topo_integrations.hf import harness

    report: dict = {"world": world, "front": a.front}
    with tempfile.TemporaryDirectory() as tmp:
        if a.compare_stock:
            model, losses, _ = run(a, os.path.join(tmp, "stock"))
            report["stock_losses"] = losses
            stock = harness.flat_params(model)
        thf.install(a.config)
        t0 = time.perf_counter()
        model, losses, att = run(a, os.path.join(tmp, "topo"))
        report.update(seconds=round(time.perf_counter() - t0, 1), losses=losses, model=type(model).__name__)
        if a.compare_stock:
            report["max_param_diff_vs_stock"] = float((harness.flat_params(model) - stock).abs().max())
    report["path"] = None if att is None else att.path
    report["figures"] = None if att is None else att.figures()
    return report


def main(argv=None) -> int:
    a = parse(argv)
    a.config = str(Path(a.config).resolve())
    import topo_integrations.hf as thf

    cfg = thf.read_config(a.config)  # a bad block stops here, named
    if os.environ.get("RANK", "0") == "0":
        print(f"config {a.config}: mode {cfg.mode}; front {a.front}, {a.steps} steps x {a.accum} micro-steps, "
              f"{a.virtual_nodes or 'real'} nodes", flush=True)
    if a.dry_run:
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ:  # accelerate launch / torchrun started this process
        import torch.distributed as dist

        dist.init_process_group("gloo")
        report = rank_main(dist.get_rank(), dist.get_world_size(), a)
        if dist.get_rank():
            return 0
    else:
        from topo_integrations.testing import run_world

        report = run_world(a.nproc, rank_main, a, timeout=900, env={"OMP_NUM_THREADS": "1"})[0]
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
