"""Rank side of tests/test_hf_integration.py for issue 39 items 2-3: Accelerate's DDP and FSDP2 paths
and the Trainer callback, run in that module's 4-rank world (2 virtual nodes x 2) after its DeepSpeed
sections. Every run is what a user writes: ``topo_integrations.hf.install(BLOCK)``, then an
``Accelerator`` loop or a ``Trainer``; the functions return what the tests assert on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIERARCHICAL = json.loads((ROOT / "configs" / "hf" / "topo-align-hierarchical.json").read_text())
LOCAL = json.loads((ROOT / "configs" / "hf" / "topo-align-selective.json").read_text())
"""A pinned LOCAL class: sync.top_fraction 0.15, last layer SYNC, reconciled every 2 steps."""
STEPS = 4        # accelerate loops: optimizer steps, 2 micro-steps each
TR_STEPS = 6     # Trainer runs: optimizer steps, 2 micro-steps each, a checkpoint at step 3
SAVE_AT = 3


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _listen() -> _Lines:
    h = _Lines()
    logging.getLogger("topo_align").addHandler(h)
    return h


def accelerate_paths(rank, tmp):
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin

    import topo_integrations.hf as thf
    from topo_integrations.deepspeed import hf_harness as HF
    from topo_integrations.hf import harness as AH
    from topo_integrations.torch import ConsistencyError

    def fsdp2():
        return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")

    def run(check=None, keep=False, **kw):
        acc = AH.cpu_accelerator(gradient_accumulation_steps=2, **kw)
        model, _, losses = AH.train_loop(acc, HF.tiny_causal_lm(), STEPS, check=check)
        att = thf.attached(model)
        rec = {"params": AH.flat_params(model), "losses": losses, "model": type(model).__name__,
               "path": att and att.path, "figures": att and att.figures()}
        if keep:
            rec.update(acc=acc, model_obj=model)
        if att is not None and att.path == "ddp":
            rec.update(buckets_reduced=att.adapter.buckets_reduced, ddp_buckets=len(att.adapter.stats()["ddp_buckets"]))
        return rec

    out = {"stock_ddp": run(), "stock_fsdp2": run(fsdp_plugin=fsdp2())}
    lines = _listen()
    thf.install(HIERARCHICAL)
    out["ddp"] = run()
    out["fsdp2"] = run(fsdp_plugin=fsdp2())
    thf.install(LOCAL)
    records: list = []

    def check(model, step):
        att = thf.attached(model)
        try:
            att.adapter.verify_consistency()  # SYNC equal on all ranks, LOCAL inside each island
            err = None
        except ConsistencyError as exc:
            err = str(exc)
        records.append({"step": step, "error": err, "reconciles": att.engine.reconciler.reconciles})

    out["ddp_local"] = dict(run(check=check, keep=True), records=records)
    # accelerate's own checkpoints: save_state reconciles, then writes each rank's engine state
    acc, model = out["ddp_local"].pop("acc"), out["ddp_local"].pop("model_obj")
    att, ckpt = thf.attached(model), os.path.join(tmp, "acc_state")
    acc.save_state(ckpt)
    saved = att.adapter.state_dict()
    att.after_optimizer_step()  # the engine moves on (a step counted) ...
    moved = att.engine.step
    acc.load_state(ckpt)        # ... and comes back
    out["save_state"] = {"files": sorted(os.listdir(os.path.join(ckpt, "topo_align"))), "moved": moved,
                         "saved_step": saved["engine"]["step"], "params": AH.flat_params(model),
                         "same": _same(saved, att.adapter.state_dict())}
    # a path topo-align cannot act on: a DDP comm hook of the user's own
    acc = AH.cpu_accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    model = acc.prepare(HF.tiny_causal_lm())
    out["own_hook"] = {"attached": thf.attached(model) is not None, "model": type(model).__name__}
    out["lines"] = list(lines.lines)
    logging.getLogger("topo_align").removeHandler(lines)
    thf.uninstall()
    return out


def _same(a, b) -> bool:
    """Nested state dicts equal, tensors bitwise."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def trainer_paths(rank, tmp):
    from transformers import Trainer, TrainerCallback

    import topo_integrations.hf as thf
    from topo_integrations.deepspeed import hf_harness as HF
    from topo_integrations.hf import harness as AH

    seen: dict[str, list] = {}

    class Reporter(TrainerCallback):
        """Stands where report_to's integrations stand (after the flow callback): what they would get."""

        def __init__(self, name):
            self.name = name

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.setdefault(self.name, []).append(dict(logs or {}))

    def run(name, resume=None, **kw):
        AH.reset_launch_env()  # the DeepSpeed and FSDP runs before left their plugins' variables
        HF.fresh_accelerate_state()
        args = HF.training_args(os.path.join(tmp, "tr", name), None, TR_STEPS, gradient_accumulation_steps=2,
                                logging_strategy="steps", logging_steps=2, max_grad_norm=1.0, **kw)
        tr = Trainer(model=HF.tiny_causal_lm(), args=args, train_dataset=HF.SyntheticTokens(),
                     callbacks=[Reporter(name)])
        tr.train(resume_from_checkpoint=resume)
        return {"params": AH.flat_params(tr.model_wrapped), "history": tr.state.log_history,
                "callbacks": [type(c).__name__ for c in tr.callback_handler.callbacks],
                "model": type(tr.model_wrapped).__name__}

    out = {"stock": run("stock")}
    lines = _listen()
    thf.install(LOCAL)
    ckpt = os.path.join(tmp, "tr", "local", f"checkpoint-{SAVE_AT}")
    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(tmp, "tb")  # rank 0 writes the events
    out["local"] = run("local", save_strategy="steps", save_steps=SAVE_AT, report_to=["tensorboard"])
    del os.environ["TENSORBOARD_LOGGING_DIR"]
    out["local"]["checkpoint_files"] = sorted(os.listdir(os.path.join(ckpt, "topo_align")))
    out["resumed"] = run("resumed", resume=ckpt, save_strategy="steps", save_steps=SAVE_AT)
    out["seen"] = seen
    out["tb_dir"] = os.path.join(tmp, "tb")
    out["lines"] = list(lines.lines)
    logging.getLogger("topo_align").removeHandler(lines)
    thf.uninstall()
    return out
