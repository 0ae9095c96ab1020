"""A small GPT in plain PyTorch, with size presets shaped like the GPT-3 family.

Parameter names follow the convention topo-align's layer detection knows: ``layers.N.*`` for the
transformer blocks and ``lm_head`` for the output head, so ``sync.last_n_layers`` and
``sync.always_sync`` select them without a ``layer_pattern``. The Megatron script uses megatron-core's
own ``GPTModel`` with the same preset shapes (:func:`preset`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "PRESETS", "preset", "GPT", "PresetError"]


class PresetError(ValueError):
    """An unknown model preset."""


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab_size: int = 258
    ffn_mult: int = 4
    dropout: float = 0.0

    def num_params(self) -> int:
        """Parameters of :class:`GPT` with this shape (embeddings, blocks, final norm, untied head)."""
        h, v, L, f = self.hidden, self.vocab_size, self.num_layers, self.ffn_mult
        block = (2 * 2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (f * h * h + f * h) + (f * h * h + h)
        return v * h + self.seq_length * h + L * block + 2 * h + h * v

    def to_dict(self) -> dict:
        return asdict(self)


# Shapes: 'tiny' trains on a laptop CPU in minutes; the others follow GPT-3 (Brown et al. 2020,
# table 2.1) with the byte-level vocabulary, so their parameter counts are slightly below the names.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(num_layers=4, hidden=160, heads=4, seq_length=128),
    "125M": GPTConfig(num_layers=12, hidden=768, heads=12, seq_length=2048),
    "1.3B": GPTConfig(num_layers=24, hidden=2048, heads=16, seq_length=2048),
    "175B": GPTConfig(num_layers=96, hidden=12288, heads=96, seq_length=2048),
}


def preset(name: str, *, seq_length: int | None = None) -> GPTConfig:
    if name not in PRESETS:
        raise PresetError(f"--model {name!r}: unknown preset; accepted: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if seq_length is not None:
        if seq_length < 2:
            raise PresetError(f"--seq-length {seq_length}: must be at least 2")
        cfg = GPTConfig(**{**cfg.to_dict(), "seq_length": seq_length})
    return cfg


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.out = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Pre-norm decoder-only transformer; ``forward(tokens, labels, loss_mask)`` returns the mean loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise PresetError(f"hidden size {cfg.hidden} is not a multiple of the {cfg.heads} heads")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_length, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.reshape(-1).to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)
