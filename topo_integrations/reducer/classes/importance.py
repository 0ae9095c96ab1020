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

from ..kinds import Method

__all__ = ["Importance"]


class Importance:
    """Per-tensor scores by name: the fisher EMA (fed by :meth:`observe`), plus the stateless
    magnitude and hutchinson estimates computed at refresh time."""

    def __init__(self, method: str, ema_decay: float, names: list[str], *, device="cpu"):
        if method not in tuple(Method):
            raise ValueError(f"importance.method = {method!r}; expected 'fisher', 'hutchinson' or 'magnitude'")
        self.method = method
        self.decay = ema_decay
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.ema = torch.zeros(len(self.names), dtype=torch.float32, device=device)
        self.seen = torch.zeros(len(self.names), dtype=torch.bool, device=device)
        self.updates = 0
        self.hutchinson_seed = 0

    @staticmethod
    def magnitude(params: list[torch.Tensor]) -> torch.Tensor:
        """Mean squared parameter value per tensor (fp32)."""
        return torch.stack([p.detach().float().pow(2).mean() if p.numel() else p.new_zeros((), dtype=torch.float32)
                            for p in params]) if params else torch.zeros(0)

    @staticmethod
    def grad_sq_sums(params: list[torch.Tensor]) -> torch.Tensor:
        """Squared norm of each ``p.grad`` (0 without a gradient), fp32, in one fused kernel per dtype."""
        if not params:
            return torch.zeros(0)
        grads = [p.grad.detach() if p.grad is not None else p.detach().new_zeros(1) for p in params]
        sq = Importance.sq_norms(grads)
        has = torch.tensor([p.grad is not None for p in params], device=sq.device)
        return torch.where(has, sq, torch.zeros_like(sq))

    @staticmethod
    def sq_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
        """Squared norm of each tensor, fp32 (the same numbers whether the tensors are ``p.grad`` or
        views of a framework's bucket holding them), in one fused kernel per dtype."""
        # accumulated in fp32: an fp16 gradient's norm can exceed 65504
        norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float32)
        return torch.stack([n.float() for n in norms]).pow(2)

    def observe(self, names: list[str], sq_sums: torch.Tensor, numels: list[int]) -> None:
        """Fold squared gradient sums of ``names`` (per element: divided by ``numels``) into the EMA;
        a tensor's first observation sets its EMA."""
        idx = torch.tensor([self.index[n] for n in names], device=self.ema.device)
        per_el = sq_sums.float().to(self.ema.device) / torch.tensor([max(1, k) for k in numels],
                                                                    dtype=torch.float32, device=self.ema.device)
        old = self.ema[idx]
        new = torch.where(self.seen[idx], self.decay * old + (1.0 - self.decay) * per_el, per_el)
        self.ema[idx] = new
        self.seen[idx] = True
        self.updates += 1

    def next_seed(self) -> int:
        self.hutchinson_seed += 1
        return self.hutchinson_seed - 1

    @staticmethod
    def hutchinson(params: list[torch.Tensor], closure: Callable[[], torch.Tensor], *, seed: int = 0) -> torch.Tensor:
        """mean |v * Hv| per tensor from one Hessian-vector product on the loss closure."""
        # Fused scaled-dot-product attention kernels (flash, and the CPU one) have no second
        # derivative; the math kernel does, so the closure runs with it for the HVP.
        with sdpa_kernel(SDPBackend.MATH):
            loss = closure()
        if not torch.is_tensor(loss) or not loss.is_floating_point():
            raise TypeError(f"topo_align: the hutchinson loss closure returned {type(loss).__name__}; expected a "
                            "floating-point tensor")
        loss = loss.float().mean() if loss.numel() != 1 else loss.reshape(())
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        gen = torch.Generator(device="cpu").manual_seed(1234 + seed)
        vs = [(torch.randint(0, 2, params[i].shape, generator=gen) * 2 - 1).to(params[i].dtype).to(params[i].device)
              for i in used]
        hv = torch.autograd.grad([grads[i] for i in used], [params[i] for i in used], grad_outputs=vs,
                                 allow_unused=True) if used else []
        dev = params[0].device if params else torch.device("cpu")
        out = torch.zeros(len(params), dtype=torch.float32, device=dev)
        for j, i in enumerate(used):
            if hv[j] is not None and params[i].numel():
                out[i] = (vs[j] * hv[j]).detach().float().abs().mean()
        return out

    def state_dict(self) -> dict:
        return {"method": self.method, "names": list(self.names), "ema": self.ema.detach().clone().cpu(),
                "seen": self.seen.detach().clone().cpu(), "updates": self.updates,
                "hutchinson_seed": self.hutchinson_seed}

    def load_state_dict(self, sd: dict) -> None:
        if sd["ema"].numel() != self.ema.numel():
            raise ValueError(f"importance state has {sd['ema'].numel()} tensors; this model has {self.ema.numel()}")
        self.ema.copy_(sd["ema"].to(self.ema.device))
        self.seen.copy_(sd.get("seen", torch.ones_like(self.seen)).to(self.seen.device))
        self.updates = int(sd["updates"])
        self.hutchinson_seed = int(sd.get("hutchinson_seed", 0))
