"""The int8 wire of a hop across groups (`local.reconcile_dtype: int8`, `sync.dtype: int8`):
quantise per block, all-to-all, sum in fp32 where the chunk is owned, all-gather the re-quantised
sums.

Its own module because the collectives module is at its size bound; it builds on that module's
``run`` (named errors, byte records, the collective-order trace) and is called from its ``hop``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C  # through the module: a test's spy on C.run sees these calls
from .compression import INT8_BLOCK, dequantize_blocks, quantize_blocks

__all__ = ["int8_all_reduce"]


def int8_all_reduce(x: torch.Tensor, residual, group, tier: str, groups, record, n: int) -> torch.Tensor:
    """SUM over ``group`` (``n`` members) of ``x`` on an 8-bit wire with one fp32 scale per block
    (compression.py). An int8 sum would overflow, so the sum is formed in fp32 by the chunk's owner:
      1. pad to whole blocks per member, add the residual's first part, quantise per block (the error
         goes back into that part);
      2. all-to-all of the int8 blocks and of their scales: member i receives chunk i of every member
         ((n-1)/n of the int8 bytes per rank; a BF16 ring reduce-scatter sends twice that);
      3. dequantise and sum the n versions of my chunk in member order (fp32), add the residual's
         second part (my chunk's earlier rounding), re-quantise (its error goes back there);
      4. all-gather the quantised sums and their scales; dequantise. Every member gets the same values.
    ``residual``: None or ``int8_residual_numel(x.numel(), n)`` fp32 elements.
    """
    m = x.numel()
    p = C.padded_numel(m, n * INT8_BLOCK)
    buf = x.float() if p == m else torch.cat([x.float().reshape(-1), x.new_zeros(p - m, dtype=torch.float32)])
    first = second = None
    if residual is not None:
        if residual.numel() != p + p // n:
            raise ValueError(f"topo_align: int8 residual has {residual.numel()} elements; expected {p + p // n}")
        first, second = residual[:p], residual[p:]
        buf = buf + first
    q, scale = quantize_blocks(buf, first)
    rq, rs = torch.empty_like(q), torch.empty_like(scale)
    # Each phase books half the int8 payload (blocks + scales), so that the two together count as one
    # all-reduce of it does: the byte figures compare with the other wires' payloads.
    half = (q.numel() + 4 * scale.numel()) // 2
    C.run("all_to_all", tier, group, groups, half, record,
        lambda: (dist.all_to_all_single(rq, q, group=group), dist.all_to_all_single(rs, scale, group=group)),
        like=q)
    mine = dequantize_blocks(rq, rs).view(n, -1).sum(dim=0)
    if second is not None:
        mine += second
    sq, ss = quantize_blocks(mine, second)
    out_q, out_s = torch.empty_like(q), torch.empty_like(scale)
    C.run("all_gather", tier, group, groups, half, record,
        lambda: (C.all_gather_flat(out_q, sq, group=group), C.all_gather_flat(out_s, ss, group=group)), like=q)
    return dequantize_blocks(out_q, out_s)[:m]
