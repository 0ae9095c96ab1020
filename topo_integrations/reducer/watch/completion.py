"""When an issued collective is done, and what happens when it is not done in time.

How a collective completes depends on the backend (the schedule's ``completion``):

``host``      gloo on the CPU: the call blocks until the data has arrived; done when it returns.
``event``     NCCL on CUDA: the call returns once the kernel is enqueued; the data has arrived when a
              CUDA event recorded after it on the issuing stream has completed (``Event.query()``).
              Nobody waits on the host for it: waiters' streams wait on the event.
``deferred``  the test double of ``event`` on the CPU (:class:`StreamDouble`): the call is handed to
              a stand-in for the GPU stream (one thread, FIFO) and returns at once, so a future
              completes at enqueue and the data arrives later, or never. It drives the same code
              as ``event`` (tests/test_completion.py runs the fault cases against it).

Every collective issued through ``collectives.run`` is an :class:`InFlight` in the schedule's
:class:`Watch` from its issue until its data has arrived. The watch is polled against
``fallback.timeout_s`` counted from the collective's issue (the dispatcher's watcher thread, and any
thread waiting for a result); the first collective past it becomes one :class:`CollectiveError`
naming op, tier, communicator, ranks and seconds; the communicators are aborted (``event``: the
NCCL kernels stop, the default stream is never blocked on the dead peer), and every later wait
fails at once with the same error.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .errors import CollectiveError
from .thread_device import start_thread

__all__ = ["InFlight", "Watch", "StreamDouble", "DEFERRED_ENV", "completion_kind", "backstop_timeout_s"]

log = logging.getLogger("topo_align")

DEFERRED_ENV = "TOPO_ALIGN_DEFERRED_COMPLETION"
"""Set to 1 to run the CPU schedule with NCCL's completion semantics (the ``deferred`` test double)."""


def completion_kind(device) -> str:
    """``event`` on CUDA; on the CPU ``deferred`` when ``$TOPO_ALIGN_DEFERRED_COMPLETION=1``, else ``host``."""
    if getattr(device, "type", str(device)) == "cuda":
        return "event"
    return "deferred" if os.environ.get(DEFERRED_ENV, "").strip() not in ("", "0", "false", "no") else "host"


def backstop_timeout_s(timeout_s: float | None, kind: str) -> float | None:
    """The timeout given to the process groups. ``host`` (gloo blocks and raises at its group
    timeout): ``fallback.timeout_s`` itself. ``event``/``deferred``: later than the watch, so the
    named error and the abort come from topo-align before NCCL's watchdog kills the process."""
    if not timeout_s or kind == "host":
        return timeout_s
    return timeout_s + max(10.0, 0.25 * timeout_s)


@dataclass(eq=False)
class InFlight:
    """One issued collective until its data has arrived."""

    op: str
    tier: str
    comm: str
    """The communicator, as ``ReducerGroups.describe`` names it (with its global ranks)."""
    rank: int
    """This process's global rank."""
    issued: float
    query: Callable[[], bool] | None = None
    """None while the issuing call runs (host, deferred); afterwards True once the data has arrived."""
    done: bool = False

    def landed(self) -> bool:
        if not self.done and self.query is not None and self.query():
            self.done = True
        return self.done

    def error(self, timeout_s: float, now: float) -> CollectiveError:
        return CollectiveError(
            f"topo_align: {self.op} on the {self.comm} did not complete within fallback.timeout_s = "
            f"{timeout_s:g}s ({now - self.issued:.1f}s since it was issued; {self.tier} tier; this is global rank "
            f"{self.rank}): a rank did not call it, died, or a link is down; the communicators were aborted")


class Watch:
    """The collectives in flight of one schedule and their deadline (see the module docstring).

    ``abort()`` is called once, from the thread that finds the first collective past its deadline."""

    POLL_S = 0.02

    def __init__(self, timeout_s: float | None, abort: Callable[[], None] | None = None):
        self.timeout_s = timeout_s
        self.abort = abort
        self._lock = threading.Lock()
        self._flight: list[InFlight] = []
        self.expired: CollectiveError | None = None
        """The first deadline missed (every later wait raises it)."""

    def begin(self, op: str, tier: str, comm: str, rank: int) -> InFlight:
        f = InFlight(op, tier, comm, rank, time.perf_counter())
        with self._lock:
            if len(self._flight) >= 256:  # nobody polled (blocking calls, all landed): forget those
                self._flight = [g for g in self._flight if not g.done]
            self._flight.append(f)
        return f

    def end(self, f: InFlight, query: Callable[[], bool] | None = None) -> None:
        """The issuing call returned: done now (``query`` None), or once ``query()`` is True."""
        if query is None:
            f.done = True
        else:
            f.query = query

    def drop(self, f: InFlight) -> None:
        """The issuing call raised (its own error names it): no longer watched."""
        f.done = True

    def in_flight(self) -> int:
        with self._lock:
            return sum(not f.done for f in self._flight)

    def poll(self) -> CollectiveError | None:
        """Forget what has landed; the first collective past its deadline becomes :attr:`expired`
        (logged, communicators aborted) and is returned; None while every deadline holds."""
        if self.expired is not None:
            return self.expired
        now = time.perf_counter()
        late = None
        with self._lock:
            self._flight = [f for f in self._flight if not f.landed()]
            if self.timeout_s:
                late = next((f for f in self._flight if now - f.issued > self.timeout_s), None)
            if late is None or self.expired is not None:
                return self.expired
            self.expired = late.error(self.timeout_s, now)
        log.error("%s", self.expired)
        if self.abort is not None:
            try:
                self.abort()
            except Exception as exc:  # noqa: BLE001 - the named error matters more than the abort's
                log.error("topo_align: aborting the communicators failed: %s: %s", type(exc).__name__, exc)
        return self.expired


class StreamDouble:
    """A stand-in for a CUDA communication stream on the CPU: work runs on one thread in FIFO order,
    after the call that enqueued it has returned. :meth:`abort` (the communicator abort) releases
    every waiter and drops what has not started; a call stuck in a blocking gloo collective stays
    stuck on its (daemon) thread until the group's backstop timeout, as a kernel would."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.aborted = threading.Event()
        self._thread = start_thread(self._loop, name="topo_align_stream_double")

    def enqueue(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def abort(self) -> None:
        self.aborted.set()

    def close(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            if not self.aborted.is_set():
                fn()
            del fn  # nothing of an item held while idle (schedule.py: threads hold no engine)
