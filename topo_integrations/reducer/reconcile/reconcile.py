"""Reconciliation of LOCAL tensors across groups: what an adapter hands over and how it is averaged.

The engine's part that runs it is the :class:`~topo_integrations.reducer.reconcile.reconciler.Reconciler`
(``engine.reconciler``); an adapter describes its LOCAL tensors with :class:`ReconcileItem` and a
:class:`ReconcileSource`. Per reconciliation (every rank calls at the same steps):

  values  the LOCAL parameters (and fp32 masters): with an exact fp32 wire and no outer optimizer
          their mean; else the mean of their change since the last reconciliation (the anchor,
          identical on every rank) on the ``local.reconcile_dtype`` wire with error feedback, put
          through the outer optimizer: ``target = anchor + outer(mean delta)``;
  states  optimizer moments, only at every ``local.moments_interval``-th reconciliation and whenever
          the classes may change or a checkpoint is written: fp32 means, or with a lossy
          ``local.moments_dtype`` the mean change since the last moment average (the moment anchor)
          on that wire with error feedback, second moments clamped at 0;
  both split into replicated items (identical inside a group: 1/L of them crosses the slow tier
  per rank) and shards (per-rank partitions: averaged over the rail).

Asynchronous: the snapshot is averaged through the dispatcher while the next step runs; after the next
optimizer step the correction ``x += target - snapshot`` is applied (second moments clamped at 0).

Streaming (``local.stream_fragments`` F > 1): the LOCAL set is cut into F fragments of consecutive
tensors (:func:`fragments`) and one fragment is reconciled per due step (:func:`due_fragment`); each
fragment keeps its own anchors, moment counter and outer momentum. A blocking reconciliation of the
whole set (save, class refresh) runs every fragment in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

__all__ = ["ReconcileItem", "ReconcileSource", "ParamReconcileSource", "PendingAverage",
           "is_second_moment", "fragments", "due_fragment"]


@dataclass
class ReconcileItem:
    """One tensor to average across groups at a reconciliation."""

    key: str
    """Stable identifier (same on every rank and at every reconciliation of the same classes)."""
    tensor: torch.Tensor
    """Written in place (a view into the framework's storage is fine)."""
    shard: bool = False
    """True for a partition that differs per rank inside a group (ZeRO / distributed optimizer): the
    same partition of every group is averaged over the rail. False for a tensor that is identical
    inside the group: each member averages 1/L of it over the rail, then the group all-gathers."""
    param: str | None = None
    """The parameter whose values (or a slice of them) this is; drift is measured on these."""
    nonneg: bool = False
    """A second moment: clamped at 0 whenever an average writes it (an asynchronous correction or a
    lossy ``local.moments_dtype`` delta may undershoot)."""
    state: bool = False
    """Optimizer state (moments): averaged on the ``local.moments_dtype`` wire, only at every
    ``local.moments_interval``-th reconciliation and at the blocking ones that precede a save, a class
    refresh or a promotion."""


class ReconcileSource(Protocol):
    """What an adapter gives the engine to reconcile."""

    def items(self, local: list[str]) -> list[ReconcileItem]:
        """The tensors of the LOCAL parameters ``local`` (and their optimizer state), in a fixed order."""

    def written(self) -> None:
        """Called after the items were changed (e.g. copy fp32 masters to the model, re-gather)."""


def fragments(names: list[str], numels: dict[str, int], k: int) -> list[list[str]]:
    """``names`` (in model order) cut into ``k`` runs of consecutive tensors of about equal elements:
    a tensor goes to the fragment its middle element falls in. Some may be empty (a tensor larger
    than a fragment's share). Deterministic from agreed inputs: the same on every rank."""
    total = sum(numels[n] for n in names)
    out: list[list[str]] = [[] for _ in range(k)]
    seen = 0
    for n in names:
        mid = seen + numels[n] / 2
        out[min(k - 1, int(k * mid / total)) if total else 0].append(n)
        seen += numels[n]
    return out


def due_fragment(step: int, interval: int, k: int) -> int | None:
    """The fragment reconciled at optimizer step ``step`` (None: none is due). Fragment ``f`` at the
    steps with ``step % interval == (f + 1) * interval // k % interval``: k = 1 gives every
    ``interval``-th step; each fragment is reconciled every ``interval`` steps; ``k <= interval``."""
    phase = step % interval
    for f in range(k):
        if (f + 1) * interval // k % interval == phase:
            return f
    return None


def is_second_moment(key: str) -> bool:
    """Whether an optimizer-state key names a second moment (exp_avg_sq, max_exp_avg_sq, Adagrad sum)."""
    return "sq" in key or key in ("sum", "square_avg")


class ParamReconcileSource:
    """Parameters that are full tensors on every rank, plus the torch optimizer state of their shape."""

    def __init__(self, params: dict[str, torch.Tensor], optimizer=None,
                 masters: Callable[[], dict[str, torch.Tensor]] | None = None):
        self.params = params
        self.optimizer = optimizer
        self.masters = masters
        """name -> the fp32 tensor the optimizer steps on, when it is not the parameter itself."""

    def items(self, local: list[str]) -> list[ReconcileItem]:
        masters = self.masters() if self.masters is not None else {}
        out = [ReconcileItem(f"param:{n}", self.params[n].data, param=n) for n in local]
        out += [ReconcileItem(f"master:{n}", masters[n].data) for n in local if n in masters]
        state = getattr(self.optimizer, "state", None) or {}
        for n in local:
            p = masters.get(n, self.params[n])
            st = state.get(p, {})
            for k in sorted(st):
                v = st[k]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                    out.append(ReconcileItem(f"state:{n}:{k}", v, nonneg=is_second_moment(k), state=True))
        return out

    def written(self) -> None:
        pass


@dataclass
class PendingAverage:
    """An average in flight (or finished but not yet applied): what the correction needs."""

    keys: list[str]
    """Keys of the value items, in order (checked against the items at the correction)."""
    skeys: list[str]
    """Keys of the optimizer-state items."""
    snap: torch.Tensor
    """The values at the snapshot (flat fp32)."""
    avg: torch.Tensor
    """What is averaged in place: the values, or their delta from the anchor."""
    delta: bool
    """Whether ``avg`` holds the mean delta (target = anchor + outer(delta)) or the mean values."""
    ssnap: torch.Tensor
    savg: torch.Tensor
    local: list[str] = field(default_factory=list)
    """The LOCAL names at the snapshot (asynchronous only): the fragment's with streaming."""
    fragment: int = 0
    """The fragment averaged (0 without streaming): whose anchors the average uses."""
    step: int = 0
    """The optimizer step of the snapshot."""
    moments: bool = False
    """Whether optimizer state is part of it."""
    sdelta: bool = False
    """Whether ``savg`` holds the mean change of the moments since the moment anchor."""
    future: Any = None
    """The dispatcher's future of the last chunk; None once waited (or after a restore)."""
    items: Any = None
    """The dispatcher's items of the chunks, in order (runtime only)."""
    chunks_done: int | None = None
    """Restored from a state saved while the average was in flight: the first ``chunks_done`` of
    ``chunks`` chunks had landed, the rest run (blocking) before the correction. None otherwise."""
    chunks: int = 0

    def state_dict(self) -> dict:
        return {k: (v.cpu().clone() if torch.is_tensor(v) else v) for k, v in self.__dict__.items()
                if k not in ("future", "items")}

    @classmethod
    def from_state(cls, sd: dict | None, device) -> "PendingAverage | None":
        if sd is None:
            return None
        return cls(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in sd.items()})
