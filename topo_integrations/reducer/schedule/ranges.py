"""Element ranges of a flat buffer: the one helper for flat <-> ranges copies.

A framework bucket holds tensors of both classes side by side; the dispatcher reduces the ranges of
one class as one contiguous payload (a copy), then writes it back.
"""

from __future__ import annotations

import torch

__all__ = ["Ranges", "take", "put", "clip", "merge_spans", "total"]

Ranges = list[tuple[int, int]]
"""Half-open ``(start, end)`` element ranges, ascending, non-overlapping."""


def take(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The elements of ``ranges`` of the 1-D ``t`` as one contiguous copy."""
    if len(ranges) == 1:
        s, e = ranges[0]
        return t[s:e].clone()
    if not ranges:
        return t.new_zeros(0)
    return torch.cat([t[s:e] for s, e in ranges])


def put(t: torch.Tensor, ranges: Ranges, vals: torch.Tensor) -> None:
    """Inverse of :func:`take`: write ``vals`` back into the ranges of ``t``."""
    off = 0
    for s, e in ranges:
        t[s:e].copy_(vals[off:off + e - s])
        off += e - s


def clip(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """Ranges intersected with [lo, hi), made relative to lo."""
    out = []
    for s, e in ranges:
        s2, e2 = max(s, lo), min(e, hi)
        if s2 < e2:
            out.append((s2 - lo, e2 - lo))
    return out


def merge_spans(spans: list[tuple[int, int, str]], classes: tuple[str, ...]) -> dict[str, Ranges]:
    """``(start, end, class)`` spans -> ranges per class, consecutive spans of one class merged (a run
    also covers the padding between them)."""
    runs: list[list] = []
    for s, e, cls in sorted(spans):
        if runs and runs[-1][2] == cls:
            runs[-1][1] = e
        else:
            runs.append([s, e, cls])
    return {c: [(s, e) for s, e, k in runs if k == c] for c in classes}


def total(ranges: Ranges) -> int:
    return sum(e - s for s, e in ranges)
