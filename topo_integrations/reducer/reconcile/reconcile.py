"""Reconciliation of LOCAL tensors across groups: what an adapter hands over and how it is averaged.

Part of the :class:`~topo_integrations.reducer.engine.Engine` (its reconciliation methods live here
as :class:`ReconcileMixin`); an adapter describes its LOCAL tensors with :class:`ReconcileItem` and a
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

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..classes.classes import LOCAL, SYNC

log = logging.getLogger("topo_align")

__all__ = ["ReconcileItem", "ReconcileSource", "ParamReconcileSource", "ReconcileMixin", "PendingAverage",
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


def _flat(items: list[ReconcileItem], device) -> torch.Tensor:
    if not items:
        return torch.zeros(0, device=device)
    return torch.cat([it.tensor.detach().reshape(-1).float() for it in items]).to(device)


def _scatter(items: list[ReconcileItem], flat: torch.Tensor, snap: torch.Tensor | None = None) -> None:
    off = 0
    with torch.no_grad():
        for it in items:
            t, n = it.tensor, it.tensor.numel()
            seg = flat[off:off + n].view(t.shape)
            if snap is None:
                t.copy_(seg.to(t.dtype))
            else:
                t.add_((seg - snap[off:off + n].view(t.shape)).to(t.dtype))
            if it.nonneg:  # a lossy delta (or a late correction) may undershoot a second moment
                t.clamp_(min=0)
            off += n



class ReconcileMixin:
    """The Engine's reconciliation (see the module docstring); uses the Engine's cfg, wire, drift,
    classes and workers."""

    # Reconciliation, in three parts per call (every rank calls at the same steps):
    #   values  -- the LOCAL parameters (and fp32 masters): with an exact fp32 wire and no outer
    #              optimizer their mean; else the mean of their change since the last reconciliation
    #              (the anchor, identical on every rank) on the `reconcile_dtype` wire with error
    #              feedback, put through the outer optimizer: target = anchor + outer(mean delta);
    #   states  -- optimizer moments, only when `_moments_due` (or forced): fp32 means, or the mean
    #              change since the moment anchor on the `moments_dtype` wire with error feedback;
    #   both split into replicated items (identical inside a group) and shards (per-rank partitions).

    def _items(self, source, local, moments: bool):
        items = source.items(local) if source is not None and local else []
        vals = [i for i in items if not i.state]
        states = [i for i in items if i.state] if moments else []
        order = lambda xs: [i for i in xs if not i.shard] + [i for i in xs if i.shard]  # noqa: E731
        return order(vals), order(states)

    def _stream_k(self) -> int:
        """Fragments in use: ``local.stream_fragments``, at most the current interval (an adaptive
        level may have changed it)."""
        return max(1, min(self.cfg.local.stream_fragments, self.reconcile_interval))

    def _fragment_names(self) -> list[list[str]]:
        return fragments(self.local_names(), self.numels, self._stream_k())

    def _moments_due(self, forced: bool, frag: int = 0) -> bool:
        return forced or (self._frag_reconciles.get(frag, 0) + 1) % self.cfg.local.moments_interval == 0

    def _uses_delta(self, keys: list[str], frag: int) -> bool:
        """Delta averaging needs an anchor of the same layout (the first reconciliation of a layout
        averages values exactly and sets it)."""
        wants = self.reconcile_dtype != torch.float32 or self.cfg.local.outer_momentum > 0 or \
            self.cfg.local.outer_lr != 1.0
        a = self._anchors.get(frag)
        return wants and a is not None and a["keys"] == keys

    def _moments_delta(self, skeys: list[str], frag: int) -> bool:
        """A lossy moment wire averages the change since the moment anchor of the same layout (the
        first moment average of a layout is exact in fp32 and sets it)."""
        a = self._sanchors.get(frag)
        return self.moments_dtype != torch.float32 and a is not None and a["keys"] == skeys

    def _average_chunks(self, flat: torch.Tensor, items: list[ReconcileItem], *, wire: torch.dtype,
                        key: str) -> list[Callable[[], None]]:
        """Phases, each cut into chunks of the bucket size (dispatcher items, so reconciliation never
        holds the slow tier longer than one chunk): 1. replicated part: each member averages 1/L of
        it over the rail (leaf + spine with three levels), the group all-gathers; 2. partition part:
        one rail all-reduce / K (peers hold the same partition)."""
        nr = sum(i.tensor.numel() for i in items if not i.shard)
        return (self.wire.reconcile_chunks(flat[:nr], shard=False, wire=wire, key=key)
                + self.wire.reconcile_chunks(flat[nr:], shard=True, wire=wire, key=key))

    def _outer(self, delta: torch.Tensor, anchor: dict) -> torch.Tensor:
        """The outer optimizer's step from the mean delta (identity with momentum 0 and lr 1)."""
        m, lr = self.cfg.local.outer_momentum, self.cfg.local.outer_lr
        if m > 0:
            v = anchor.get("momentum")
            v = delta.clone() if v is None else v.mul_(m).add_(delta)
            anchor["momentum"] = v
            delta = delta + m * v
        return delta * lr if lr != 1.0 else delta

    def _measure(self, items: list[ReconcileItem], before: torch.Tensor, after: torch.Tensor, step: int) -> None:
        segs, off = [], 0
        for it in items:
            if it.param is not None:
                segs.append((it.param, off, it.tensor.numel()))
            off += it.tensor.numel()
        self.drift.measure_segments(segs, before, after, self.wire, step)

    def _launch_average(self, vals, states, *, blocking: bool, frag: int = 0) -> PendingAverage:
        """Snapshot and hand the average's chunks to the dispatcher: held until the next step's SYNC
        reductions are issued (asynchronous), or run now (blocking)."""
        keys = [i.key for i in vals]
        snap = _flat(vals, self.device)
        delta = self._uses_delta(keys, frag)
        send = snap - self._anchors[frag]["flat"] if delta else snap.clone()
        skeys = [i.key for i in states]
        ssnap = _flat(states, self.device)
        sdelta = bool(states) and self._moments_delta(skeys, frag)
        savg = ssnap - self._sanchors[frag]["flat"] if sdelta else ssnap.clone()
        p = PendingAverage(keys=keys, skeys=skeys, snap=snap, avg=send, delta=delta,
                           ssnap=ssnap, savg=savg, sdelta=sdelta, fragment=frag)
        chunks = self._chunks_of(p, vals, states)
        part = f", fragment {frag + 1} of {self._stream_k()}" if self._stream_k() > 1 else ""
        what = f"reconciliation of step {self.step}{part} ({send.numel() + savg.numel()} elements)"
        if blocking:
            self.dispatcher.run_reconcile(chunks, what)
        else:
            p.future = self.dispatcher.submit_reconcile(chunks, what)
            p.items, p.chunks = self.dispatcher.last_reconcile_items, len(chunks)
        return p

    def _chunks_of(self, p: PendingAverage, vals, states) -> list[Callable[[], None]]:
        """The average's chunks (values, then moments): the same list at the launch and when a run
        resumed from a state saved mid-average finishes it."""
        wire = self.reconcile_dtype if p.delta else torch.float32
        chunks = self._average_chunks(p.avg, vals, wire=wire, key="reconcile")
        if states:
            swire = self.moments_dtype if p.sdelta else torch.float32
            chunks += self._average_chunks(p.savg, states, wire=swire, key="moments")
        return chunks

    def _finish_average(self, p) -> torch.Tensor:
        """The reconciled values (identical on every rank) from a finished average; updates the anchor."""
        a = self._anchors.get(p.fragment)
        if p.delta:
            target = a["flat"] + self._outer(p.avg, a)
        else:
            target = p.avg
            if a is None or a["keys"] != p.keys:
                a = self._anchors[p.fragment] = {"keys": list(p.keys), "flat": None, "momentum": None}
        a["flat"] = target.clone()
        return target

    def _finish_states(self, p) -> torch.Tensor:
        """The averaged moments (identical on every replica) from a finished average; with a lossy
        ``moments_dtype`` they become the moment anchor (unclamped: the clamp is the tensor's)."""
        if not p.skeys:
            return p.savg
        starget = self._sanchors[p.fragment]["flat"] + p.savg if p.sdelta else p.savg
        if self.moments_dtype != torch.float32:
            self._sanchors[p.fragment] = {"keys": list(p.skeys), "flat": starget.clone()}
        return starget

    def _reconcile_blocking(self, source, *, moments: bool = False, frag: int | None = None) -> None:
        """Average now: fragment ``frag``, or (None) every fragment in order, i.e. the whole LOCAL set."""
        parts = self._fragment_names()
        todo = range(len(parts)) if frag is None else [frag]
        done: set[str] = set()
        for f in todo:
            vals, states = self._items(source, parts[f], self._moments_due(moments, f))
            if vals or states:
                p = self._launch_average(vals, states, blocking=True, frag=f)
                target = self._finish_average(p)
                _scatter(vals, target)
                _scatter(states, self._finish_states(p))
                source.written()
                self._measure(vals, p.snap, target, self.step)
            self._frag_reconciles[f] = self._frag_reconciles.get(f, 0) + 1
            done.update(parts[f])
        self.all_synced = frag is None or len(parts) == 1
        self.reconciles += 1
        # The replicas of what was just averaged are identical: the only moment a LOCAL tensor may
        # become SYNC. A promoted (SYNC) tensor is identical everywhere, so it may turn LOCAL anytime.
        promoted, demoted = self.drift.promotions(self.classes, self.numels, eligible=done)
        if promoted or demoted:
            self._log_promotion_bytes(promoted, demoted)
            self.reconfigure(classes={n: (SYNC if n in promoted else LOCAL if n in demoted else c)
                                      for n, c in self.classes.items()})

    def _log_promotion_bytes(self, promoted: list[str], demoted: list[str]) -> None:
        """What the change costs on the slow tier per step (SYNC every step on its wire instead of a
        reconciliation every interval on the reconciliation wire; byte estimates, scales left out)."""
        net = sum(self.numels[n] for n in promoted) - sum(self.numels[n] for n in demoted)
        per = self.sync_dtype.itemsize - self.reconcile_dtype.itemsize / self.reconcile_interval
        used = sum(self.numels[n] for n in self.drift.promoted)
        log.info("topo_align: step %d: promoted tensors now %d elements (%.1f%% of the %.1f%% budget); this "
                 "change adds about %.0f slow-tier bytes per step and rank", self.step, used,
                 100 * used / max(1, self.drift.total_numel), 100 * self.drift.promote_fraction, net * per)

    def _reconcile_async(self, source, frag: int = 0) -> None:
        local = self._fragment_names()[frag]
        vals, states = self._items(source, local, self._moments_due(False, frag))
        if not (vals or states):
            self.all_synced = self._stream_k() == 1
            return
        p = self._launch_average(vals, states, blocking=False, frag=frag)
        p.local, p.step, p.moments = local, self.step, bool(states)
        self._pending = p
        self._frag_reconciles[frag] = self._frag_reconciles.get(frag, 0) + 1
        self.reconciles += 1

    def _apply_pending(self, source) -> None:
        p, self._pending = self._pending, None
        if p.future is not None:
            self.wait(p.future)
        vals, states = self._items(source, p.local, p.moments)
        if [i.key for i in vals] != p.keys or [i.key for i in states] != p.skeys:
            raise RuntimeError("topo_align: the tensors to reconcile changed between the snapshot and the "
                               "correction (optimizer state created or dropped?)")
        if p.chunks_done is not None and p.chunks_done < p.chunks:
            # Resumed from a state saved mid-average: the chunks that had not landed, as they would have.
            self.dispatcher.run_reconcile(self._chunks_of(p, vals, states)[p.chunks_done:],
                                          f"reconciliation of step {p.step}, resumed at chunk {p.chunks_done + 1}")
        target = self._finish_average(p)
        _scatter(vals, target, snap=p.snap)
        _scatter(states, self._finish_states(p), snap=p.ssnap)
        source.written()
        self._measure(vals, p.snap, target, p.step)
        self.max_staleness = max(self.max_staleness, self.step - p.step)

    def _pending_state(self) -> dict | None:
        """The pending average as saved state, issuing no collective: the chunks already released
        (by every rank, at the same point) are waited for; held ones stay held and are recorded as
        not done, so a resumed run runs them before the correction (bitwise the same average)."""
        p = self._pending
        if p is None:
            return None
        done = None
        if p.future is not None and p.items is not None:
            done = self.dispatcher.settle_released(p.items)
        sd = p.state_dict()
        if done is not None and done < len(p.items):
            sd["chunks_done"] = done
        return sd

    def drain(self) -> None:
        """Wait for an in-flight asynchronous average (no new collective); keeps the correction."""
        p = self._pending
        if p is not None and p.future is not None:
            self.wait(p.future)
            p.future = None
