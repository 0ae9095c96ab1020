"""Gradient clipping by an agreed norm without reading the norm on the host (:func:`clip_by_norm_`).

The adapters that clip themselves (the DDP hook's ``clip_grad_norm_``, DeepSpeed's ZeRO-0
``clip_fp32_gradients``) once computed the factor from ``float(norm)``: a host read of a device value
at every step, i.e. the host waits for the step's work so far. Here the factor stays on the norm's
device, as ``torch.nn.utils.clip_grad_norm_`` does, with the same arithmetic as the host formula
(``max_norm / (norm + 1e-6)`` in fp64, applied when below 1), so on the CPU the gradients are
bitwise what they were.
"""

from __future__ import annotations

import torch

__all__ = ["clip_by_norm_"]


def clip_by_norm_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (norm + 1e-6)`` where that is below 1 (elsewhere by
    exactly 1, an identity); a NaN factor (a NaN norm) leaves them alone, as ``min(1.0, nan)`` did.
    ``norm``: the agreed global norm, fp64, one element. The factor is rounded once to the gradients'
    dtype, as ``torch._foreach_mul_`` rounds a Python scalar (for fp32 gradients also what
    ``Tensor.mul_`` does with one)."""
    if not grads:
        return
    n = norm.detach().reshape(()).double()
    coef = torch.full_like(n, float(max_norm)) / (n + 1e-6)
    coef = torch.where(coef < 1.0, coef, torch.ones_like(coef))
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in by_kind.items():
        torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
