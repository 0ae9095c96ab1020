"""The dispatcher: the one layer that issues the engine's collectives, in one ordered schedule.

An adapter maps its framework's buffers to :class:`CommBucket` s and calls
``reduce(bucket, cls) -> torch.futures.Future`` (the contract of a PyTorch DDP comm hook); the
engine's own traffic (reconciliation chunks, control scalars, probes) goes through the same queue.
Everything else is decided here, once, from the plan and the config: the wire dtype of each hop,
the error-feedback residual (keyed by the bucket), two or three levels, and the timing.

The schedule (docs/reducer.md, "One schedule"):

1. **One issuing thread.** On the CPU (gloo calls block) the dispatcher's thread issues every
   collective, so communication overlaps backward; on CUDA the caller's thread enqueues them on one
   communication stream (NCCL calls return once enqueued) and waits are stream waits on events.
   Either way the collectives leave in the order they were *released*, one at a time.
2. **Release points are fixed by the program, never by timing.** SYNC buckets are released when
   submitted; LOCAL buckets are held until the adapter says the step's SYNC buckets are all
   submitted (:meth:`Dispatcher.sync_done`) or a caller waits for one of them. An asynchronous
   reconciliation is cut into chunks: the first ``k`` go at its launch, into the window before the
   next step's first SYNC bucket (forward), ``k`` agreed over the DP group from measured window and
   chunk times; the rest is held until every bucket of the next step is submitted
   (:meth:`Dispatcher.all_submitted`) or someone needs the average. A release point is a position
   in the sequence of submissions, not a time: which buckets fill during backward may differ between
   ranks (a parameter without gradient on one rank), the sequence SYNC..., LOCAL...,
   reconciliation... does not.
   Submissions come from the training thread in program order, so the released sequence, hence
   every communicator's sequence and their interleaving, is the same on every rank.
3. **Priority.** Within a step the SYNC reductions go first; LOCAL (island tier) and reconciliation
   (slow tier, in chunks) follow, so reconciliation never queues ahead of a SYNC reduction on the
   slow tier.
4. **Completion and bounds.** An item is done when its collectives completed (CPU: the blocking
   calls returned; CUDA: the future carries the stream's events). Waits are bounded by
   ``fallback.timeout_s``: past it the wait raises :class:`CollectiveError` naming the item in
   flight. After a failure every later item fails at once (no second wait on a dead peer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .collectives import CollectiveError
from .kinds import Cls, Mode, Traffic
from .order import CollectiveOrderError, Trace, compare
from .recipes import Collective, CommBucket, Reduction, recipe

__all__ = ["Collective", "Reduction", "CommBucket", "Dispatcher", "CollectiveOrderError"]

log = logging.getLogger("topo_align")


@dataclass(eq=False)
class _Item:
    what: str
    traffic: Traffic
    fn: Callable[[], Any]
    future: torch.futures.Future
    ready: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    submitted: float = 0.0
    finished: float | None = None
    reconcile: bool = False


def _ema(old: float | None, x: float, decay: float = 0.7) -> float:
    return x if old is None else decay * old + (1 - decay) * x


class Dispatcher:
    """See the module docstring. ``wire`` holds the groups, the residuals and the statistics."""

    def __init__(self, wire, *, threaded: bool, timeout_s: float | None, check: bool = False):
        self.wire = wire
        self.device = wire.device
        self.cuda = self.device.type == "cuda"
        # gloo collectives block the caller: a thread gives the overlap. NCCL enqueues: one thread
        # (the caller's) keeps the issue order without any thread of ours.
        self.threaded = bool(threaded) and not self.cuda
        self.timeout_s = timeout_s
        self.mode: Mode = Mode.HIERARCHICAL
        self.sync_dtype = torch.float32
        self.local_dtype = torch.float32
        self._stream = torch.cuda.Stream(device=self.device, priority=-1) if self.cuda else None
        self._held_local: list[_Item] = []
        self._held_reconcile: list[_Item] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running: _Item | None = None
        self._broken: BaseException | None = None
        self._lock = threading.Lock()
        self._rc_outstanding = 0
        self._pending_items: dict[int, _Item] = {}
        """id(future) -> its item, until done (wait() finds held and running items here)."""
        self.trace = Trace() if check else None
        wire.groups.trace = self.trace
        self.schedule: list[dict] = []
        """Per step: ``sync_tail_s`` (last SYNC submission -> last SYNC completion) and
        ``reconcile_in_flight`` (a reconciliation was outstanding when the step's SYNC began)."""
        self._window_s: float | None = None
        """EMA of the time from the end of a step to the next step's first SYNC submission."""
        self._chunk_s: float | None = None
        """EMA of one reconciliation chunk's time on the comm thread."""
        self._t_step_end: float | None = None
        self._window_plans = 0
        self._window_k = 0
        self.last_window_chunks: tuple[int, int] | None = None
        """(chunks released into the pre-SYNC window, chunks) of the latest asynchronous reconciliation."""
        self.reconcile_release = "window"
        """The rule: ``"window"`` (the chunks that fit before the next first SYNC bucket go at launch,
        the rest after ``all_submitted``). For the ablation of scripts/sync_priority.py only:
        ``"held"`` (all after ``all_submitted``) and ``"launch"`` (all at launch, ahead of the next
        step's buckets)."""
        self._step_sync: list[_Item] = []
        self._step_rc = False
        self._local_open = False
        """After sync_done and until all_submitted: LOCAL buckets go when submitted."""

    # ------------------------------------------------------------------ policy inputs

    def configure(self, *, mode: Mode, sync_dtype: torch.dtype, local_dtype: torch.dtype) -> None:
        """The engine's current mode and wire dtypes (changed only at step boundaries)."""
        self.mode, self.sync_dtype, self.local_dtype = Mode(mode), sync_dtype, local_dtype

    def set_wire(self, wire) -> None:
        """New groups (adaptive regrouping): same schedule, new communicators."""
        self.wire = wire
        wire.groups.trace = self.trace

    # ------------------------------------------------------------------ the adapters' call

    def reduce(self, bucket: CommBucket, cls: Cls) -> torch.futures.Future:
        """Reduce one bucket of one class; the future's value is ``bucket.out`` or ``bucket.flat``."""
        cls = Cls(cls)
        fn = recipe(self.wire, bucket, cls, mode=self.mode, sync_dtype=self.sync_dtype,
                    local_dtype=self.local_dtype)
        value = bucket.out if bucket.out is not None else bucket.flat
        traffic = Traffic.SYNC if cls is Cls.SYNC or self.mode is Mode.FLAT else Traffic.LOCAL

        def job():
            fn()
            return value

        item = self._item(f"{bucket.collective} of {cls} bucket {bucket.key!r} ({bucket.flat.numel()} elements)",
                          traffic, job)
        if traffic is Traffic.SYNC:
            if not self._step_sync:
                self._step_rc = self._rc_outstanding > 0
                if self._t_step_end is not None:  # the window before the step's first SYNC bucket
                    self._window_s = _ema(self._window_s, item.submitted - self._t_step_end)
            self._step_sync.append(item)
            self._release([item])
        elif self._local_open:
            self._release([item])
        else:
            self._held_local.append(item)
        return item.future

    def sync_done(self) -> None:
        """Every SYNC bucket of this step is submitted: release the LOCAL buckets (held and later)."""
        self._release(self._take_held(reconcile=False))
        self._local_open = True

    def all_submitted(self) -> None:
        """Every bucket of this step is submitted: release LOCAL, then the held reconciliation."""
        self._release(self._take_held(reconcile=True))
        self._local_open = False

    def wait(self, fut: torch.futures.Future):
        """The future's value, bounded by ``fallback.timeout_s``; held LOCAL work is released first
        (a caller waiting for it is a fixed point of the program)."""
        item = self._find(fut)
        if item is not None:
            if any(i is item for i in self._held_local):
                self._release(self._take_held(reconcile=False))
            if any(i is item for i in self._held_reconcile):
                self._release(self._take_held(reconcile=True))
            self._wait_item(item)
        return fut.wait()

    def call(self, fn: Callable[[], Any], what: str, traffic: Traffic = Traffic.CONTROL):
        """Run ``fn`` (one or more collectives) in the schedule now and return its value."""
        item = self._item(what, traffic, fn)
        self._release([item])
        return self.wait(item.future)

    def submit_reconcile(self, chunks: list[Callable[[], None]], what: str) -> torch.futures.Future:
        """An asynchronous reconciliation: the future completes with the last chunk (items run in
        order and fail fast). The first ``k`` chunks go now, into the window before the next step's
        first SYNC bucket, where no SYNC reduction can be pending; the rest is held until every bucket
        of the next step is submitted. ``k`` is the number of chunks that fit the window, from the
        measured window and chunk times agreed over the DP group (:meth:`plan_window`, which the engine
        calls on every rank before); 0 at the first reconciliation (nothing measured yet)."""
        items = self._chunk_items(chunks, what, reconcile=True)
        if not items:
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut
        with self._lock:
            self._rc_outstanding += len(items)
        if self.reconcile_release == "launch":
            self._release(items)
            return items[-1].future
        k, self._window_k = self._window_k, 0
        self.last_window_chunks = (min(k, len(items)), len(items))
        self._release(items[:k])
        self._held_reconcile.extend(items[k:])
        return items[-1].future

    def run_reconcile(self, chunks: list[Callable[[], None]], what: str) -> None:
        """A blocking reconciliation: the chunks go now (after anything released) and are waited for."""
        items = self._chunk_items(chunks, what, reconcile=False)
        self._release(items)
        for it in items:
            self.wait(it.future)

    def plan_window(self) -> None:
        """How many chunks of the coming asynchronous reconciliation go at once (into the window
        before the next step's first SYNC bucket). The engine calls it on every rank at every
        asynchronous reconciliation step, whatever this rank has to send (a collective over the DP
        group from the second call on: the first has nothing measured)."""
        if self.reconcile_release != "window":
            self._window_k = 0
            return
        self._window_k = self._window_chunks() if self._window_plans > 0 else 0
        self._window_plans += 1

    def _window_chunks(self) -> int:
        """Chunks that fit in the pre-SYNC window on every rank: floor(0.8 * min window / max chunk)."""
        import math

        w = self._window_s if self._window_s is not None else 0.0
        c = self._chunk_s if self._chunk_s is not None else math.inf
        vec = torch.tensor([-w, c], dtype=torch.float64, device=self.device)
        agreed = self.wire.agree(vec, "max").cpu().tolist()
        window, chunk = -agreed[0], agreed[1]
        if not (chunk > 0 and math.isfinite(chunk)) or window <= 0:
            return 0
        return int(0.8 * window / chunk)

    def drain(self) -> None:
        """Wait until every released item is done (held ones stay held)."""
        self.call(lambda: None, "drain")

    # ------------------------------------------------------------------ step boundary

    def end_step(self, step: int) -> None:
        """Close the step: its schedule figures; with the check on, compare the fingerprints of
        every rank (one all_gather_object over the DP group, not traced) and raise
        :class:`CollectiveOrderError` at the first divergence."""
        if self._step_sync:
            last_submit = max(i.submitted for i in self._step_sync)
            done = [i.finished for i in self._step_sync if i.finished is not None]
            if done and not self.cuda:
                self.schedule.append({"step": step, "sync_tail_s": max(done) - last_submit,
                                      "reconcile_in_flight": self._step_rc})
                del self.schedule[:-10000]
        self._step_sync = []
        self._local_open = False
        self._t_step_end = time.perf_counter()
        if self.trace is None:
            return
        self.drain()
        mine = self.trace.take()
        g = self.wire.groups
        if g.dp_size < 2:
            return
        import torch.distributed as dist

        gathered: list = [None] * g.dp_size
        from .collectives import bounded

        bounded(f"all_gather_object(collective fingerprints, step {step})", self.timeout_s,
                lambda: dist.all_gather_object(gathered, (dist.get_rank(), mine), group=g.dp_group))
        compare(dict(gathered), step=step)

    def close(self) -> None:
        """Stop the thread after the released items; held items are dropped (their futures fail).

        Never issues a collective: close() may run from a garbage collector (a framework engine's
        ``__del__``) at a point that differs between ranks."""
        dropped = self._take_held(reconcile=True)
        for it in dropped:
            self._fail(it, CollectiveError(f"topo_align: {it.what} was never issued: the engine was closed"))
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ the queue

    def _item(self, what: str, traffic: Traffic, fn, *, reconcile: bool = False) -> _Item:
        fut = torch.futures.Future(devices=[self.device]) if self.cuda else torch.futures.Future()
        item = _Item(what, Traffic(traffic), fn, fut, submitted=time.perf_counter(), reconcile=reconcile)
        if self.cuda:
            item.ready = torch.cuda.Event()
            item.ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending_items[id(fut)] = item
        return item

    def _chunk_items(self, chunks: list[Callable[[], None]], what: str, *, reconcile: bool) -> list[_Item]:
        """Reconciliation chunks as items; ``reconcile``: counted as outstanding (asynchronous)."""
        return [self._item(f"{what}, chunk {i + 1}/{len(chunks)}", Traffic.RECONCILE, c, reconcile=reconcile)
                for i, c in enumerate(chunks)]

    def _find(self, fut) -> _Item | None:
        with self._lock:
            return self._pending_items.get(id(fut))

    def _take_held(self, *, reconcile: bool) -> list[_Item]:
        out, self._held_local = self._held_local, []
        if reconcile:
            out += self._held_reconcile
            self._held_reconcile = []
        return out

    def _release(self, items: list[_Item]) -> None:
        if not items:
            return
        if not self.threaded:
            for it in items:
                self._execute(it)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="topo_align_dispatch", daemon=True)
            self._thread.start()
        for it in items:
            self._queue.put(it)

    def _loop(self) -> None:
        while True:
            it = self._queue.get()
            if it is None:
                return
            self._execute(it)

    def _execute(self, it: _Item) -> None:
        self._running = it
        try:
            if self._broken is not None:
                raise CollectiveError(f"topo_align: {it.what} not issued: an earlier collective failed "
                                      f"({type(self._broken).__name__}: {self._broken})")
            if self._stream is None:
                started = time.perf_counter()
                value = it.fn()
                it.finished = time.perf_counter()
                if it.reconcile:
                    self._chunk_s = _ema(self._chunk_s, it.finished - started)
                it.future.set_result(value)
            else:
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(it.ready)
                    value = it.fn()
                    # A CUDA-aware future: waiters' streams wait for this stream's work so far.
                    it.future.set_result(value)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            if self._broken is None:
                self._broken = exc
            self._running = None
            self._fail(it, exc)
            return
        self._running = None
        self._settle(it)

    WAIT_SLACK_S = 10.0
    """Added to twice ``fallback.timeout_s`` for a wait: the collective's own timeout (the groups
    carry ``fallback.timeout_s``) should fire first and name the real cause."""

    def _fail(self, it: _Item, exc: BaseException) -> None:
        it.error = exc
        it.future.set_exception(exc)
        self._settle(it)

    def _settle(self, it: _Item) -> None:
        """Book a finished (or failed) item: no longer outstanding, waiters released."""
        if it.reconcile:
            with self._lock:
                self._rc_outstanding -= 1
        with self._lock:
            self._pending_items.pop(id(it.future), None)
        it.done.set()

    def _wait_item(self, it: _Item) -> None:
        limit = None if not self.timeout_s else 2 * self.timeout_s + self.WAIT_SLACK_S
        if not it.done.wait(limit):
            running = self._running
            raise CollectiveError(
                f"topo_align: {it.what} did not complete within {limit:g}s (fallback.timeout_s = "
                f"{self.timeout_s:g}); in flight: {running.what if running else 'nothing'}")
        if it.error is not None:
            raise it.error
