"""Hugging Face ``transformers.Trainer`` and ``accelerate`` on DeepSpeed with a "topo_align" block.

Neither library needs a change: both end in ``deepspeed.initialize``, looked up on the module at
call time (``accelerate.Accelerator._prepare_deepspeed``), so :func:`..api.install` before the first
``Trainer.train()`` / ``Accelerator.prepare()`` routes them through the adapter, and the block
reaches it untouched (HF fills only its ``"auto"`` values). The helpers here are what the example
(scripts/hf_trainer_example.py) and the suite (tests/test_hf_integration.py) share: a tiny causal
LM built from a config (no download), synthetic token data, ``TrainingArguments`` for CPU ranks, a
callback that checks every optimizer step, and a plain ``accelerate`` loop. docs/deepspeed.md,
"Hugging Face Trainer and Accelerate".
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["tiny_causal_lm", "SyntheticTokens", "fresh_accelerate_state", "training_args", "step_check",
           "train_trainer", "train_accelerate", "accelerate_loop"]

VOCAB = 64
SEQ = 16


def tiny_causal_lm(seed: int = 0, layers: int = 4):
    """A Llama-architecture causal LM of 45k parameters, from a config (nothing downloaded). Its
    names (``model.layers.N``, ``lm_head``) are those the default ``sync`` patterns expect."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # the same initial weights on every rank and in every run
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


class SyntheticTokens(Dataset):
    """Learnable synthetic sequences: sample i counts up from a start token with a stride, mod VOCAB;
    reproducible from i alone, so every run and every rank sees the same corpus."""

    def __init__(self, n: int = 512):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        ids = (start + (stride % 7 + 1) * torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def fresh_accelerate_state() -> None:
    """Forget the previous run's DeepSpeed plugin. ``AcceleratorState`` is a process-wide singleton
    that keeps the first plugin it saw, so a second Trainer/Accelerator in the same process would
    otherwise build its engine from the first run's config. The process group (``PartialState``)
    stays. Also clears DeepSpeed's module-global mpu (a selective ZeRO-1/2 run leaves its island mpu
    there, docs/deepspeed.md "Checkpoints")."""
    import deepspeed.utils.groups as dg
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    dg.mpu = None


def training_args(output_dir: str, deepspeed: str | dict, steps: int, **overrides):
    """``TrainingArguments`` for a short CPU run: no saving, no reporting, no progress bar, fixed
    seed and data order, so two runs differ only in their DeepSpeed config."""
    from transformers import TrainingArguments

    kw: dict[str, Any] = dict(output_dir=output_dir, deepspeed=deepspeed, max_steps=steps,
                              per_device_train_batch_size=4,
                              learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, seed=0, use_cpu=True,
                              save_strategy="no", report_to=[], disable_tqdm=True, logging_strategy="no",
                              dataloader_num_workers=0)
    kw.update(overrides)
    return TrainingArguments(**kw)


def step_check(trainer, check: Callable):
    """A ``TrainerCallback`` that calls ``check(engine, step)`` after every optimizer step with the
    Trainer's DeepSpeed engine (``trainer.model_wrapped``), e.g. :func:`.harness.selective_checker`.
    Built here so that importing this module needs neither transformers nor accelerate."""
    from transformers import TrainerCallback

    class StepCheck(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            check(trainer.model_wrapped, state.global_step - 1)

    return StepCheck()


def train_trainer(model, deepspeed: str | dict, output_dir: str, steps: int, check: Callable | None = None,
                  dataset: Dataset | None = None, **overrides):
    """``Trainer(model, TrainingArguments(deepspeed=...)).train()``; returns the trainer (its engine
    is ``trainer.model_wrapped``)."""
    from transformers import Trainer

    fresh_accelerate_state()
    trainer = Trainer(model=model, args=training_args(output_dir, deepspeed, steps, **overrides),
                      train_dataset=dataset if dataset is not None else SyntheticTokens())
    if check is not None:
        trainer.add_callback(step_check(trainer, check))
    trainer.train()
    return trainer


def train_accelerate(model, deepspeed: str | dict, steps: int, check: Callable | None = None, batch: int = 4,
                     lr: float = 3e-3):
    """A plain accelerate loop: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``,
    ``prepare(model, optimizer, loader)``, ``backward`` (DeepSpeed steps inside it). Returns
    ``(engine, accelerator, losses)``; the config is a dict or a JSON file, as with ``accelerate launch``."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    fresh_accelerate_state()
    # CPU ranks: without an accelerator device accelerate sees a world of one unless the process
    # state is made with cpu=True first (the Trainer does the same for use_cpu). Kept if it exists.
    PartialState(cpu=True)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=deepspeed))  # device: DS_ACCELERATOR
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = DataLoader(SyntheticTokens(), batch_size=batch, shuffle=False)
    engine, opt, loader = acc.prepare(model, opt, loader)
    return (engine, acc, accelerate_loop(acc, engine, opt, loader, steps, check=check))


def accelerate_loop(acc, model, opt, loader, steps: int, *, clip: float = 0.0, check: Callable | None = None):
    """``steps`` optimizer steps of prepared objects: ``accumulate``, ``backward``, ``clip_grad_norm_``
    on the last micro-step (``clip`` > 0), ``step``. Returns the loss of every optimizer step (the mean
    over its micro-steps); ``check(model, step)`` runs after each optimizer step."""
    losses: list[float] = []
    step, total, micro = 0, 0.0, 0
    while step < steps:
        for item in loader:
            with acc.accumulate(model):
                loss = model(**item).loss
                acc.backward(loss)
                total, micro = total + float(loss.detach()), micro + 1
                if clip and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                losses.append(total / micro)
                total, micro = 0.0, 0
                if check is not None:
                    check(model, step)
                step += 1
                if step == steps:
                    break
    return losses
