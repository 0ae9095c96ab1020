"""GPT pretraining under DeepSpeed with topo-align: ``python -m topo_integrations.train.pretrain_deepspeed``.

Launched by ``scripts/pretrain_gpt_deepspeed.sh`` (torchrun). The model is :class:`~.model.GPT`,
the optimizer a client ``torch.optim.AdamW`` (no JIT-compiled op on CPU), and the engine comes from
``topo_integrations.deepspeed.initialize`` with the flags' "topo_align" block in the DeepSpeed config;
``--no-topo-align`` builds a stock engine from the same config without the block (the baseline).

Per step: 1. each micro-batch: forward, ``engine.backward`` (gradients reduced per the mode),
``engine.step`` (optimizer on the accumulation boundary); 2. the mean loss over ranks (one scalar
all-reduce) for the progress bar; 3. every ``--eval-interval`` steps a validation pass; 4. every
``--save-interval`` steps ``engine.save_checkpoint`` (the adapter reconciles replicas and saves its
reducer state with it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from ..config import Mode
from . import common
from .common import UsageError
from .metrics import TrainLogger
from .model import GPT, preset

__all__ = ["main", "build_parser", "ds_config"]


def build_parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(prog="pretrain_deepspeed", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_common_args(ap)
    g = ap.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed-config", default=None, metavar="FILE",
                   help="a DeepSpeed JSON config to start from (batch sizes and clipping are set from the flags; "
                        "its \"topo_align\" block is used unless --topo-align-config/flags override it)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default 0; topo-align: hierarchical at 0-3, selective at 0-2)")
    return ap


def ds_config(args: argparse.Namespace, world: int, block: dict | None) -> dict:
    """The DeepSpeed config for this run: the user's file (if any) with the flags' settings on top."""
    cfg: dict = {}
    if args.deepspeed_config:
        from ..config import load_json_file

        cfg = load_json_file(args.deepspeed_config, what="DeepSpeed config")
        if not isinstance(cfg, dict):
            raise UsageError(f"--deepspeed-config {args.deepspeed_config!r}: expected a JSON object")
        cfg = dict(cfg)
    cfg.pop("topo_align", None)
    cfg.update({
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch_size * args.grad_accum * world,
        "gradient_clipping": args.clip_grad,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    })
    if args.zero_stage is not None:
        cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": args.zero_stage}
    cfg.setdefault("zero_optimization", {"stage": 0})
    if cfg["zero_optimization"].get("stage", 0) > 0:
        cfg["zero_allow_untested_optimizer"] = True  # the client AdamW (avoids the fused_adam JIT on CPU)
    if block is not None:
        cfg["topo_align"] = block
    return cfg


def _file_block(args: argparse.Namespace) -> None:
    """A "topo_align" block inside --deepspeed-config counts as --topo-align-config."""
    if args.deepspeed_config and not args.topo_align_config:
        from ..config import load_json_file

        data = load_json_file(args.deepspeed_config, what="DeepSpeed config")
        if isinstance(data, dict) and "topo_align" in data:
            args.topo_align_config = args.deepspeed_config


def stats_fn(engine):
    """``engine.topo_align_stats`` when the adapter drives this engine, else None (stock engine)."""
    if getattr(engine, "topo_align", None) is not None and hasattr(engine, "topo_align_stats"):
        return engine.topo_align_stats
    return None


def _on(engine, b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = engine.device
    return b["tokens"].to(dev), b["labels"].to(dev), b["loss_mask"].to(dev)


def evaluate(engine, batches: list[dict], world: int) -> float:
    """Mean validation loss over ``batches`` on every rank, averaged over ranks (one all-reduce)."""
    engine.eval()
    with torch.no_grad():
        total = sum(float(engine(*_on(engine, b))) for b in batches) / len(batches)
    engine.train()
    t = torch.tensor([total], dtype=torch.float64, device=engine.device)
    dist.all_reduce(t)
    return float(t.item()) / world


def _initialize(model, optimizer, config: dict, block: dict | None):
    if block is None:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, optimizer
    from .. import deepspeed as ta_deepspeed

    engine, optimizer, _, _ = ta_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, optimizer


def check(args: argparse.Namespace) -> dict | None:
    """Everything about the flags that can be refused without starting a process group."""
    common.check_args(args)
    _file_block(args)
    # The DeepSpeed adapter reconciles synchronously (it says so once per rank when asked for async).
    block = common.topo_block(args, defaults={"local.async_reconcile": False})
    preset(args.model, seq_length=args.seq_length)
    common.run_paths(args, "deepspeed", block)
    if args.deepspeed_config:
        ds_config(args, 1, block)
    return block


def run(args: argparse.Namespace) -> dict:
    """Train per ``args`` in an initialized (or to-be-initialized) process group; returns the summary."""
    block = check(args)  # validated before any process starts waiting for the others
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # DeepSpeed's INFO lines would bury the progress bar
    try:
        from ..deepspeed.compat import skip_shm_comm_build

        skip_shm_comm_build()
    except ImportError:
        pass

    def init_fn(backend, timeout):
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)

    rank, world, backend = common.init_distributed(args, init_fn=init_fn)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    paths = common.run_paths(args, "deepspeed", block)
    gcfg = preset(args.model, seq_length=args.seq_length)

    prefix, global_batch, train, valid = common.train_valid_batches(
        args, paths, gcfg.seq_length, rank, world, rank)

    torch.manual_seed(args.seed)
    model = GPT(gcfg)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    config = ds_config(args, world, block)
    engine, optimizer = _initialize(model, optimizer, config, block)
    stats = stats_fn(engine)

    start_step, val_history = 0, []
    if args.resume:
        latest = os.path.join(paths.ckpt_dir, "latest")
        if os.path.isfile(latest):
            load_path, client = engine.load_checkpoint(paths.ckpt_dir)
            if load_path is None:
                raise common.UsageError(f"--resume: could not load the checkpoint named in {latest}")
            start_step, val_history = int(client["step"]), list(client.get("val_history", []))
        elif rank == 0:
            print(f"--resume: no checkpoint in {paths.ckpt_dir}; starting at step 0", flush=True)
    elif rank == 0 and os.path.isdir(paths.ckpt_dir):
        shutil.rmtree(paths.ckpt_dir)  # a fresh run must never resume from an older run's files
    dist.barrier()

    mode = block["mode"] if block else "stock"
    topo_active = stats is not None
    # The adapter hands a one-tier topology back to DeepSpeed (and says why in its log).
    shown = mode if topo_active or mode in (Mode.FLAT, "stock") else f"{mode}, inactive: DeepSpeed's own reduction"
    if topo_active and mode == Mode.SELECTIVE:
        shown = f"{mode} ({common.selective_label([stats()])})"
    label = f"deepspeed, {shown}, {args.model} ({n_params / 1e6:.2f}M params), {world} ranks, {backend}"
    tokens_per_step = global_batch * gcfg.seq_length
    flat_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    log = TrainLogger(paths.run_dir, rank=rank, total_steps=args.train_steps, start_step=start_step,
                      tokens_per_step=tokens_per_step, flat_bytes=flat_bytes, log_interval=args.log_interval,
                      tensorboard=not args.no_tensorboard, label=label)
    if rank == 0:
        os.makedirs(paths.run_dir, exist_ok=True)
        with open(os.path.join(paths.run_dir, "config.json"), "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "deepspeed_config": config, "model": gcfg.to_dict(),
                       "dataset": prefix, "world_size": world}, fh, indent=2, default=str)
    log.note(f"{label}; run folder {paths.run_dir}; data {prefix}")
    if start_step:
        log.restore(val_history)
        log.note(f"resumed from the checkpoint of step {start_step}")
    log.baseline(stats() if stats is not None else None)

    def validate(step: int) -> None:
        log.eval(step, evaluate(engine, valid, world))

    if start_step == 0:
        validate(0)
    step = start_step
    for step in range(start_step + 1, args.train_steps + 1):
        lr = common.lr_at(step - 1, args)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss_sum = 0.0
        for m in range(args.grad_accum):
            loss = engine(*_on(engine, train.micro(step - 1, m)))
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach())
        dt = time.perf_counter() - t0
        t = torch.tensor([loss_sum / args.grad_accum], dtype=torch.float64, device=engine.device)
        dist.all_reduce(t)
        log.step(step, float(t.item()) / world, lr, dt, stats() if stats is not None else None)
        if step % args.eval_interval == 0 or step == args.train_steps:
            validate(step)
        if args.stop_after is not None and step >= args.stop_after:
            log.note(f"--stop-after {args.stop_after}: stopping without a final checkpoint")
            log.close()
            return {"stopped_at": step}
        if (args.save_interval and step % args.save_interval == 0) or step == args.train_steps:
            engine.save_checkpoint(
                paths.ckpt_dir, tag=f"step_{step:07d}", client_state={"step": step, "val_history": log.val_history}
            )
            if rank == 0:
                _prune(paths.ckpt_dir, keep=2)
    summary = log.summary(steps_done=step, extra={"framework": "deepspeed", "mode": mode, "model": args.model,
                                                  "params": n_params, "world_size": world, "backend": backend,
                                                  "run_dir": paths.run_dir, "topo_active": topo_active})
    log.close(summary, paths.run_dir)
    return summary


def _prune(ckpt_dir: str, keep: int) -> None:
    tags = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step_") and os.path.isdir(os.path.join(ckpt_dir, n)))
    for old in tags[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    common.quiet_known_warnings()
    return common.run_main(build_parser().parse_args(argv), check, run)


if __name__ == "__main__":
    sys.exit(main())
