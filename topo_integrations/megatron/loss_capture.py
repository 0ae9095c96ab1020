"""The model's own loss as a closure, for ``importance.method = "hutchinson"`` (the engine
differentiates it twice at a class refresh, topo_integrations/reducer/classes/importance.py).

Megatron's schedules own the training loop, so no loss closure is handed to the plugin. But
``GPTModel.forward(..., labels=labels)`` returns the per-token losses: a forward pre-hook on the
wrapped module records the arguments of the latest forward (the last micro-batch), and the closure
re-runs the module on them and takes the mean. With pipeline parallelism no stage has the whole
loss: refused at start (topo_integrations/megatron/refusals.py). ``TopoAlignDDP.topo_set_loss_closure``
replaces the captured closure with the user's own.
"""

from __future__ import annotations

import torch

from ..config import ConfigError

__all__ = ["LossCapture"]


class LossCapture:
    """Records the latest forward call of ``module``; `closure` recomputes its loss."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.last: tuple[tuple, dict] | None = None
        self.handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, args, kwargs):
        self.last = (tuple(args), dict(kwargs))

    def closure(self) -> torch.Tensor:
        """Mean of the module's output on the latest recorded inputs (the per-token losses)."""
        if self.last is None:
            raise ConfigError("topo_align: importance.method = 'hutchinson' in the Megatron adapter (TopoAlignDDP): "
                              "no forward call was recorded before the class refresh; call "
                              "topo_set_loss_closure(fn) or use 'fisher' / 'magnitude'")
        args, kwargs = self.last
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        if labels is None:
            raise ConfigError("topo_align: importance.method = 'hutchinson' in the Megatron adapter (TopoAlignDDP) "
                              "needs the model's forward to return the loss (call it with labels=...), or a closure "
                              "from topo_set_loss_closure(fn); or use 'fisher' / 'magnitude'")
        with torch.enable_grad():
            return self.module(*args, **kwargs).float().mean()

    def close(self) -> None:
        self.handle.remove()
