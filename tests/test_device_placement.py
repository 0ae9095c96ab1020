"""Which device the reducer's work lands on, checked on the CPU (issue 40).

1. Every helper thread the reducer starts (the bounded call, the dispatcher, the watcher, the stream
   double) enters the CUDA device and stream of the thread that started it before its target runs
   (reducer/watch/thread_device.py); object collectives name the device where torch.distributed lets
   them. CUDA is faked here: ``torch.cuda``'s device and stream functions are replaced by recorders, so
   the test sees, per thread, what was entered and when the work ran.
2. The agreed gradient norm travels on the engine's communication device whatever device the adapter
   made it on (Megatron's comes from a host float): a ``meta`` device stands in for CUDA, so a host
   tensor handed to the collective is refused as it would be on NCCL.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from topo_integrations.reducer.kinds import Mode, Traffic
from topo_integrations.reducer.watch import completion
from topo_integrations.reducer.watch.bounded import bounded
from topo_integrations.reducer.watch.thread_device import object_device

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(60)


class Seen(list):
    """(thread name, event, value) in the order they happened, from every thread."""

    def rec(self, event: str, value=None) -> None:
        self.append((threading.current_thread().name, event, value))


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA initialised, this thread on device 3 (and its stream); what any thread enters is recorded."""
    seen = Seen()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of cuda:{device}")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.rec("set_device", d))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: seen.rec("set_stream", s))
    return seen


def _in(seen, thread: str) -> list[tuple[str, object]]:
    return [(e, v) for t, e, v in seen if t == thread]


ENTERED = [("set_device", 3), ("set_stream", "stream of cuda:3")]


def test_bounded_runs_its_call_on_the_callers_device(fake_cuda):
    assert bounded("probe", 10.0, lambda: fake_cuda.rec("fn") or 7) == 7
    assert _in(fake_cuda, "topo_align_bounded") == ENTERED + [("fn", None)]
    assert not _in(fake_cuda, threading.current_thread().name)  # the caller's own device is untouched


def test_the_dispatcher_thread_runs_on_the_callers_device(fake_cuda):
    from topo_integrations.reducer.schedule.schedule import Schedule

    s = Schedule(torch.device("cpu"), timeout_s=None)
    s.retain(threaded=True)
    it = s.item("probe", Traffic.CONTROL, lambda: fake_cuda.rec("fn"))
    s.release([it])
    assert it.done.wait(10)
    s.release_user()
    assert _in(fake_cuda, "topo_align_dispatch") == ENTERED + [("fn", None)]


def test_the_watcher_and_the_stream_double_run_on_the_callers_device(fake_cuda, monkeypatch):
    from topo_integrations.reducer.schedule import schedule
    from topo_integrations.reducer.schedule.schedule import Schedule

    monkeypatch.setenv(completion.DEFERRED_ENV, "1")
    s = Schedule(torch.device("cpu"), timeout_s=30.0)
    assert s.kind == "deferred"
    monkeypatch.setattr(schedule, "_watch_loop", lambda ref, closing: fake_cuda.rec("fn"))  # seen from its thread
    s.retain(threaded=False)
    it = s.item("probe", Traffic.CONTROL, lambda: fake_cuda.rec("fn"))
    s.release([it])
    assert it.done.wait(10)
    s._watcher.join(10)
    s.release_user()
    assert _in(fake_cuda, "topo_align_watch") == ENTERED + [("fn", None)]
    assert _in(fake_cuda, "topo_align_stream_double") == ENTERED + [("fn", None)]


def test_a_cpu_only_process_is_not_made_to_touch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device in a CPU-only process"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("current_device would initialise CUDA"))
    assert bounded("probe", 10.0, lambda: 5) == 5
    assert object_device(None) is None


def test_the_plan_broadcast_names_the_device_and_runs_there(fake_cuda, monkeypatch):
    from topo_integrations.reducer.plan.planning import broadcast_plan
    from topo_integrations.topology import PlanError

    calls = []

    def fake_broadcast(objs, src=None, group=None, device=None):
        fake_cuda.rec("broadcast_object_list", device)
        calls.append(device)

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "broadcast_object_list", fake_broadcast)
    with pytest.raises(PlanError, match="no plan here"):
        broadcast_plan("no plan here", None, src=0, timeout_s=10.0)
    assert calls == [torch.device("cuda", 3)]
    assert _in(fake_cuda, "topo_align_bounded") == ENTERED + [("broadcast_object_list", torch.device("cuda", 3))]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert object_device(None) is None  # gloo keeps object bytes on the host


def test_the_layout_gather_runs_on_the_callers_device(fake_cuda, monkeypatch):
    from topo_integrations.reducer.wire.replicas import all_dp_layouts

    def fake_gather(out, obj, group=None):
        fake_cuda.rec("all_gather_object")
        out[:] = [obj, obj]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", fake_gather)
    assert all_dp_layouts(None, timeout_s=10.0) == [(0, 1)]
    assert _in(fake_cuda, "topo_align_bounded") == ENTERED + [("all_gather_object", None)]


def _thread_starts(source: str) -> list[int]:
    """Lines of ``threading.Thread(...)`` / ``Thread(...)`` calls in ``source``."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == "Thread") or
        (isinstance(n.func, ast.Name) and n.func.id == "Thread"))]


def test_every_reducer_thread_starts_through_the_helper():
    helper = ROOT / "topo_integrations/reducer/watch/thread_device.py"
    bad = []
    for path in sorted((ROOT / "topo_integrations/reducer").rglob("*.py")):
        for line in _thread_starts(path.read_text(encoding="utf-8")):
            if path != helper:
                bad.append(f"{path.relative_to(ROOT)}:{line}: start it with watch.thread_device.start_thread "
                           "(the thread must enter the starter's CUDA device and stream)")
    assert not bad, "\n".join(bad)
    assert _thread_starts(helper.read_text(encoding="utf-8"))  # the helper itself is seen by the scan


def test_the_thread_scan_sees_both_spellings():
    src = "import threading\nfrom threading import Thread\nthreading.Thread(target=f)\nThread(target=g)\nx.Timer()\n"
    assert _thread_starts(src) == [3, 4]


# ------------------------------------------------------------------------------- 2. the norm's device

def _engine_on(device: torch.device):
    """An Engine's agreement path on ``device``: the real Engine method and Wire (the collective's
    device check included), a one-rank group, `selective` with a LOCAL tensor."""
    from topo_integrations.reducer.engine import Engine
    from topo_integrations.reducer.engine.stats import Stats
    from topo_integrations.reducer.wire.wire import Wire

    groups = SimpleNamespace(dp_size=1, inter_size=1, dp_group=None, inter=None, device=None)
    e = Engine.__new__(Engine)
    e.device = device
    e.dispatcher = SimpleNamespace(mode=Mode.SELECTIVE,
                                   wire=Wire(groups, device=device, error_feedback=False, stats=Stats()))
    e.policy = SimpleNamespace(has_local=lambda: True)
    return e


def test_the_agreed_norm_travels_on_the_engines_device_whatever_the_adapter_made():
    e = _engine_on(torch.device("meta"))
    assert e.wire.groups.device == torch.device("meta")
    # Megatron's norm is a host float: the adapter hands a CPU float64 tensor (megatron/optimizer.py)
    out = e.global_grad_norm_sq(torch.tensor([2.0 ** 2], dtype=torch.float64), over="inter")
    assert out.device == torch.device("meta") and out.dtype == torch.float64 and out.shape == (1,)
    out = e.global_grad_norm_sq(torch.tensor(9.0, dtype=torch.float32))  # another dtype, 0-dim
    assert out.device == torch.device("meta") and out.dtype == torch.float32 and out.shape == ()


def test_on_the_cpu_the_agreed_norm_is_the_same_value():
    e = _engine_on(torch.device("cpu"))
    x = torch.tensor([1.2345678901234567], dtype=torch.float64)
    assert torch.equal(e.global_grad_norm_sq(x), x)
