"""The schedule's helper threads do not keep a dropped engine alive (issue 41).

An engine dropped without ``close()`` (a job that rebuilds its model, a test world that builds dozens
of engines) must take its schedule, its process groups and the schedule's threads with it: on gloo
every live group keeps three threads of its own. The threads hold the schedule weakly and nothing of
an item once it has run (reducer/schedule/schedule.py), so the collector frees them.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from topo_integrations.reducer.kinds import Traffic
from topo_integrations.reducer.schedule.schedule import Schedule
from topo_integrations.reducer.watch import completion

pytestmark = pytest.mark.timeout(60)


class Payload:
    """Stands in for what an item's function closes over (a bucket, the engine)."""


def _run_one(s: Schedule) -> weakref.ref:
    """Release one item whose function holds a fresh object; return a weak reference to that object."""
    payload = Payload()
    it = s.item("probe", Traffic.CONTROL, lambda p=payload: p)
    s.release([it])
    assert it.done.wait(10)
    return weakref.ref(payload)


def _threads(*names: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in names]


def _gone(threads: list[threading.Thread]) -> bool:
    for t in threads:
        t.join(5)
    return not any(t.is_alive() for t in threads)


def test_a_dropped_host_schedule_ends_its_issuing_thread():
    before = set(_threads("topo_align_dispatch"))
    s = Schedule(torch.device("cpu"), timeout_s=None)
    s.retain(threaded=True)
    payload = _run_one(s)
    started = [t for t in _threads("topo_align_dispatch") if t not in before]
    assert len(started) == 1
    # the idle thread holds nothing of the item it ran
    gc.collect()
    assert payload() is None
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    assert _gone(started)


def test_a_dropped_deferred_schedule_ends_its_watcher_and_stream_double(monkeypatch):
    monkeypatch.setenv(completion.DEFERRED_ENV, "1")
    names = ("topo_align_watch", "topo_align_stream_double")
    before = set(_threads(*names))
    s = Schedule(torch.device("cpu"), timeout_s=30.0)
    assert s.kind == "deferred"
    s.retain(threaded=False)
    payload = _run_one(s)
    started = [t for t in _threads(*names) if t not in before]
    assert sorted(t.name for t in started) == sorted(names)
    gc.collect()
    assert payload() is None
    del s
    gc.collect()
    assert _gone(started)


def test_a_closed_schedule_still_ends_its_threads():
    s = Schedule(torch.device("cpu"), timeout_s=None)
    s.retain(threaded=True)
    _run_one(s)
    th = s._thread
    s.release_user()
    assert _gone([th])
