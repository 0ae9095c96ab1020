"""The dispatcher (reducer/schedule/dispatch.py) and the collective check (reducer/schedule/order.py).

Unit part: the release rules, fail-fast and bounded waits on a dispatcher whose buckets are plain
functions (no collective: the logic is isolated), and :func:`compare` on hand-made traces.
Multi-rank part (4 gloo ranks as 2 nodes x 2, in the suite's shared world, tests/_world4.py): the real engine's
schedule seen through the fingerprints (SYNC first, LOCAL after, reconciliation after every bucket
of the next step), the per-step cross-rank check raising on every rank when one rank's trace differs,
the start-of-run check, and the schedule figures.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import _world4
import pytest
import torch

from topo_integrations.reducer.kinds import Traffic
from topo_integrations.reducer.schedule.dispatch import Dispatcher
from topo_integrations.reducer.schedule.order import CollectiveOrderError, Fingerprint, compare
from topo_integrations.reducer.watch.errors import CollectiveError

pytestmark = pytest.mark.timeout(120)


def _stub(threaded: bool, timeout_s: float | None = None) -> Dispatcher:
    wire = SimpleNamespace(device=torch.device("cpu"), groups=SimpleNamespace(trace=None))
    return Dispatcher(wire, threaded=threaded, timeout_s=timeout_s)


def _submit(d: Dispatcher, log: list, name: str, traffic: Traffic):
    """An item of ``traffic`` that appends ``name`` to ``log`` when it runs (the dispatcher's order)."""
    item = d._item(name, traffic, lambda: log.append(name))
    if traffic is Traffic.SYNC:
        d._release([item])
    elif traffic is Traffic.LOCAL:
        if d._local_open:
            d._release([item])
        else:
            d._held_local.append(item)
    return item.future


@pytest.mark.parametrize("threaded", [False, True])
def test_release_points_are_positions_not_times(threaded):
    d = _stub(threaded)
    log: list = []
    rc = d.submit_reconcile([lambda i=i: log.append(f"rc{i}") for i in range(3)], "reconcile")
    _submit(d, log, "L0", Traffic.LOCAL)     # ready before any SYNC: held
    _submit(d, log, "S0", Traffic.SYNC)
    _submit(d, log, "L1", Traffic.LOCAL)
    _submit(d, log, "S1", Traffic.SYNC)
    d.sync_done()                              # LOCAL may go now, reconciliation not yet
    _submit(d, log, "L2", Traffic.LOCAL)
    d.drain()
    assert log == ["S0", "S1", "L0", "L1", "L2"]
    d.all_submitted()
    d.wait(rc)
    assert log[5:] == ["rc0", "rc1", "rc2"]
    d.close()


def test_waiting_for_a_held_local_bucket_releases_it_and_failure_is_fast():
    d = _stub(True)
    log: list = []
    fut = _submit(d, log, "L0", Traffic.LOCAL)
    assert d.wait(fut) is None and log == ["L0"]

    def boom():
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        d.call(boom, "first")
    t0 = time.perf_counter()
    with pytest.raises(CollectiveError, match="not issued: an earlier collective failed .*peer gone"):
        d.call(lambda: time.sleep(30), "second")
    assert time.perf_counter() - t0 < 5
    d.close()


def test_wait_is_bounded_and_names_the_item_in_flight():
    d = _stub(True, timeout_s=0.2)
    gate = threading.Event()
    with pytest.raises(CollectiveError, match=r"stuck bucket did not complete within fallback.timeout_s = 0.2s "):
        d.call(lambda: gate.wait(20), "stuck bucket")
    gate.set()
    d.close()


def _fp(comm, ranks, op, seq, numel=4):
    return Fingerprint(comm, tuple(ranks), op, "float32", numel, seq)


def test_compare_accepts_equal_traces_and_names_the_first_divergence():
    intra0, intra1, rail = "intra group (global ranks 0, 1)", "intra group (global ranks 2, 3)", "rail (0, 2)"
    t = {0: [_fp(intra0, (0, 1), "reduce_scatter", 0), _fp(rail, (0, 2), "all_reduce", 1)],
         1: [_fp(intra0, (0, 1), "reduce_scatter", 0)],
         2: [_fp(intra1, (2, 3), "reduce_scatter", 0), _fp(rail, (0, 2), "all_reduce", 1)],
         3: [_fp(intra1, (2, 3), "reduce_scatter", 0)]}
    compare(t, step=1)
    bad = dict(t)
    bad[2] = [_fp(intra1, (2, 3), "reduce_scatter", 0), _fp(rail, (0, 2), "all_reduce", 1, numel=8)]
    with pytest.raises(CollectiveOrderError, match=r"diverge at step 1 on the rail \(0, 2\), call 0 there: "
                                                   r"rank 0 issued #1 all_reduce of 4 x float32 .* rank 2 issued "
                                                   r"#1 all_reduce of 8 x float32"):
        compare(bad, step=1)
    # Same per-communicator sequences, different interleaving between two communicators of 0 and 1.
    dp = "data-parallel group (0, 1)"
    x = {0: [_fp(intra0, (0, 1), "all_reduce", 0), _fp(dp, (0, 1), "all_reduce", 1)],
         1: [_fp(dp, (0, 1), "all_reduce", 0), _fp(intra0, (0, 1), "all_reduce", 1)]}
    with pytest.raises(CollectiveOrderError, match="ranks 0 and 1 order their shared collectives differently at "
                                                   "step 7: call 0 is all_reduce on the intra group"):
        compare(x, step=7)


# ---------------------------------------------------------------------------- multi-rank

def _rank_main(rank, world):
    import torch.nn as nn

    from topo_integrations import GroupedReducer, TopoAlignConfig
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"node{rank // 2}"
    os.environ["TOPO_ALIGN_CHECK_COLLECTIVES"] = "1"
    cfg = TopoAlignConfig.model_validate({
        "mode": "selective", "sync": {"last_n_layers": 1, "always_sync": [], "top_fraction": 0.0},
        "local": {"reconcile_interval": 2, "async_reconcile": True, "promote_drift_fraction": 0.0},
        "communication": {"bucket_size_mb": 0.001}, "fallback": {"timeout_s": 60.0}})
    groups = build_groups(discover_plan(cfg), timeout_s=60)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    red = GroupedReducer(model, cfg, groups=groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = red.engine.dispatcher.trace
    out = {"start_check": [f.op for f in trace.take()]}
    kinds, windows = [], []
    for step in range(6):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        red.finish_grad_sync()
        opt.step()
        # What this step issued, in order (before after_step's own collectives; the reconciliation
        # released after the step's last bucket may still be running: wait for it).
        red.engine.dispatcher.drain()
        kinds.append([(f.comm.split(" ")[0], f.op) for f in list(trace._items)])
        red.after_optimizer_step(opt)
        windows.append(red.engine.dispatcher.last_window_chunks)
        opt.zero_grad()
    out["kinds"], out["windows"] = kinds, windows
    out["schedule"] = red.stats()["schedule"]
    # A rank whose trace differs makes every rank raise at the end of the step.
    model(torch.ones(2, 16)).sum().backward()
    red.finish_grad_sync()
    if rank == 3:
        trace.add("intra group (global ranks 2, 3)", (2, 3), "all_reduce(extra)", torch.float32, 1)
    try:
        red.after_optimizer_step(opt)
        out["diverged"] = None
    except CollectiveOrderError as exc:
        out["diverged"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world(request):
    return _world4.results(request, "test_dispatch")  # _rank_main, in the suite's shared 4-rank world


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_start_of_run_check_touches_every_communicator(world):
    for r in world:
        assert r["start_check"] and all(op.startswith("all_reduce(start-of-run check") for op in r["start_check"])
        assert len(r["start_check"]) >= 5  # dp, intra, inter, intra_low, inter_low


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_sync_first_then_local_then_reconciliation(world):
    for r in world:
        for step, seq in enumerate(r["kinds"]):
            tiers = [c for c, _ in seq]
            first_low = next((i for i, c in enumerate(tiers) if c.endswith("_low")), len(tiers))
            # every SYNC collective (intra / inter communicators) comes before any LOCAL one
            assert all(not c.endswith("_low") for c in tiers[:first_low]) and \
                all(c.endswith("_low") or c == "data-parallel" for c in tiers[first_low:]), (step, seq)
            if step % 2 == 0 and step > 0:  # the reconciliation launched at step-1's end runs here, last
                # (unless all its chunks fitted the measured pre-SYNC window: they ran at the launch)
                k, n = r["windows"][step - 1]
                assert (k == n) or any(c == "inter_low" for c in tiers), (step, seq, k, n)


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_divergent_trace_raises_on_every_rank(world):
    for r in world:
        assert r["diverged"] is not None and "intra group (global ranks 2, 3)" in r["diverged"], r["diverged"]


@pytest.mark.multirank
@pytest.mark.timeout(_world4.TIMEOUT)
def test_schedule_figures_split_steps_by_reconciliation_in_flight(world):
    for r in world:
        s = r["schedule"]
        assert s["with_reconcile"]["steps"] >= 2 and s["without_reconcile"]["steps"] >= 2, s
        assert s["with_reconcile"]["mean_sync_tail_s"] >= 0
