"""CPU ranks for the tests and the example (tests/test_hf_integration.py, scripts/hf_accelerate_example.py).

accelerate 1.15 takes its FSDP path only on accelerator devices (``MULTI_GPU``, ``MULTI_XPU``, ...):
on CPU ranks an FSDP config leaves ``distributed_type`` at ``MULTI_CPU`` and accelerate wraps the
model in DDP, saying nothing. :func:`cpu_accelerator` builds the ``Accelerator`` a script on CPU ranks
uses and, where an FSDP plugin was asked for (``fsdp_plugin=`` or ``accelerate launch`` with an FSDP
config: ``ACCELERATE_USE_FSDP``), puts accelerate's state on its FSDP path, so that accelerate's own
FSDP2 preparation (``fully_shard`` per its wrap policy) runs on gloo as it would on GPUs. Emulation
only: on GPUs nothing here is needed.

:func:`train_loop` is a plain accelerate loop (``accumulate``, ``backward``, ``clip_grad_norm_``,
``step``) over the tiny causal LM and synthetic tokens of ``deepspeed/hf_harness.py``.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

__all__ = ["cpu_accelerator", "reset_launch_env", "train_loop", "flat_params", "TinyLM"]

PLUGIN_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")
"""What an ``Accelerator`` built with a plugin writes into the environment: every later one in the
process would take that path too. ``accelerate launch`` with an FSDP config also sets ``FSDP_VERSION``,
which no ``Accelerator`` writes: that one says the launch asked for FSDP."""


class Block(torch.nn.Module):
    """A residual MLP block: what FSDP2's transformer wrap policy shards as one module."""

    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyLM(torch.nn.Module):
    """A causal LM without transformers (``accelerate launch`` tests start faster without importing
    it): embedding, residual MLP blocks under ``model.layers.N``, ``lm_head``; ``forward(input_ids,
    labels)`` returns an object with ``.loss`` (next-token cross-entropy), as a transformers model."""

    _no_split_modules = ["Block"]

    def __init__(self, seed: int = 0, layers: int = 4, vocab: int = 64, width: int = 32):
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, width)
        self.model.layers = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        from types import SimpleNamespace

        h = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            h = block(h)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def reset_launch_env() -> None:
    """Forget the plugin variables earlier ``Accelerator`` s of this process wrote (:data:`PLUGIN_ENV`);
    an FSDP launch (``FSDP_VERSION`` set) keeps ``ACCELERATE_USE_FSDP``."""
    for k in PLUGIN_ENV:
        os.environ.pop(k, None)
    if "FSDP_VERSION" in os.environ:
        os.environ["ACCELERATE_USE_FSDP"] = "true"


def cpu_accelerator(**kwargs):
    """``Accelerator(cpu=True, **kwargs)`` on CPU ranks, on accelerate's FSDP path when an FSDP plugin
    is given or ``ACCELERATE_USE_FSDP`` is set (module docstring). Forgets a previous run's state."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    reset_launch_env()
    AcceleratorState._reset_state(reset_partial_state=True)  # a DeepSpeed run left DEEPSPEED in it
    GradientState._reset_state()
    PartialState(cpu=True)
    plugin = kwargs.pop("fsdp_plugin", None)
    if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        plugin = FullyShardedDataParallelPlugin()
    acc = Accelerator(cpu=True, **kwargs)
    if plugin is not None:
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    return acc


def flat_params(model) -> torch.Tensor:
    """Every parameter of ``model`` as one fp32 vector (DTensors gathered: collective on FSDP2)."""
    from torch.distributed.tensor import DTensor

    out = []
    for _, p in sorted(model.named_parameters()):
        t = p.detach()
        out.append((t.full_tensor() if isinstance(t, DTensor) else t).float().reshape(-1))
    return torch.cat(out)


def train_loop(acc, model, steps: int, *, batch: int = 4, lr: float = 3e-3, clip: float = 1.0, check=None):
    """A plain accelerate loop: ``prepare(model, AdamW, loader)``, ``accumulate``, ``backward``, clip
    on the sync micro-step, ``step``. Returns ``(model, optimizer, losses)`` (the mean loss of every
    optimizer step); ``check(model, step)`` runs after each optimizer step. Micro-steps per optimizer
    step: the accelerator's ``gradient_accumulation_steps``."""
    from ..deepspeed.hf_harness import SyntheticTokens, accelerate_loop

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = DataLoader(SyntheticTokens(), batch_size=batch, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = accelerate_loop(acc, model, opt, loader, steps, clip=clip, check=check)
    return model, opt, losses
