"""Wire dtypes for lossy hops: what a member sends (FP16 scaled, BF16, INT8 blocks) and error feedback.

Every lossy hop rounds only what a member sends; the sums are formed in fp32 by the owner of each
chunk (an all-to-all, a local fp32 sum, an all-gather of the sum rounded once: lossy_wire.py), never
in the wire dtype. Error feedback keeps both roundings: ``residual = v - sent`` (the sender's, added to
the next step's value) and, with the chunk's owner, that of the sum; so the error of a sum of T steps
is one step's rounding, not T of them.

FP16 wire. FP16's range (65504) is the one a gradient sum can exceed, so the group agrees on a power
of two ``s`` (one 4-byte MAX all-reduce of ``amax(v)``) with ``n * amax * s <= 65504 / 2``: no value
and no sum of ``n`` of them overflows, and every value keeps FP16's 11 significant bits (relative
error 2^-11 down to ``n * amax * 2^-29``, where fp16 turns subnormal). (Before issue 31 the sums
were formed in FP16 by the all-reduce, and an integer grid made them exact at an absolute error of
``n * amax / 2048`` per value; with fp32 sums the grid is not needed and the scaled cast is finer for
every value below ``amax``.)
Non-finite values are sent unscaled so that an overflow still reaches the framework's overflow check.

BF16 wire. BF16 has FP32's range, so no scaling: a plain cast (relative error 2^-8 per rounding).

INT8 wire (`local.reconcile_dtype: int8` deltas, `sync.dtype: int8` gradients). One fp32 scale per block of
``INT8_BLOCK`` elements (``amax / 127``), values rounded to int8: a block's error is at most half a
step of its own largest element, so one large delta does not coarsen the rest of the bucket.

All tensor arithmetic: no host synchronisation (on CUDA the scale stays on the device).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_BY_NAME", "INT8_BLOCK", "wire_dtype", "is_lossy", "is_narrow", "choose_scale", "quantize",
           "owner_unit", "owner_residual_numel", "hop_residual_numel",
           "fold_owner_residual", "quantize_blocks", "dequantize_blocks", "padded_numel"]

DTYPE_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 256
"""Elements per fp32 scale on the int8 wire (the scales add 4/256 = 1.6 % to the bytes)."""


def wire_dtype(name_or_dtype) -> torch.dtype:
    """``"fp16"`` -> torch.float16 (a torch.dtype passes through)."""
    if isinstance(name_or_dtype, torch.dtype):
        return name_or_dtype
    try:
        return DTYPE_BY_NAME[name_or_dtype]
    except KeyError:
        raise ValueError(f"wire dtype = {name_or_dtype!r}; expected one of {sorted(DTYPE_BY_NAME)}") from None


def is_lossy(src: torch.dtype, wire: torch.dtype) -> bool:
    """True when casting ``src`` to ``wire`` can lose precision or range."""
    if src == wire:
        return False
    if not wire.is_floating_point:
        return True
    fs, fw = torch.finfo(src), torch.finfo(wire)
    return fw.eps > fs.eps or fw.max < fs.max


def needs_scale(wire: torch.dtype) -> bool:
    """FP16's range (65504) is the only one a gradient sum can plausibly exceed."""
    return torch.finfo(wire).max < 1e6


def is_narrow(dtype: torch.dtype) -> bool:
    """A dtype in which no sum is formed (16 or 8 bits: every partial sum would round again)."""
    return dtype.itemsize < 4


def choose_scale(amax: torch.Tensor, wire: torch.dtype, n_contrib: int) -> torch.Tensor:
    """Power of two ``s`` with ``n * amax * s <= max(wire) / 2``; 1 when amax is 0 or not finite.

    The sum of ``n`` scaled values (formed in fp32, rounded once to the wire) then stays inside the
    wire's range with a factor 2 to spare for the error-feedback residual. Non-finite values are sent
    unscaled so that an overflow still shows up as inf/nan downstream (the framework's overflow check
    then skips the step on every rank).
    """
    target = torch.finfo(wire).max / (2.0 * max(1, n_contrib))
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    safe = torch.where(ok, a, torch.ones_like(a))
    exp = torch.floor(torch.log2(target / safe)).clamp(-120.0, 120.0)
    return torch.where(ok, torch.exp2(exp), torch.ones_like(a))


def quantize(v: torch.Tensor, wire: torch.dtype, scale: torch.Tensor | None,
             residual: torch.Tensor | None) -> torch.Tensor:
    """``wire(v * scale)``; the error, in v's units, goes to ``residual``.

    ``v`` already includes the previous residual. A non-finite error is not carried over (it would
    poison every later step); the overflow itself reaches the caller through the sent values.
    """
    q = (v * scale if scale is not None else v).to(wire)
    if residual is not None:
        back = q.to(v.dtype)
        if scale is not None:
            back = back / scale
        err = v - back
        residual.copy_(torch.where(torch.isfinite(err), err, torch.zeros_like(err)))
    return q


def owner_unit(wire: torch.dtype) -> int:
    """Elements per quantisation unit of ``wire``: an int8 block, or one element of a 16-bit cast."""
    return INT8_BLOCK if wire == torch.int8 else 1


def owner_residual_numel(m: int, n: int, unit: int = 1) -> int:
    """Elements of a lossy hop's error-feedback residual for an ``m``-element payload over ``n``
    members (lossy_wire.py): the payload padded to ``n`` whole units of ``unit`` elements (the
    sender's rounding), then my chunk of the sum (its rounding, kept by its owner)."""
    k = max(1, n) * unit
    p = -(-m // k) * k
    return p + p // max(1, n)


def hop_residual_numel(m: int, n: int, wire: torch.dtype) -> int:
    """Residual elements of one hop of ``m`` elements over ``n`` members in ``wire``: the sender's
    part (padded) and the owner's chunk of the sum (lossy_wire.py); ``m`` for a wide wire."""
    return owner_residual_numel(m, n, owner_unit(wire)) if is_narrow(wire) else m


def fold_owner_residual(residual: torch.Tensor, m: int, n: int, rank: int) -> torch.Tensor:
    """The per-element form of a 16-bit hop's residual (``m`` elements over ``n`` members, I am
    member ``rank``): its first part, plus my chunk's rounding of the sum where I own it. Sent on the
    next step it repays the same amounts whoever owns the elements then (a re-laid-out bucket)."""
    p = residual.numel() * n // (n + 1)
    flat = residual[:p].clone()
    flat[rank * (p // n):(rank + 1) * (p // n)] += residual[p:]
    return flat[:m]


def quantize_blocks(v: torch.Tensor, residual: torch.Tensor | None = None,
                    block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (fp32, numel a multiple of ``block``) as int8 with one fp32 scale per block.

    ``scale = amax(block) / 127``; ``q = round(v / scale)``. The error, ``v - q * scale``, goes to
    ``residual`` (same shape as ``v``) when given. A block holding inf/nan gets a non-finite scale, so
    the overflow reaches the receiver through the dequantised values (its error is not carried over).
    """
    blocks = v.reshape(-1, block)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    if residual is not None:
        err = (blocks - q.float() * scale[:, None]).reshape(residual.shape)
        residual.copy_(torch.where(torch.isfinite(err), err, torch.zeros_like(err)))
    return q.reshape(-1), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """fp32 values of int8 blocks ``q`` with their scales."""
    return (q.reshape(-1, block).float() * scale[:, None]).reshape(-1)


def padded_numel(n: int, k: int) -> int:
    """Smallest multiple of ``k`` that is >= ``n``."""
    return -(-n // k) * k if k > 1 else n
