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
4. **Completion and bounds.** Issue, completion and deadlines belong to the process's one
   :class:`~topo_integrations.reducer.schedule.Schedule` (shared by every engine of the process):
   every collective ends within ``fallback.timeout_s`` of its issue, done or in one
   :class:`CollectiveError` naming op, tier, communicator, ranks and seconds (completion.py); on
   CUDA completion is an event polled by the schedule's watcher, never a host wait in the step.
   After a failure every later item fails at once (no second wait on a dead peer).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from ..kinds import Cls, Mode, Traffic
from ..watch.errors import CollectiveError
from .order import CollectiveOrderError, compare
from .recipes import Collective, CommBucket, Reduction, recipe
from .schedule import Item, Schedule

__all__ = ["Collective", "Reduction", "CommBucket", "Dispatcher", "CollectiveOrderError"]

log = logging.getLogger("topo_align")


def _ema(old: float | None, x: float, decay: float = 0.7) -> float:
    return x if old is None else decay * old + (1 - decay) * x


class Dispatcher:
    """See the module docstring. ``wire`` holds the groups, the residuals and the statistics."""

    def __init__(self, wire, *, threaded: bool, timeout_s: float | None, check: bool = False,
                 schedule: Schedule | None = None):
        self.wire = wire
        self.device = wire.device
        self.cuda = self.device.type == "cuda"
        self.timeout_s = timeout_s
        # One schedule per process (schedule.py): every engine whose groups share it issues through it.
        self.sched = schedule or Schedule.of(wire.groups, device=self.device, timeout_s=timeout_s, check=check)
        # gloo collectives block the caller: a thread gives the overlap. NCCL enqueues: the caller's
        # thread keeps the issue order without any thread of ours.
        self.sched.retain(threaded=bool(threaded))
        self.mode: Mode = Mode.HIERARCHICAL
        self.sync_dtype = torch.float32
        self.local_dtype = torch.float32
        self._held_local: list[Item] = []
        self._held_reconcile: list[Item] = []
        self._lock = threading.Lock()
        self._rc_outstanding = 0
        self.last_reconcile_items: list[Item] = []
        """The chunks of the latest asynchronous reconciliation (for a state saved while in flight)."""
        self._timed_chunks: list[Item] = []
        """CUDA: reconciliation chunks whose timing events are not resolved yet (read a step late)."""
        self.schedule: list[dict] = []
        """Per step: ``sync_tail_s`` (last SYNC submission -> last SYNC completion) and
        ``reconcile_in_flight`` (a reconciliation was outstanding when the step's SYNC began)."""
        self._window_s: float | None = None
        """EMA of the time from the end of a step to the next step's first SYNC submission."""
        self._chunk_s: float | None = None
        """EMA of one reconciliation chunk's time on the comm thread."""
        self._t_step_end: float | None = None
        self._ev_step_end = None
        """CUDA: a timing event on the training stream at the latest step's end."""
        self._timed_windows: list[tuple] = []
        """CUDA: (step end, first SYNC submission) event pairs not resolved yet (read a step late)."""
        self._window_plans = 0
        self._window_k = 0
        self.last_window_chunks: tuple[int, int] | None = None
        """(chunks released into the pre-SYNC window, chunks) of the latest asynchronous reconciliation."""
        self.reconcile_release = "window"
        """The rule: ``"window"`` (the chunks that fit before the next first SYNC bucket go at launch,
        the rest after ``all_submitted``). For the ablation of scripts/sync_priority.py only:
        ``"held"`` (all after ``all_submitted``) and ``"launch"`` (all at launch, ahead of the next
        step's buckets)."""
        self._step_sync: list[Item] = []
        self._step_rc = False
        self._local_open = False
        """After sync_done and until all_submitted: LOCAL buckets go when submitted."""
        self.waited_s = 0.0
        """Seconds callers blocked in :meth:`wait` and :meth:`call` (`method: auto` takes them out of
        the step to time the compute: reducer/adaptive/method.py)."""
        self.device_waits: list[tuple] | None = None
        """CUDA, while `method: auto` times the compute (it sets a list): (before, after) timing events
        on the training stream around each wait for the communication stream. On CUDA the host does
        not block there, so ``waited_s`` misses it; the events time the stream's idle wait."""

    # ------------------------------------------------------------------ policy inputs

    def configure(self, *, mode: Mode, sync_dtype: torch.dtype, local_dtype: torch.dtype) -> None:
        """The engine's current mode and wire dtypes (changed only at step boundaries)."""
        self.mode, self.sync_dtype, self.local_dtype = Mode(mode), sync_dtype, local_dtype

    @property
    def trace(self):
        """The process's fingerprint trace (``monitor.check_collectives``), or None."""
        return self.sched.trace

    @property
    def threaded(self) -> bool:
        return self.sched.threaded

    def set_wire(self, wire) -> None:
        """New groups (adaptive regrouping): same schedule, new communicators."""
        self.wire = wire
        self.sched.attach(wire.groups)

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
        item.value = value
        if traffic is Traffic.SYNC:
            if not self._step_sync:
                self._step_rc = self._rc_outstanding > 0
                self._window_ends(item)
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
        (a caller waiting for it is a fixed point of the program). On CUDA the caller's stream waits
        for the data (the host does not)."""
        item = self.sched.find(fut)
        if item is not None:
            if any(i is item for i in self._held_local):
                self._release(self._take_held(reconcile=False))
            if any(i is item for i in self._held_reconcile):
                self._release(self._take_held(reconcile=True))
            t0 = time.perf_counter()
            try:
                self.sched.wait(item, host=False)
                if not self.cuda and item.value is not None:
                    return item.value
                start = self._stream_mark()
                value = fut.wait()
                self._stream_waited(start)
                return value
            finally:
                self.waited_s += time.perf_counter() - t0
        return fut.wait()

    def _stream_mark(self):
        """A timing event on the training stream before it waits for the communication stream, while
        :attr:`device_waits` is collected (CUDA); else None."""
        if self.device_waits is None or not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _stream_waited(self, start) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self.device_waits.append((start, end))

    def call(self, fn: Callable[[], Any], what: str, traffic: Traffic = Traffic.CONTROL):
        """Run ``fn`` (one or more collectives) in the schedule now and return its value, once its
        data has arrived (a control value the caller reads on the host)."""
        return self.collect(self.issue(fn, what, traffic))

    def issue(self, fn: Callable[[], Any], what: str, traffic: Traffic = Traffic.CONTROL) -> Item:
        """Release ``fn`` in the schedule now (its place in the one order); its value is read later,
        with :meth:`collect`, by a caller that need not wait for it now."""
        item = self._item(what, traffic, fn)
        self._release([item])
        return item

    def landed(self, item: Item) -> bool:
        """Whether ``item``'s data has arrived (never waits)."""
        return self.sched.landed(item)

    def collect(self, item: Item, *, host: bool = True):
        """The value of an issued item once its data has arrived (bounded host wait). Not ``host``
        (a device value the caller goes on computing with): on CUDA the caller's stream waits for it,
        the host does not (as for a bucket, :meth:`wait`); on the CPU the same as ``host``."""
        t0 = time.perf_counter()
        try:
            if host or not self.cuda:
                self.sched.wait(item, host=True)
            else:
                self.sched.wait(item, host=False)
                start = self._stream_mark()
                item.future.wait()  # CUDA-aware: the current stream waits for the comm stream's work
                self._stream_waited(start)
        finally:
            self.waited_s += time.perf_counter() - t0  # method: auto times compute without these waits
        return item.result

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
        self.last_reconcile_items = items
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

    def _window_ends(self, item: Item) -> None:
        """The step's first SYNC bucket closes the window opened at the previous step's end: its
        length on the host clock (CPU), or between two timing events on the training stream (CUDA:
        the host runs ahead of the device, its clock would time the enqueueing), read once landed."""
        if self.cuda:
            if self._ev_step_end is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(self.device))
                self._timed_windows.append((self._ev_step_end, ev))
                del self._timed_windows[:-64]
                self._ev_step_end = None
        elif self._t_step_end is not None:
            self._window_s = _ema(self._window_s, item.submitted - self._t_step_end)

    def _resolve_chunk_times(self) -> None:
        """CUDA: window and chunk times from the timing events that have landed (never waits)."""
        windows = []
        for start, end in self._timed_windows:
            if end.query():
                self._window_s = _ema(self._window_s, start.elapsed_time(end) / 1000.0)
            else:
                windows.append((start, end))
        self._timed_windows = windows
        left = []
        for it in self._timed_chunks:
            start, end = it.events
            if end.query():
                self._chunk_s = _ema(self._chunk_s, start.elapsed_time(end) / 1000.0)
            else:
                left.append(it)
        self._timed_chunks = left

    def _window_chunks(self) -> int:
        """Chunks that fit in the pre-SYNC window on every rank: floor(0.8 * min window / max chunk)."""
        import math

        self._resolve_chunk_times()

        w = self._window_s if self._window_s is not None else 0.0
        c = self._chunk_s if self._chunk_s is not None else math.inf
        vec = torch.tensor([-w, c], dtype=torch.float64, device=self.device)
        # k decides which chunks go now, the same on every rank: read on the host (a copy made on the
        # comm stream inside the agreement, Wire.agree_later; no drain of the training stream).
        agreed = self.wire.agree(vec, "max", host=True).tolist()
        window, chunk = -agreed[0], agreed[1]
        if not (chunk > 0 and math.isfinite(chunk)) or window <= 0:
            return 0
        return int(0.8 * window / chunk)

    def settle_released(self, items: list[Item]) -> int:
        """Wait (bounded) for the leading ``items`` that were released, issuing nothing; returns how
        many of them, from the front, are done. Held items stay held."""
        n = 0
        for it in items:
            if any(h is it for h in self._held_reconcile) or any(h is it for h in self._held_local):
                break
            self.sched.wait(it, host=True)
            n += 1
        return n

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
        if self.cuda:  # the window opens here on the training stream (_window_ends)
            self._ev_step_end = torch.cuda.Event(enable_timing=True)
            self._ev_step_end.record(torch.cuda.current_stream(self.device))
        if self.trace is None:
            return
        self.drain()
        mine = self.trace.take()
        g = self.wire.groups
        if g.dp_size < 2:
            return
        import torch.distributed as dist

        gathered: list = [None] * g.dp_size
        from ..watch.bounded import bounded

        bounded(f"all_gather_object(collective fingerprints, step {step})", self.timeout_s,
                lambda: dist.all_gather_object(gathered, (dist.get_rank(), mine), group=g.dp_group))
        compare(dict(gathered), step=step)

    def close(self) -> None:
        """Drop this engine's held items (their futures fail); the last engine of the schedule stops
        its threads after the released items.

        Never issues a collective: close() may run from a garbage collector (a framework engine's
        ``__del__``) at a point that differs between ranks."""
        dropped = self._take_held(reconcile=True)
        for it in dropped:
            self.sched.fail(it, CollectiveError(f"topo_align: {it.what} was never issued: the engine was closed"))
        self.sched.release_user()

    # ------------------------------------------------------------------ the queue

    def _item(self, what: str, traffic: Traffic, fn, *, reconcile: bool = False) -> Item:
        return self.sched.item(what, traffic, fn, owner=self, reconcile=reconcile)

    def _chunk_items(self, chunks: list[Callable[[], None]], what: str, *, reconcile: bool) -> list[Item]:
        """Reconciliation chunks as items; ``reconcile``: counted as outstanding (asynchronous)."""
        return [self._item(f"{what}, chunk {i + 1}/{len(chunks)}", Traffic.RECONCILE, c, reconcile=reconcile)
                for i, c in enumerate(chunks)]

    def _take_held(self, *, reconcile: bool) -> list[Item]:
        out, self._held_local = self._held_local, []
        if reconcile:
            out += self._held_reconcile
            self._held_reconcile = []
        return out

    def _release(self, items: list[Item]) -> None:
        self.sched.release(items)

    def _booked(self, it: Item) -> None:
        """The schedule is done with ``it`` on the host (schedule.py): chunk times, counters."""
        if it.reconcile:
            if it.seconds is not None and it.error is None:
                self._chunk_s = _ema(self._chunk_s, it.seconds)
            elif it.events is not None:
                self._timed_chunks.append(it)
            with self._lock:
                self._rc_outstanding -= 1
