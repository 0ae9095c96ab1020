"""Bytes and seconds per tier and per traffic class, for the last optimizer step and in total.

Tiers: ``dp`` (flat all-reduce over the whole data-parallel group), ``intra`` (inside the fast
group), ``leaf`` (the leaf-rail hops of a 3-level reduction, ``topology.middle_level``), ``inter``
(across groups: the slow tier, the spine hop with three levels). Classes: ``sync`` (gradients reduced globally:
all of them in `flat`/`hierarchical`), ``local`` (LOCAL gradients inside the group), ``reconcile``
(averaging LOCAL parameters / optimizer state across groups), ``control`` (scores, agreement
scalars, consistency hashes).

Bytes are payload bytes: the size of the tensor this rank hands to each collective (all-reduce: the
tensor; reduce-scatter: the full input; all-gather: the full output). A ring moves 2(p-1)/p of that
per rank for an all-reduce and (p-1)/p for reduce-scatter / all-gather (docs/reducer.md).
Seconds are the wall time of the (blocking) collective calls in the thread that ran them; on CUDA
the recorder receives a pair of CUDA events around the call instead and the seconds are the device
time between them, resolved when the step closes (NCCL calls return once enqueued, so a host timer
would measure enqueueing, and adaptive decisions on it would be meaningless).
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["Stats", "TIERS", "CLASSES"]

TIERS = ("dp", "intra", "leaf", "inter")
CLASSES = ("sync", "local", "reconcile", "control")


def _zero() -> dict:
    return {k: {t: {c: 0 for c in CLASSES} for t in TIERS} for k in ("bytes", "calls")} | {
        "seconds": {t: {c: 0.0 for c in CLASSES} for t in TIERS}}


def _add(dst: dict, src: dict) -> None:
    for k in dst:
        for t in TIERS:
            for c in CLASSES:
                dst[k][t][c] += src[k][t][c]


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cur = _zero()
        self._last = _zero()
        self._total = _zero()
        self._events: list = []
        self.steps = 0

    def _resolve(self) -> None:
        """Turn the CUDA event pairs whose end has completed into seconds, never waiting (no host
        synchronize in a step): a collective still running is booked at a later step's end, so on
        CUDA the seconds of a step are read one step late."""
        left = []
        for tier, cls, (start, end) in self._events:
            if end.query():
                self._cur["seconds"][tier][cls] += start.elapsed_time(end) / 1000.0
            else:
                left.append((tier, cls, (start, end)))
        self._events = left

    def recorder(self, cls: str) -> Callable[[str, int, float], None]:
        if cls not in CLASSES:
            raise ValueError(f"stats class {cls!r}; expected one of {CLASSES}")

        def record(tier: str, nbytes: int, seconds) -> None:
            with self._lock:
                self._cur["bytes"][tier][cls] += int(nbytes)
                self._cur["calls"][tier][cls] += 1
                if isinstance(seconds, tuple):  # (start, end) CUDA events: resolved at end_step
                    self._events.append((tier, cls, seconds))
                else:
                    self._cur["seconds"][tier][cls] += float(seconds)

        return record

    def end_step(self) -> None:
        """Close the current step's window (called by after_optimizer_step)."""
        with self._lock:
            self._resolve()
            _add(self._total, self._cur)
            self._last = self._cur
            self._cur = _zero()
            self.steps += 1

    def as_dict(self) -> dict:
        import copy

        with self._lock:
            self._resolve()
            total = copy.deepcopy(self._total)
            _add(total, self._cur)  # include traffic of the step in progress
            return {"steps": self.steps, "step": copy.deepcopy(self._last), "total": total}

    def state_dict(self) -> dict:
        import copy

        with self._lock:
            return {"steps": self.steps, "total": copy.deepcopy(self._total)}

    def load_state_dict(self, sd: dict) -> None:
        with self._lock:
            self.steps = int(sd["steps"])
            self._total = sd["total"]
            self._cur = _zero()
            self._last = _zero()
