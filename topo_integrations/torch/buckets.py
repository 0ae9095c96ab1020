"""Flat gradient buckets in reverse registration order (the order backward produces gradients).

A bucket holds parameters of one class and one compute dtype (fp32 for fp32/bf16/fp16 gradients,
fp64 for fp64): gradients are reduced in fp32 (as Megatron's grad_reduce_in_fp32), so a bf16 model
reduces as accurately as an fp32 one; the wire dtypes are chosen per hop (sync/local/inter dtype).
The buffer is padded to a multiple of the intra-group size for the reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "build_buckets"]


@dataclass(eq=False)
class Bucket:
    index: int
    """Position among the buckets of its class (launch order)."""
    cls: str
    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    residual: torch.Tensor | None = None
    ready: set = field(default_factory=set)
    launched: bool = False
    future: object = None
    done_event: object = None

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False
        self.future = None
        self.done_event = None


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def build_buckets(named: list[tuple[str, torch.Tensor]], classes: dict[str, str], *, bucket_numel: int,
                  pad_to: int, class_order: tuple[str, ...],
                  first_bucket_numel: int | None = None) -> dict[str, list[Bucket]]:
    """class -> buckets; parameters in reverse registration order, each bucket <= bucket_numel elements
    (a larger parameter gets a bucket of its own). The first bucket of each class holds at most
    ``first_bucket_numel`` elements: as in DDP, a small first bucket fills early in backward, so its
    collective overlaps the rest of backward even when the whole model fits in one bucket."""
    out: dict[str, list[Bucket]] = {c: [] for c in class_order}
    open_: dict[tuple[str, torch.dtype], list[tuple[str, torch.Tensor]]] = {}

    def close(key):
        items = open_.pop(key, None)
        if not items:
            return
        cls, dt = key
        offs, off = [], 0
        for _, p in items:
            offs.append(off)
            off += p.numel()
        dev = items[0][1].device
        buf = torch.zeros(-(-max(off, 1) // pad_to) * pad_to, dtype=dt, device=dev)
        out[cls].append(Bucket(len(out[cls]), cls, [n for n, _ in items], [p for _, p in items], offs, off, buf))

    for name, p in reversed(named):
        key = (classes[name], _compute_dtype(p))
        items = open_.setdefault(key, [])
        cap = bucket_numel if out[key[0]] or first_bucket_numel is None else min(bucket_numel, first_bucket_numel)
        if items and sum(q.numel() for _, q in items) + p.numel() > cap:
            close(key)
            items = open_.setdefault(key, [])
        items.append((name, p))
    for key in list(open_):
        close(key)
    return out
