"""The process's one schedule: one issuing order, one trace, one deadline watch for every engine.

Several engines may live in one process (Megatron's virtual-pipeline chunks, the expert engine):
each has its own :class:`~topo_integrations.reducer.schedule.dispatch.Dispatcher` (its policy: wire
dtypes, release points, held buckets), and all of them issue through the one :class:`Schedule`
attached to their :class:`~topo_integrations.reducer.plan.groups.ReducerGroups` (``groups.schedule``;
an adapter building a second set of groups for the same process passes the first one's schedule
on with :meth:`Schedule.attach`). So on every rank the collectives of all engines leave in one
sequence (released in program order on the training thread), a single trace fingerprints them
all (``monitor.check_collectives``), and one watch bounds them (completion.py).

Issue and completion per backend (completion.py):

1. ``host`` (gloo): the calls block. With a thread (``retain(threaded=True)``, asked for by an
   engine that overlaps communication with the caller) the schedule's thread issues them in
   release order; without one the caller does.
2. ``event`` (NCCL): the caller's thread enqueues on one communication stream (high priority),
   after the producer's work (an event recorded at submission); the future completes at enqueue
   and carries the stream's work (CUDA-aware future), so waiters' streams wait and the host does not.
3. ``deferred``: as ``event``, on the CPU test double of a stream.

A watcher thread polls the watch against ``fallback.timeout_s`` (``event``/``deferred``), and so
does every host-side wait; the first deadline missed aborts the communicators and fails every wait.

The threads hold the schedule weakly (and nothing of an item once it is issued): an engine dropped
without ``close()`` takes its schedule, its process groups and the threads with it. A gloo group lives
as long as anything holds it, with three threads of its own (a job that rebuilds its model, a test
world that builds a hundred engines).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..kinds import Traffic
from ..watch.completion import StreamDouble, Watch, completion_kind
from ..watch.errors import CollectiveError
from ..watch.thread_device import start_thread
from .order import Trace

__all__ = ["Schedule", "Item"]

log = logging.getLogger("topo_align")


@dataclass(eq=False)
class Item:
    """One unit of the schedule: a bucket's reduction, a reconciliation chunk, a control call."""

    what: str
    traffic: Traffic
    fn: Callable[[], Any]
    future: torch.futures.Future
    owner: Any = None
    """The dispatcher that made it (told when it is booked: reconciliation counters, chunk times)."""
    ready: Any = None
    """CUDA: an event on the producer's stream at submission (the comm stream waits for it)."""
    done: threading.Event = field(default_factory=threading.Event)
    """Host and deferred: set once the item's collectives completed (or failed)."""
    value: Any = None
    """What the future carries when known before issue (a bucket's tensor: its data arrives later)."""
    result: Any = None
    error: BaseException | None = None
    submitted: float = 0.0
    started: float | None = None
    finished: float | None = None
    seconds: float | None = None
    """Host: wall time of the issuing call. CUDA: from ``events`` once resolved."""
    events: tuple | None = None
    """CUDA: (start, end) timing events on the comm stream around the item."""
    reconcile: bool = False


class Schedule:
    """See the module docstring. Made by :meth:`of`; shared through ``groups.schedule``."""

    def __init__(self, device, *, timeout_s: float | None, check: bool = False):
        self.device = torch.device(device)
        self.kind = completion_kind(self.device)
        self.timeout_s = timeout_s
        self.trace = Trace() if check else None
        self.watch = Watch(timeout_s, abort=self._abort)
        self._groups: list = []
        self._stream = torch.cuda.Stream(device=self.device, priority=-1) if self.kind == "event" else None
        self._double = StreamDouble() if self.kind == "deferred" else None
        if self._double is not None:
            weakref.finalize(self, self._double.close)
        self.threaded = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._running: Item | None = None
        self._broken: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, Item] = {}
        """id(future) -> its item, until booked."""
        self._users = 0

    @classmethod
    def of(cls, groups, *, device, timeout_s: float | None, check: bool = False) -> "Schedule":
        """The schedule attached to ``groups`` (made and attached on first use)."""
        s = getattr(groups, "schedule", None)
        if s is None:
            s = cls(device, timeout_s=timeout_s, check=check)
            s.attach(groups)
        elif check and s.trace is None:
            s.trace = Trace()
            for g in s._groups:
                g.trace = s.trace
        return s

    def attach(self, groups) -> None:
        """Issue ``groups``' collectives here too (same trace, same watch; aborted together)."""
        groups.schedule = self
        groups.trace = self.trace
        groups.watch = self.watch
        if all(g is not groups for g in self._groups):
            self._groups.append(groups)

    def retain(self, *, threaded: bool) -> None:
        """An engine starts using the schedule; ``threaded``: it wants the issuing thread (host)."""
        with self._lock:
            self._users += 1
            if threaded and self.kind == "host":
                self.threaded = True
        if self.kind != "host" and self.timeout_s and self._watcher is None:
            ref, closing = weakref.ref(self), self._closing
            weakref.finalize(self, closing.set)
            self._watcher = start_thread(lambda: _watch_loop(ref, closing), name="topo_align_watch")

    def release_user(self) -> None:
        """An engine closed; the last one stops the threads (after the released items)."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if not last:
            return
        self._closing.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self._double is not None:
            self._double.close()

    # ------------------------------------------------------------------ items

    def item(self, what: str, traffic: Traffic, fn: Callable[[], Any], *, owner=None, reconcile: bool = False) -> Item:
        cuda = self.kind == "event"
        fut = torch.futures.Future(devices=[self.device]) if cuda else torch.futures.Future()
        it = Item(what, Traffic(traffic), fn, fut, owner=owner, submitted=time.perf_counter(), reconcile=reconcile)
        if cuda:
            it.ready = torch.cuda.Event()
            it.ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending[id(fut)] = it
        return it

    def find(self, fut) -> Item | None:
        with self._lock:
            return self._pending.get(id(fut))

    def release(self, items: list[Item]) -> None:
        """Issue ``items`` in this order, after everything released before."""
        if not items:
            return
        if not self.threaded:
            for it in items:
                self._execute(it)
            return
        if self._thread is None:
            ref, q = weakref.ref(self), self._queue
            self._thread = start_thread(lambda: _issue_loop(ref, q), name="topo_align_dispatch")
            weakref.finalize(self, q.put, None)
        for it in items:
            self._queue.put(it)

    def fail(self, it: Item, exc: BaseException) -> None:
        it.error = exc
        it.future.set_exception(exc)
        self._book(it)

    # ------------------------------------------------------------------ issuing

    def _execute(self, it: Item) -> None:
        self._running = it
        it.started = time.perf_counter()
        try:
            broken = self._broken or self.watch.expired
            if broken is not None:
                raise CollectiveError(f"topo_align: {it.what} not issued: an earlier collective failed "
                                      f"({type(broken).__name__}: {broken})")
            if self.kind == "host":
                started = time.perf_counter()
                it.result = it.fn()
                it.finished = time.perf_counter()
                it.seconds = it.finished - started
                it.future.set_result(it.result)
            elif self.kind == "event":
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(it.ready)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(self._stream)
                    it.result = it.fn()
                    end.record(self._stream)
                    it.events = (start, end)
                    # A CUDA-aware future: waiters' streams wait for this stream's work so far.
                    it.future.set_result(it.result)
            else:
                self._double.enqueue(lambda: self._on_stream(it))
                # NCCL's semantics: the future completes at enqueue, before the data has arrived.
                it.future.set_result(it.value)
                self._running = None
                return
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            if self._broken is None:
                self._broken = exc
            self._running = None
            self.fail(it, exc)
            return
        self._running = None
        self._book(it)

    def _on_stream(self, it: Item) -> None:
        """The double's stream runs one item (its collectives block here, not in the caller)."""
        self._running = it
        started = it.started = time.perf_counter()
        try:
            it.result = it.fn()
            it.finished = time.perf_counter()
            it.seconds = it.finished - started
        except BaseException as exc:  # noqa: BLE001 - the waiter raises it
            it.error = exc
            if self._broken is None:
                self._broken = exc
        self._running = None
        self._book(it)

    def _book(self, it: Item) -> None:
        """The item's host part is over: no longer pending; its owner and waiters are told."""
        with self._lock:
            self._pending.pop(id(it.future), None)
        if it.owner is not None:
            it.owner._booked(it)
        it.done.set()

    # ------------------------------------------------------------------ completion and bounds

    def landed(self, it: Item) -> bool:
        """Whether the item's data has arrived (``event``: its end event completed)."""
        if self.kind == "event":
            return it.done.is_set() and (it.events is None or it.events[1].query())
        return it.done.is_set()

    def wait(self, it: Item, *, host: bool) -> None:
        """Bounded wait for ``it``. ``host``: the caller reads the data on the host (control values),
        so wait until it has arrived; otherwise on CUDA only the stream waits (``fut.wait()``), never
        the host. Raises the item's error, or the watch's once a deadline is missed."""
        if self.kind == "event" and not host and it.done.is_set():
            self._raise_for(it)
            return
        while not self.landed(it):
            err = self.watch.poll() or self._stalled()
            if err is not None:
                self._broken = self._broken or err
                raise err
            if self.kind == "event":
                time.sleep(0.0002)
            else:
                it.done.wait(Watch.POLL_S)
        self._raise_for(it)

    def _raise_for(self, it: Item) -> None:
        if it.error is not None:
            raise it.error
        if self.watch.expired is not None:
            raise self.watch.expired

    def _stalled(self) -> CollectiveError | None:
        """The issuing item has run past ``fallback.timeout_s`` with no collective in flight (stuck
        outside the communicators, e.g. in a framework callback): the same bound, named by item."""
        r = self._running
        if r is None or r.started is None or not self.timeout_s or self.watch.in_flight():
            return None
        waited = time.perf_counter() - r.started
        if waited <= self.timeout_s:
            return None
        return CollectiveError(f"topo_align: {r.what} did not complete within fallback.timeout_s = "
                               f"{self.timeout_s:g}s ({waited:.1f}s; no collective of it in flight)")

    def _abort(self) -> None:
        """The communicators of every attached set of groups are aborted (NCCL), or the stream
        double stops; every pending item fails with the watch's error."""
        if self._double is not None:
            self._double.abort()
        if self.kind == "event":
            import torch.distributed as dist

            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            seen: set[int] = set()
            for g in self._groups:
                for pg in (g.intra, g.inter, g.intra_low, g.inter_low, g.leaf_rail, g.spine_rail,
                           g.leaf_rail_low, g.spine_rail_low, g.dp_group):
                    if pg is None or id(pg) in seen or abort is None:
                        continue
                    seen.add(id(pg))
                    abort(pg)
        with self._lock:
            pending = list(self._pending.values())
        for it in pending:
            if not it.done.is_set():
                it.error = it.error or self.watch.expired
                self._book(it)


def _issue_loop(ref: "weakref.ref[Schedule]", q: queue.SimpleQueue) -> None:
    """The issuing thread (``host`` with a thread): items in release order until the schedule
    closes or is collected (module docstring: the thread holds it weakly, no item between items)."""
    while True:
        it = q.get()
        s = ref() if it is not None else None
        if s is None:
            return
        s._execute(it)
        del it, s


def _watch_loop(ref: "weakref.ref[Schedule]", closing: threading.Event) -> None:
    """``event``/``deferred``: find the first missed deadline even when nobody waits."""
    while not closing.wait(Watch.POLL_S):
        s = ref()
        if s is None:
            return
        if s.watch.in_flight() and s.watch.poll() is not None:
            s._broken = s._broken or s.watch.expired
            return
        del s
