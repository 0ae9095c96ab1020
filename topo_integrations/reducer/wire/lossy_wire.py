"""Lossy hops across a group (bf16, fp16 and int8 wires): every member rounds only what it sends, and
every sum is formed in fp32 by the owner of its chunk (invariant 6 of docs/design.md section 4).

A ring all-reduce in a 16-bit dtype rounds each partial sum at every hop (n - 1 roundings per
element over n members, growing with the number of islands, and error feedback cannot see them); an
int8 sum overflows. So a lossy hop is an all-to-all of the quantised values, a local fp32 sum by the
chunk's owner, and an all-gather of the sum rounded once to the wire dtype. It moves the bytes of a
ring all-reduce of the same payload ((n-1)/n per phase, 2(n-1)/n in all). The result's rounding is
the owner's, so every member gets the same bits; error feedback keeps both roundings (the sender's in
the first part of the residual, the owner's in the second), as for the int8 blocks.

Its own module because the collectives module is at its size bound. It sits below collectives.py, which
calls it from ``hop`` and ``rail_reduce_scatter`` and hands in its ``run`` (named errors, byte records,
the collective-order trace) and its all-gather, so every hop here is issued the way all others are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .compression import (
    INT8_BLOCK,
    choose_scale,
    dequantize_blocks,
    needs_scale,
    owner_unit,
    padded_numel,
    quantize,
    quantize_blocks,
)

__all__ = ["lossy_all_reduce", "lossy_reduce_scatter", "agree_scale"]


class _Cast:
    """bf16 / fp16: ``wire(v * scale)``, one element at a time (``scale``: fp16's agreed power of two)."""

    unit = 1

    def __init__(self, wire: torch.dtype, scale: torch.Tensor | None):
        self.wire, self.scale = wire, scale

    def encode(self, v: torch.Tensor, residual) -> tuple[torch.Tensor, ...]:
        return (quantize(v, self.wire, self.scale, residual),)

    def decode(self, parts) -> torch.Tensor:
        back = parts[0].float()
        return back / self.scale if self.scale is not None else back


class _Int8Blocks:
    """int8 with one fp32 scale per block of ``INT8_BLOCK`` elements (compression.py)."""

    unit = INT8_BLOCK

    def encode(self, v: torch.Tensor, residual) -> tuple[torch.Tensor, ...]:
        return quantize_blocks(v, residual)

    def decode(self, parts) -> torch.Tensor:
        return dequantize_blocks(*parts)


def agree_scale(v: torch.Tensor, wire: torch.dtype, group, tier: str, groups, record, n: int, *, run):
    """fp16 only (None otherwise): one 4-byte MAX all-reduce of ``amax(v)`` -> the power of two that
    keeps every value and the sum of ``n`` of them inside fp16's range (compression.choose_scale). ``run``:
    collectives.run, which issues it."""
    if not needs_scale(wire):
        return None
    amax = v.abs().max().reshape(1).float() if v.numel() else torch.zeros(1, device=v.device)
    run("all_reduce(MAX amax)", tier, group, groups, 4, record,
        lambda: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group), like=amax)
    return choose_scale(amax, wire, n)


def _codec(v: torch.Tensor, wire: torch.dtype, group, tier: str, groups, record, n: int, run):
    if wire == torch.int8:
        return _Int8Blocks()
    return _Cast(wire, agree_scale(v, wire, group, tier, groups, record, n, run=run))


def _owner_sum(sent: tuple[torch.Tensor, ...], codec, group, n: int) -> torch.Tensor:
    """All-to-all of ``sent`` (member i receives chunk i of every member), then the fp32 sum of the
    n decoded versions of my chunk, in member order (the same order on every rank)."""
    recv = tuple(torch.empty_like(t) for t in sent)
    for r, t in zip(recv, sent):
        dist.all_to_all_single(r, t, group=group)
    return codec.decode(recv).view(n, -1).sum(dim=0)


def lossy_all_reduce(x: torch.Tensor, wire: torch.dtype, residual, group, tier: str, groups, record,
                     n: int, *, run, gather) -> torch.Tensor:
    """SUM over ``group`` (``n`` members) of ``x`` on a ``wire`` (bf16, fp16, int8) wire; returns the
    fp32 sum (``x.numel()`` elements), bitwise the same on every member.

    Phases:
      0. (fp16) MAX all-reduce of amax for a common power-of-two scale (4 bytes);
      1. pad to n whole units, add the residual's first part, quantise (its error goes back there);
      2. all-to-all: member i receives chunk i of every member ((n-1)/n of the payload per rank);
      3. decode to fp32 and sum the n versions of my chunk in member order (the same order on every
         rank: deterministic); add the residual's second part (my chunk's earlier rounding of the sum);
      4. quantise that sum once (its error goes back to the second part) and all-gather it
         ((n-1)/n of the payload per rank); decode.
    ``residual``: None or ``compression.owner_residual_numel(x.numel(), n, owner_unit(wire))`` fp32 elements.
    ``run``, ``gather``: collectives.run and collectives.all_gather_flat, which issue the phases.
    """
    m = x.numel()
    p = padded_numel(m, n * owner_unit(wire))
    buf = x.float().reshape(-1)
    if p != m:
        buf = torch.cat([buf, buf.new_zeros(p - m)])
    first = second = None
    if residual is not None:
        if residual.numel() != p + p // n:
            raise ValueError(f"topo_align: {wire} residual has {residual.numel()} elements; expected {p + p // n}")
        first, second = residual[:p], residual[p:]
        buf = buf + first
    codec = _codec(buf, wire, group, tier, groups, record, n, run)
    sent = codec.encode(buf, first)
    # Each phase books half the payload, so that the two together count as one all-reduce of it does:
    # the byte figures compare with the fp32 wire's. The 16-bit padding (< n elements) is not booked.
    total = sum(t.numel() * t.element_size() for t in sent) if codec.unit > 1 else m * sent[0].element_size()
    mine = run("all_to_all", tier, group, groups, total // 2, record,
               lambda: _owner_sum(sent, codec, group, n), like=sent[0])
    if second is not None:
        mine += second
    back = codec.encode(mine, second)
    out = tuple(torch.empty_like(t) for t in sent)
    run("all_gather", tier, group, groups, total - total // 2, record,
        lambda: [gather(o, b, group=group) for o, b in zip(out, back)], like=sent[0])
    return codec.decode(out)[:m]


def lossy_reduce_scatter(out: torch.Tensor, x: torch.Tensor, wire: torch.dtype, residual, group, groups,
                         record, n: int, *, run) -> torch.Tensor:
    """Reduce-scatter SUM of ``x`` over ``group`` into ``out`` (member i gets chunk i) on a 16-bit wire.

    Phases: 0. (fp16) MAX all-reduce of amax for a common scale; 1. add ``residual`` (shape ``x``),
    quantise (its error goes back there); 2. all-to-all + fp32 sum in member order
    (`_owner_sum`). The sum stays with its owner, so it is rounded at most once, into ``out``'s dtype.
    ``run``: collectives.run, which issues the phases.
    """
    v = x.reshape(-1).float()
    if residual is not None:
        v = v + residual
    codec = _Cast(wire, agree_scale(v, wire, group, "inter", groups, record, n, run=run))
    q = codec.encode(v, residual)[0]
    mine = run("reduce_scatter", "inter", group, groups, q.numel() * q.element_size(), record,
               lambda: _owner_sum((q,), codec, group, n), like=q)
    out.copy_(mine.view_as(out))
    return out
