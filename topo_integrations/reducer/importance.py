"""Per-tensor importance scores for `sync.top_fraction` (never per element).

  fisher      EMA of the mean squared (reduced) gradient element: an empirical Fisher trace per
              element, updated at every `finish_grad_sync` (one small kernel per tensor).
  magnitude   mean squared parameter value, computed at refresh time.
  hutchinson  mean |v * Hv| with Rademacher v: the Hessian-diagonal estimate (Hutchinson), from one
              Hessian-vector product on the loss closure, computed at refresh time.

Scores are averaged over the data-parallel group before ranking (`agreed`), so every rank ranks the
same way. Until the first refresh every method ranks by magnitude (parameters are equal everywhere
at start).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["Importance"]


class Importance:
    def __init__(self, method: str, ema_decay: float, params: list[torch.Tensor],
                 loss_closure: Callable[[], torch.Tensor] | None = None):
        if method not in ("fisher", "magnitude", "hutchinson"):
            raise ValueError(f"importance.method = {method!r}; expected 'fisher', 'hutchinson' or 'magnitude'")
        if method == "hutchinson" and loss_closure is None:
            raise ValueError("importance.method = 'hutchinson' needs a loss closure: "
                             "GroupedReducer(..., loss_closure=lambda: loss_fn(model(batch)))")
        self.method = method
        self.decay = ema_decay
        self.params = params
        self.closure = loss_closure
        dev = params[0].device if params else torch.device("cpu")
        self.ema = torch.zeros(len(params), dtype=torch.float32, device=dev)
        self.updates = 0
        self.hutchinson_seed = 0

    @staticmethod
    def magnitude(params: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([p.detach().float().pow(2).mean() if p.numel() else p.new_zeros((), dtype=torch.float32)
                            for p in params]) if params else torch.zeros(0)

    def update_from_grads(self) -> None:
        """Fisher EMA from the reduced gradients now in ``p.grad``."""
        if self.method != "fisher" or not self.params:
            return
        grads = [p.grad.detach() if p.grad is not None else p.detach().new_zeros(1) for p in self.params]
        # one fused norm kernel per dtype group instead of a kernel per tensor
        # (norms accumulated in fp32: an fp16 gradient's norm can exceed 65504)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        numel = torch.tensor([max(1, g.numel()) for g in grads], dtype=torch.float32, device=self.ema.device)
        sq = torch.stack([n.float() for n in norms]).to(self.ema.device).pow(2) / numel
        sq = torch.where(torch.tensor([p.grad is not None for p in self.params], device=self.ema.device), sq,
                         torch.zeros_like(sq))
        if self.updates == 0:
            self.ema.copy_(sq)
        else:
            self.ema.mul_(self.decay).add_(sq, alpha=1.0 - self.decay)
        self.updates += 1

    def hutchinson(self) -> torch.Tensor:
        """mean |v * Hv| per tensor from one Hessian-vector product on the loss closure."""
        params = [p for p in self.params]
        # Fused scaled-dot-product attention kernels (flash, and the CPU one) have no second
        # derivative; the math kernel does, so the closure runs with it for the HVP.
        with sdpa_kernel(SDPBackend.MATH):
            loss = self.closure()
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        used = [i for i, g in enumerate(grads) if g is not None]
        gen = torch.Generator(device="cpu").manual_seed(1234 + self.hutchinson_seed)
        self.hutchinson_seed += 1
        vs = [(torch.randint(0, 2, params[i].shape, generator=gen) * 2 - 1).to(params[i].dtype).to(params[i].device)
              for i in used]
        hv = torch.autograd.grad([grads[i] for i in used], [params[i] for i in used], grad_outputs=vs,
                                 allow_unused=True)
        out = torch.zeros(len(params), dtype=torch.float32, device=self.ema.device)
        for j, i in enumerate(used):
            if hv[j] is not None and params[i].numel():
                out[i] = (vs[j] * hv[j]).detach().float().abs().mean()
        return out

    def local_scores(self) -> torch.Tensor:
        """This rank's scores (to be averaged over the data-parallel group)."""
        if self.method == "magnitude":
            return self.magnitude(self.params)
        if self.method == "hutchinson":
            return self.hutchinson()
        return self.ema.clone()

    def state_dict(self) -> dict:
        return {"method": self.method, "ema": self.ema.detach().clone().cpu(), "updates": self.updates,
                "hutchinson_seed": self.hutchinson_seed}

    def load_state_dict(self, sd: dict) -> None:
        if sd["ema"].numel() != self.ema.numel():
            raise ValueError(f"importance state has {sd['ema'].numel()} tensors; this model has {self.ema.numel()}")
        self.ema.copy_(sd["ema"].to(self.ema.device))
        self.updates = int(sd["updates"])
        self.hutchinson_seed = int(sd.get("hutchinson_seed", 0))
