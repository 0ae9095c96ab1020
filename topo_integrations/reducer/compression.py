"""Wire dtypes for lossy hops: FP16 block fixed point (exact sums, cannot overflow) and error feedback.

FP16 wire. Each member of the group sends ``q = round(v * s)`` as FP16, where ``v = x + residual`` and
``s`` is a power of two agreed by the whole group (one 4-byte MAX all-reduce of ``amax(v)``) such that
``|q| <= (2048 - n) / n`` for ``n`` contributors. Every ``q`` is then an integer of at most 11 bits,
so every partial sum the all-reduce forms is an integer of magnitude <= 2048 and is exactly
representable in FP16: the sum on the wire is exact and can never overflow (65504 is far away).
The only error is the rounding of ``v * s`` to an integer, and error feedback keeps it:
``residual = v - q / s`` is added to the next step's value, so the error of a sum of T steps is
one step's rounding, not T of them. With plain FP16 casts the rounding of the in-flight sums (which
error feedback cannot see) would dominate; the grid removes it.

The price: the grid step is ``1/s < 2 n amax / (2048 - n)``, so a contribution's error is up to about
``n * amax / 2048`` of the bucket (absolute, not relative to each element); error feedback repays it on
later steps. Beyond 1024 contributors the grid is too
coarse and the hop falls back to a scaled FP16 cast (sums then round; still no overflow).

BF16 wire. BF16 has FP32's range, so no scaling: a plain cast with error feedback on the cast (the
in-flight BF16 sums round).

INT8 wire (`local.reconcile_dtype: int8` deltas, `sync.dtype: int8` gradients). One fp32 scale per block of
``INT8_BLOCK`` elements (``amax / 127``), values rounded to int8: a block's error is at most half a
step of its own largest element, so one large delta does not coarsen the rest of the bucket. Sums are
not formed on the wire (an int8 sum overflows): the collective is an all-to-all of the quantised
blocks, a local fp32 sum, and an all-gather of the re-quantised sums (int8_wire.py). Error feedback
keeps both roundings: the sender's and, with the chunk's owner, that of the sum.

All tensor arithmetic: no host synchronisation (on CUDA the scale stays on the device).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_BY_NAME", "INT8_BLOCK", "wire_dtype", "is_lossy", "uses_grid", "choose_scale", "quantize",
           "int8_residual_numel", "quantize_blocks", "dequantize_blocks"]

DTYPE_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 256
"""Elements per fp32 scale on the int8 wire (the scales add 4/256 = 1.6 % to the bytes)."""
_GRID_LIMIT = 2048  # integers up to 2^11 are exact in FP16 (11 significant bits)
_MAX_GRID_CONTRIB = 1024


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


def uses_grid(wire: torch.dtype, n_contrib: int) -> bool:
    """Whether the FP16 integer grid (exact sums) is used for ``n_contrib`` contributors."""
    return wire == torch.float16 and n_contrib <= _MAX_GRID_CONTRIB


def choose_scale(amax: torch.Tensor, wire: torch.dtype, n_contrib: int) -> torch.Tensor:
    """Power of two ``s`` with ``amax * s <= target``; 1 when amax is 0 or not finite.

    target = (2048 - n) / n on the FP16 grid (so that n rounded values sum to <= 2048), else
    max(wire) / (2 n). Non-finite values are sent unscaled so that an overflow still shows up as
    inf/nan downstream (the framework's overflow check then skips the step on every rank).
    """
    n = max(1, n_contrib)
    if uses_grid(wire, n):
        target = (_GRID_LIMIT - n) / n
    else:
        target = torch.finfo(wire).max / (2.0 * n)
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    safe = torch.where(ok, a, torch.ones_like(a))
    exp = torch.floor(torch.log2(target / safe)).clamp(-120.0, 120.0)
    return torch.where(ok, torch.exp2(exp), torch.ones_like(a))


def quantize(v: torch.Tensor, wire: torch.dtype, scale: torch.Tensor | None,
             residual: torch.Tensor | None, *, grid: bool = False) -> torch.Tensor:
    """``wire(round(v * scale))`` (grid) or ``wire(v * scale)``; the error, in v's units, goes to ``residual``.

    ``v`` already includes the previous residual. A non-finite error is not carried over (it would
    poison every later step); the overflow itself reaches the caller through the sent values.
    """
    scaled = v * scale if scale is not None else v
    if grid:
        scaled = torch.round(scaled)
    q = scaled.to(wire)
    if residual is not None:
        back = q.to(v.dtype)
        if scale is not None:
            back = back / scale
        err = v - back
        residual.copy_(torch.where(torch.isfinite(err), err, torch.zeros_like(err)))
    return q


def int8_residual_numel(m: int, n: int) -> int:
    """Elements of an int8 hop's error-feedback residual for an ``m``-element payload over ``n``
    members: the payload padded to whole blocks per member (first rounding), then my chunk of the sum
    (second rounding, kept by its owner)."""
    unit = max(1, n) * INT8_BLOCK
    p = -(-m // unit) * unit
    return p + p // max(1, n)


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
