"""GPT pretraining with megatron-core and topo-align: ``python -m topo_integrations.train.pretrain_megatron``.

Launched by ``scripts/pretrain_gpt_megatron.sh`` (torchrun). The megatron-core wheel ships no
``megatron.training``, so this is a compact megatron-core training loop: ``GPTModel`` (local layer
spec), ``TopoAlignDDP`` (stock ``DistributedDataParallel`` with ``--no-topo-align``),
``get_megatron_optimizer`` and the pipeline schedule's ``forward_backward_func``, on the same
indexed dataset and with the same flags, logging and checkpoint cadence as the DeepSpeed script.
On a machine without CUDA the CPU compatibility layer (``topo_integrations.megatron.cpu_compat``)
is applied first. With ``--megatron-lm DIR`` it runs Megatron-LM's own ``pretrain_gpt.py`` from
that checkout instead, with the plugin installed (``python -m topo_integrations.megatron``).

Per step: 1. zero the grad buffers; 2. ``forward_backward_func`` over ``--grad-accum``
micro-batches (TopoAlignDDP reduces each bucket per the mode from the backward hooks, then
``finish_grad_sync``); 3. ``optimizer.step()`` (global clip norm; reconciliation when due); 4. the
mean loss over ranks (one scalar all-reduce); then validation and per-rank checkpoints on their
intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from ..config import Mode
from . import checkpoint as ckpt
from . import common
from .common import UsageError
from .metrics import TrainLogger
from .model import preset

__all__ = ["main", "build_parser"]

PADDED_VOCAB = 264  # the byte tokenizer's 258 ids, padded to a multiple of 8 (and of small TP sizes)


def build_parser() -> argparse.ArgumentParser:
    from ..megatron import add_topo_align_args
    from ..megatron.layout import mark_derivable

    ap = common.ArgumentParser(prog="pretrain_megatron", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_common_args(ap, topo_flags=False)
    add_topo_align_args(ap)
    # topo-align is on by default in the launch scripts (as in the DeepSpeed one); --no-topo-align is stock.
    ap.set_defaults(topo_align=True)
    g = ap.add_argument_group("Megatron")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state (with topo-align: one optimizer instance per topology group)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="optimizer instances; unset with topo-align: the number of topology groups")
    g.add_argument("--bucket-size", type=int, default=None, help="DDP bucket size in elements (default: Megatron's)")
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce all buckets after backward instead of from the backward hooks")
    g.add_argument("--megatron-lm", default=None, metavar="DIR",
                   help="run Megatron-LM's pretrain_gpt.py from this checkout (with the plugin installed) "
                        "instead of this script's loop; the remaining arguments are Megatron-LM's")
    mark_derivable(ap)  # unset --num-distributed-optimizer-instances: derived in run() (megatron/layout.py)
    return ap


def _block(args: argparse.Namespace) -> dict | None:
    from ..megatron.flags import FLAG_FIELDS

    if args.no_topo_align:
        return None
    explicit = {field for dest, field in FLAG_FIELDS.items() if getattr(args, dest, None) is not None}
    return common.topo_block(args, base=args.topo_align_resolved, explicit=explicit)


def _causal_mask(seq: int) -> torch.Tensor:
    # Megatron's convention: True where attention is NOT allowed.
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Masked mean of the per-token losses GPTModel returns when given labels."""
    mask = loss_mask.reshape(-1).float()
    loss = (output.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def check(args: argparse.Namespace) -> dict | None:
    """Everything about the flags that can be refused without starting a process group."""
    common.check_args(args)
    if args.tensor_model_parallel_size < 1:
        raise UsageError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: must be at least 1")
    block = _block(args)
    preset(args.model, seq_length=args.seq_length)
    common.run_paths(args, "megatron", block)
    return block


def run(args: argparse.Namespace) -> dict:
    block = check(args)  # validated before any process starts waiting for the others
    from ..megatron import cpu_compat

    cpu_compat.apply()  # no-op when CUDA is available
    from megatron.core import parallel_state as ps

    rank, world, backend = common.init_distributed(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    tp = args.tensor_model_parallel_size
    if tp < 1 or world % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp}: must divide the world size {world}")
    paths = common.run_paths(args, "megatron", block)
    gcfg = preset(args.model, seq_length=args.seq_length)
    _derive_layout(args, block, tp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    try:
        return _train(args, rank, world, backend, tp, block, paths, gcfg)
    finally:
        ps.destroy_model_parallel()


def _derive_layout(args: argparse.Namespace, block: dict | None, tp: int) -> None:
    """An unset --num-distributed-optimizer-instances becomes the number of topology groups with
    topo-align and the distributed optimizer (megatron/layout.py; logged once on rank 0)."""
    from ..config import TopoAlignConfig
    from ..megatron.layout import derive_layout

    derive_layout(args, TopoAlignConfig.from_block(block) if block is not None else None, model_parallel_size=tp)


def _train(args, rank, world, backend, tp, block, paths, gcfg) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    prefix, global_batch, train, valid = common.train_valid_batches(
        args, paths, gcfg.seq_length, rank, dp_size, dp_rank)

    on_gpu = torch.cuda.is_available()
    tcfg = TransformerConfig(
        num_layers=gcfg.num_layers, hidden_size=gcfg.hidden, num_attention_heads=gcfg.heads,
        ffn_hidden_size=gcfg.ffn_mult * gcfg.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not on_gpu, tensor_model_parallel_size=tp, init_method_std=0.02,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB,
                     max_sequence_length=gcfg.seq_length, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False)
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    n_params = sum(p.numel() for p in model.parameters())
    ddp_kwargs = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                      use_distributed_optimizer=args.use_distributed_optimizer,
                      num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    if args.bucket_size:
        ddp_kwargs["bucket_size"] = args.bucket_size
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    if block is not None:
        from ..config import TopoAlignConfig
        from ..megatron import TopoAlignDDP

        ddp = TopoAlignDDP(tcfg, ddp_config, model, topo_align=TopoAlignConfig.from_block(block))
    else:
        ddp = DistributedDataParallel(tcfg, ddp_config, model)
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr * args.min_lr_ratio,
                              weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                              clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    topo_active = bool(getattr(ddp, "topo_active", False))
    if topo_active:
        from ..megatron import prepare_optimizer

        optimizer = prepare_optimizer(optimizer, [ddp])
    stats = ddp.topo_stats if topo_active else None

    start_step, val_history = 0, []
    if args.resume:
        step0 = ckpt.latest_step(paths.ckpt_dir)
        if step0 is not None:
            state = ckpt.load(paths.ckpt_dir, step0)
            ddp.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if topo_active and state.get("topo"):
                ddp.load_topo_state_dict(state["topo"])
            start_step, val_history = step0, list(state.get("val_history", []))
        elif rank == 0:
            print(f"--resume: no checkpoint in {paths.ckpt_dir}; starting at step 0", flush=True)
    elif rank == 0 and os.path.isdir(paths.ckpt_dir):
        shutil.rmtree(paths.ckpt_dir)  # a fresh run must never resume from an older run's files
    dist.barrier()

    mode = block["mode"] if block else "stock"
    reason = getattr(ddp, "topo_reason", "stock DistributedDataParallel")
    shown = mode if topo_active or mode in (Mode.FLAT, "stock") else f"{mode}, inactive: {reason}"
    if topo_active and mode == Mode.SELECTIVE:
        shown = f"{mode} ({common.selective_label(ddp.topo_stats()['engines'])})"
    label = (f"megatron-core, {shown}, {args.model} ({n_params / 1e6:.2f}M params), {world} ranks "
             f"(tp {tp}, dp {dp_size}), {backend}")
    tokens_per_step = global_batch * gcfg.seq_length
    flat_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    log = TrainLogger(paths.run_dir, rank=rank, total_steps=args.train_steps, start_step=start_step,
                      tokens_per_step=tokens_per_step, flat_bytes=flat_bytes, log_interval=args.log_interval,
                      tensorboard=not args.no_tensorboard, label=label)
    if rank == 0:
        os.makedirs(paths.run_dir, exist_ok=True)
        with open(os.path.join(paths.run_dir, "config.json"), "w", encoding="utf-8") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "topo_align_resolved"},
                       "topo_align": block, "model": gcfg.to_dict(), "dataset": prefix, "world_size": world},
                      fh, indent=2, default=str)
    log.note(f"{label}; run folder {paths.run_dir}; data {prefix}")
    if start_step:
        log.restore(val_history)
        log.note(f"resumed from the checkpoint of step {start_step}")
    log.baseline(stats() if stats else None)

    mask = _causal_mask(gcfg.seq_length)
    position_ids = torch.arange(gcfg.seq_length).unsqueeze(0)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        mask, position_ids = mask.to(device), position_ids.to(device)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        tokens, labels = b["tokens"].to(device), b["labels"].to(device)
        out = model(tokens, position_ids.expand_as(tokens), mask, labels=labels)
        return out, partial(_loss_func, b["loss_mask"].to(device))

    fb = get_forward_backward_func()

    def evaluate() -> float:
        ddp.eval()
        with torch.no_grad():
            total = 0.0
            for b in valid:
                tokens = b["tokens"].to(device)
                out = ddp(tokens, position_ids.expand_as(tokens), mask, labels=b["labels"].to(device))
                total += float(_loss_func(b["loss_mask"].to(device), out)[0])
        ddp.train()
        t = torch.tensor([total / len(valid)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item()) / world

    if start_step == 0:
        log.eval(0, evaluate())
    step = start_step
    for step in range(start_step + 1, args.train_steps + 1):
        lr = common.lr_at(step - 1, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        micro = iter([train.micro(step - 1, m) for m in range(args.grad_accum)])
        losses = fb(forward_step_func=forward_step, data_iterator=micro, model=[ddp],
                    num_microbatches=args.grad_accum, seq_length=gcfg.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=False)
        ok, _, _ = optimizer.step()
        dt = time.perf_counter() - t0
        mean = sum(float(x["lm loss"]) for x in losses) / max(len(losses), 1)
        t = torch.tensor([mean], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        log.step(step, float(t.item()) / world, lr, dt, stats() if stats else None)
        if step % args.eval_interval == 0 or step == args.train_steps:
            log.eval(step, evaluate())
        if args.stop_after is not None and step >= args.stop_after:
            log.note(f"--stop-after {args.stop_after}: stopping without a final checkpoint")
            log.close()
            return {"stopped_at": step}
        if (args.save_interval and step % args.save_interval == 0) or step == args.train_steps:
            topo_state = None
            if topo_active:
                from ..megatron import prepare_checkpoint

                topo_state = prepare_checkpoint([ddp], optimizer)[0]  # reconciles first (selective)
            ckpt.save(paths.ckpt_dir, step, {"model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
                                             "topo": topo_state, "val_history": log.val_history})
    summary = log.summary(steps_done=step, extra={"framework": "megatron-core", "mode": mode, "model": args.model,
                                                  "params": n_params, "world_size": world, "backend": backend,
                                                  "tensor_parallel": tp, "run_dir": paths.run_dir,
                                                  "topo_active": topo_active, "topo_reason": reason})
    log.close(summary, paths.run_dir)
    return summary


def run_megatron_lm(args: argparse.Namespace, rest: list[str]) -> int:
    """Megatron-LM's ``pretrain_gpt.py`` with the plugin installed, replacing this process (so the
    torchrun rank, its environment and its signals carry over)."""
    if "--virtual-nodes" in rest:
        # Added by the launch script on CPU; Megatron-LM's parser does not know it: the fake hostname
        # it stands for goes into the environment instead.
        i = rest.index("--virtual-nodes")
        nodes = int(rest[i + 1]) if i + 1 < len(rest) and rest[i + 1].isdigit() else 0
        del rest[i:i + 2]
        if nodes:
            from ..reducer.plan.planning import HOSTNAME_ENV

            os.environ[HOSTNAME_ENV] = common.virtual_hostname(
                int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), nodes)
    script = os.path.join(args.megatron_lm, "pretrain_gpt.py")
    if not os.path.isfile(script):
        raise UsageError(f"--megatron-lm {args.megatron_lm!r}: {script} not found; give a Megatron-LM checkout")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.megatron_lm, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "topo_integrations.megatron", script, *rest]
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    common.quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--megatron-lm" in argv:
        # Everything but --megatron-lm DIR belongs to Megatron-LM's own parser.
        i = argv.index("--megatron-lm")
        if i + 1 >= len(argv):
            common.fail("--megatron-lm needs the path of a Megatron-LM checkout")
        ns = argparse.Namespace(megatron_lm=argv[i + 1])
        rest = argv[:i] + argv[i + 2:]
        try:
            if "--check-args" in rest:  # the flags are Megatron-LM's to check; only the tree is ours
                if not os.path.isfile(os.path.join(ns.megatron_lm, "pretrain_gpt.py")):
                    raise UsageError(f"--megatron-lm {ns.megatron_lm!r}: no pretrain_gpt.py there; give a "
                                     "Megatron-LM checkout")
                return 0
            return run_megatron_lm(ns, rest)
        except UsageError as exc:
            common.fail(str(exc))
    return common.run_main(build_parser().parse_args(argv), check, run)


if __name__ == "__main__":
    sys.exit(main())
