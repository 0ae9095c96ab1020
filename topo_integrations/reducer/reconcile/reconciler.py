"""The reconciler: the engine's part that averages LOCAL tensors across groups, and its state.

What is averaged and how is described in reconcile.py (the module docstring): values against the
anchor through the outer optimizer, optimizer moments at every ``local.moments_interval``-th
reconciliation, replicated items and shards, streaming fragments, the asynchronous correction one
step later. This part owns everything that carries from one reconciliation to the next: the anchors
per fragment (values and moments), the reconciliations per fragment, the average in flight
(:class:`~topo_integrations.reducer.reconcile.PendingAverage`), the counters (reconciliations,
staleness), the interval and wire dtypes, and the adapter's latest source. It issues its collectives
through the engine's dispatcher (the one schedule) on the dispatcher's current wire, and measures
drift into the class policy's monitor; the engine decides *when* (:meth:`Engine.after_step`) and
acts on promotions.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...config import TopoAlignConfig
from ..wire.compression import wire_dtype
from .reconcile import PendingAverage, ReconcileItem, ReconcileSource, due_fragment, fragments

__all__ = ["Reconciler"]

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




class Reconciler:
    """Reconciliation of one engine (see the module docstring). ``policy``: the engine's
    :class:`~topo_integrations.reducer.classes.policy.ClassPolicy` (LOCAL names, sizes, drift);
    ``dispatcher``: the engine's schedule (its ``wire`` follows a regrouping)."""

    def __init__(self, cfg: TopoAlignConfig, policy, dispatcher, *, device: torch.device):
        self.local = cfg.local
        self.policy = policy
        self.dispatcher = dispatcher
        self.device = device
        self.interval = cfg.local.reconcile_interval
        """Optimizer steps between reconciliations (an adaptive level may multiply it)."""
        self.dtype = wire_dtype(cfg.local.reconcile_dtype)
        """The wire of the values' deltas."""
        self.moments_dtype = wire_dtype(cfg.local.moments_dtype)
        self.anchors: dict[int, dict] = {}
        """Per fragment (0 without streaming): the last reconciled LOCAL values (keys, flat fp32,
        outer momentum), identical on every rank."""
        self.sanchors: dict[int, dict] = {}
        """Per fragment: the last averaged LOCAL optimizer moments (keys, flat fp32), kept with a
        lossy ``local.moments_dtype`` only: identical on every replica of each item."""
        self.frag_reconciles: dict[int, int] = {}
        """Reconciliations per fragment (the moment average is due at every ``moments_interval``-th)."""
        self.pending: PendingAverage | None = None
        """The asynchronous average whose correction is due after the next optimizer step."""
        self.reconciles = 0
        self.all_synced = True
        """Whether every replica is identical right now (no LOCAL tensor, or a blocking reconciliation
        of the whole LOCAL set ended this step)."""
        self.max_staleness = 0
        """The most optimizer steps a correction was applied after its snapshot."""
        self.source: ReconcileSource | None = None
        """The adapter's reconcile source of the latest step (used by adaptive level changes)."""

    @property
    def wire(self):
        """The dispatcher's wire (a regrouping replaces it there)."""
        return self.dispatcher.wire

    def reset_anchors(self) -> None:
        """A new LOCAL set (new fragments): its first reconciliation averages values exactly."""
        self.anchors, self.sanchors = {}, {}

    # Reconciliation, in three parts per call (every rank calls at the same steps):
    #   values  -- the LOCAL parameters (and fp32 masters): with an exact fp32 wire and no outer
    #              optimizer their mean; else the mean of their change since the last reconciliation
    #              (the anchor, identical on every rank) on the `dtype` wire with error
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

    def stream_k(self) -> int:
        """Fragments in use: ``local.stream_fragments``, at most the current interval (an adaptive
        level may have changed it)."""
        return max(1, min(self.local.stream_fragments, self.interval))

    def due(self, step: int) -> int | None:
        """The fragment due at optimizer step ``step`` (None: no reconciliation this step)."""
        return due_fragment(step, self.interval, self.stream_k())

    def _fragment_names(self) -> list[list[str]]:
        return fragments(self.policy.local_names(), self.policy.numels, self.stream_k())

    def _moments_due(self, forced: bool, frag: int = 0) -> bool:
        return forced or (self.frag_reconciles.get(frag, 0) + 1) % self.local.moments_interval == 0

    def _uses_delta(self, keys: list[str], frag: int) -> bool:
        """Delta averaging needs an anchor of the same layout (the first reconciliation of a layout
        averages values exactly and sets it)."""
        wants = self.dtype != torch.float32 or self.local.outer_momentum > 0 or self.local.outer_lr != 1.0
        a = self.anchors.get(frag)
        return wants and a is not None and a["keys"] == keys

    def _moments_delta(self, skeys: list[str], frag: int) -> bool:
        """A lossy moment wire averages the change since the moment anchor of the same layout (the
        first moment average of a layout is exact in fp32 and sets it)."""
        a = self.sanchors.get(frag)
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
        m, lr = self.local.outer_momentum, self.local.outer_lr
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
        self.policy.drift.measure_segments(segs, before, after, self.wire, step)

    def _launch_average(self, vals, states, step: int, *, blocking: bool, frag: int = 0) -> PendingAverage:
        """Snapshot and hand the average's chunks to the dispatcher: held until the next step's SYNC
        reductions are issued (asynchronous), or run now (blocking)."""
        keys = [i.key for i in vals]
        snap = _flat(vals, self.device)
        delta = self._uses_delta(keys, frag)
        send = snap - self.anchors[frag]["flat"] if delta else snap.clone()
        skeys = [i.key for i in states]
        ssnap = _flat(states, self.device)
        sdelta = bool(states) and self._moments_delta(skeys, frag)
        savg = ssnap - self.sanchors[frag]["flat"] if sdelta else ssnap.clone()
        p = PendingAverage(keys=keys, skeys=skeys, snap=snap, avg=send, delta=delta,
                           ssnap=ssnap, savg=savg, sdelta=sdelta, fragment=frag)
        chunks = self._chunks_of(p, vals, states)
        part = f", fragment {frag + 1} of {self.stream_k()}" if self.stream_k() > 1 else ""
        what = f"reconciliation of step {step}{part} ({send.numel() + savg.numel()} elements)"
        if blocking:
            self.dispatcher.run_reconcile(chunks, what)
        else:
            p.future = self.dispatcher.submit_reconcile(chunks, what)
            p.items, p.chunks = self.dispatcher.last_reconcile_items, len(chunks)
        return p

    def _chunks_of(self, p: PendingAverage, vals, states) -> list[Callable[[], None]]:
        """The average's chunks (values, then moments): the same list at the launch and when a run
        resumed from a state saved mid-average finishes it."""
        wire = self.dtype if p.delta else torch.float32
        chunks = self._average_chunks(p.avg, vals, wire=wire, key="reconcile")
        if states:
            swire = self.moments_dtype if p.sdelta else torch.float32
            chunks += self._average_chunks(p.savg, states, wire=swire, key="moments")
        return chunks

    def _finish_average(self, p) -> torch.Tensor:
        """The reconciled values (identical on every rank) from a finished average; updates the anchor."""
        a = self.anchors.get(p.fragment)
        if p.delta:
            target = a["flat"] + self._outer(p.avg, a)
        else:
            target = p.avg
            if a is None or a["keys"] != p.keys:
                a = self.anchors[p.fragment] = {"keys": list(p.keys), "flat": None, "momentum": None}
        a["flat"] = target.clone()
        return target

    def _finish_states(self, p) -> torch.Tensor:
        """The averaged moments (identical on every replica) from a finished average; with a lossy
        ``moments_dtype`` they become the moment anchor (unclamped: the clamp is the tensor's)."""
        if not p.skeys:
            return p.savg
        starget = self.sanchors[p.fragment]["flat"] + p.savg if p.sdelta else p.savg
        if self.moments_dtype != torch.float32:
            self.sanchors[p.fragment] = {"keys": list(p.skeys), "flat": starget.clone()}
        return starget

    # ------------------------------------------------------------------ the engine's calls

    def blocking(self, source, step: int, *, moments: bool = False, frag: int | None = None) -> set[str]:
        """Average now: fragment ``frag``, or (None) every fragment in order, i.e. the whole LOCAL set.
        Returns the names averaged (their replicas are identical now: the engine may promote them)."""
        parts = self._fragment_names()
        todo = range(len(parts)) if frag is None else [frag]
        done: set[str] = set()
        for f in todo:
            vals, states = self._items(source, parts[f], self._moments_due(moments, f))
            if vals or states:
                p = self._launch_average(vals, states, step, blocking=True, frag=f)
                target = self._finish_average(p)
                _scatter(vals, target)
                _scatter(states, self._finish_states(p))
                source.written()
                self._measure(vals, p.snap, target, step)
            self.frag_reconciles[f] = self.frag_reconciles.get(f, 0) + 1
            done.update(parts[f])
        self.all_synced = frag is None or len(parts) == 1
        self.reconciles += 1
        return done

    def launch(self, source, step: int, frag: int = 0) -> None:
        """Snapshot fragment ``frag`` and start its average (asynchronous); the correction is applied
        by :meth:`apply_pending` after the next optimizer step."""
        local = self._fragment_names()[frag]
        vals, states = self._items(source, local, self._moments_due(False, frag))
        if not (vals or states):
            self.all_synced = self.stream_k() == 1
            return
        p = self._launch_average(vals, states, step, blocking=False, frag=frag)
        p.local, p.step, p.moments = local, step, bool(states)
        self.pending = p
        self.frag_reconciles[frag] = self.frag_reconciles.get(frag, 0) + 1
        self.reconciles += 1

    def apply_pending(self, source, step: int) -> None:
        """Apply the correction of the average in flight, if any: ``x += target - snapshot``."""
        p, self.pending = self.pending, None
        if p is None:
            return
        if p.future is not None:
            self.dispatcher.wait(p.future)
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
        self.max_staleness = max(self.max_staleness, step - p.step)

    def drain(self) -> None:
        """Wait for an in-flight asynchronous average (no new collective); keeps the correction."""
        p = self.pending
        if p is not None and p.future is not None:
            self.dispatcher.wait(p.future)
            p.future = None

    # ------------------------------------------------------------------ state

    def _pending_state(self) -> dict | None:
        """The pending average as saved state, issuing no collective: the chunks already released
        (by every rank, at the same point) are waited for; held ones stay held and are recorded as
        not done, so a resumed run runs them before the correction (bitwise the same average)."""
        p = self.pending
        if p is None:
            return None
        done = None
        if p.future is not None and p.items is not None:
            done = self.dispatcher.settle_released(p.items)
        sd = p.state_dict()
        if done is not None and done < len(p.items):
            sd["chunks_done"] = done
        return sd

    def state_dict(self) -> dict:
        """This part's keys of the engine's state (``topo-align/engine/v1``: the names are the
        format's). Issues no collective (see :meth:`_pending_state`)."""
        pend = self._pending_state()

        def to_cpu(d):
            return None if d is None else {k: (v.cpu().clone() if torch.is_tensor(v) else v) for k, v in d.items()}

        return {"reconciles": self.reconciles, "all_synced": self.all_synced, "pending": pend,
                "anchors": {f: to_cpu(a) for f, a in self.anchors.items()},
                "moments_anchors": {f: to_cpu(a) for f, a in self.sanchors.items()},
                "fragment_reconciles": dict(self.frag_reconciles), "max_staleness": self.max_staleness}

    def load_state_dict(self, sd: dict) -> None:
        """Restore this part's keys of an engine state (states of 0.2 and older included)."""
        self.reconciles = int(sd.get("reconciles", 0))
        self.all_synced = bool(sd["all_synced"])
        self.max_staleness = int(sd["max_staleness"])

        def to_dev(d):
            return None if d is None else {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in d.items()}

        self.pending = PendingAverage.from_state(sd.get("pending"), self.device)
        # states of 0.2 and older: one anchor (fragment 0) and one reconciliation counter
        anchors = sd.get("anchors", {0: sd.get("anchor")})
        sanchors = sd.get("moments_anchors", {0: sd.get("moments_anchor")})
        self.anchors = {int(f): to_dev(a) for f, a in anchors.items() if a is not None}
        self.sanchors = {int(f): to_dev(a) for f, a in sanchors.items() if a is not None}
        self.frag_reconciles = {int(f): int(n) for f, n in
                                sd.get("fragment_reconciles", {0: self.reconciles}).items()}
