"""Checkpoints written by the previous release resume bitwise with this code (engine state v1).

``tests/fixtures/engine_v1/`` holds, per rank of a 2x2 world, a checkpoint taken at step 9 of 14 by
commit 32d2a19 (before reducer/ was split into sub-packages and Engine built from named parts), and
the parameters of that release's uninterrupted 14-step run (``*.straight``). Each rank here builds
fresh objects with this code, loads the old checkpoint, trains steps 9..13 and must land on the old
release's parameters bit for bit. Three configurations cover the engine state's parts: an async
reconciliation in flight (``values``); bf16 deltas with moments and outer momentum (``delta``); int8
deltas in 3 streaming fragments (``stream``). The fixtures are regenerated only with an old release:
``tests/fixtures/engine_v1/make.py`` says how.

Runs as a part of the suite's shared 4-rank world (tests/_world4.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import _world4
import pytest
import torch

pytestmark = pytest.mark.multirank

FIXTURES = Path(__file__).parent / "fixtures" / "engine_v1"
TOTAL, SAVED_AT = 14, 9
CONFIGS = {
    "values": {},
    "delta": dict(local__reconcile_dtype="bf16", local__moments_interval=2, local__outer_momentum=0.5,
                  local__moments_dtype="bf16", local__promote_drift_fraction=0.2),
    "stream": dict(local__stream_fragments=3, local__reconcile_dtype="int8"),
}


def config(name: str):
    import test_reducer_modes as T

    return T.cfg_of(sync__last_n_layers=1, sync__top_fraction=0.15, local__reconcile_interval=3,
                    local__async_reconcile=True, importance__refresh_interval=6, importance__ema_decay=0.5,
                    **CONFIGS[name])


# Engine-state keys added after the fixtures' release, each by a later issue; an old state without
# them loads with their defaults (a key here must not change what the fixtures' configs do).
ADDED_SINCE = {"state.engine": ["method"]}  # issue 38: method auto's choice (None unless method auto)


def same_state(old, new, path="state") -> str | None:
    """First difference between two engine states (wall-clock ``seconds`` excepted), or None."""
    if isinstance(old, dict):
        added = ADDED_SINCE.get(path, [])
        if not isinstance(new, dict) or list(old) != [k for k in new if k not in added]:
            return f"{path}: keys {list(old)} != {list(new) if isinstance(new, dict) else type(new).__name__}"
        for k in old:
            # wall times differ run to run; the byte counters book an asynchronous reconciliation's
            # chunks when they land, which the save point's timing decides (the parameters do not)
            if k not in ("seconds", "stats"):
                diff = same_state(old[k], new[k], f"{path}.{k}")
                if diff:
                    return diff
        return None
    if isinstance(old, (list, tuple)):
        if type(old) is not type(new) or len(old) != len(new):
            return f"{path}: {type(old).__name__}[{len(old)}] != {type(new).__name__}"
        for i, (a, b) in enumerate(zip(old, new)):
            diff = same_state(a, b, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if torch.is_tensor(old):
        ok = torch.is_tensor(new) and old.dtype == new.dtype and torch.equal(old, new)
        return None if ok else f"{path}: tensors differ"
    return None if (type(old) is type(new) and old == new) else f"{path}: {old!r} != {new!r}"


def _defined(state: dict) -> dict:
    """``state`` without what the save point's timing decides in a pending asynchronous average:
    how many of its released chunks had finished (``chunks_done``) and the buffers of the others
    (``avg``, ``savg`` hold whatever the allocation held). A resumed run runs the unfinished chunks
    before it uses them (reconcile/reconciler.py, ``_pending_state``), so the result is the same."""
    pend = state["engine"].get("pending")
    if pend is None:
        return state
    kept = {k: v for k, v in pend.items() if k not in ("avg", "savg", "chunks_done")}
    return {**state, "engine": {**state["engine"], "pending": kept}}


def _rank_main(rank: int, world: int) -> dict:
    from topo_integrations.reducer import build_groups, discover_plan
    from topo_integrations.torch import GroupedReducer

    import test_reducer_modes as T

    os.environ[T.HOSTNAME_ENV] = f"node{rank // 2}"
    groups = build_groups(discover_plan(T.cfg_of()), timeout_s=60)
    out = {}
    for name in CONFIGS:
        cfg = config(name)

        def fresh():
            model = T.make(8, 3)
            return model, GroupedReducer(model, cfg, groups=groups), torch.optim.Adam(model.parameters(), lr=1e-2)

        old = torch.load(FIXTURES / f"{name}.rank{rank}.pt", weights_only=False)
        # 1. this code's own state at the same step: the same keys, order and values as the old code's
        m, r, o = fresh()
        T.train(m, r, o, rank, 0, SAVED_AT)
        state_diff = same_state(_defined(old["reducer"]), _defined(r.state_dict()))
        r.close()
        # 2. the old checkpoint resumed by this code lands on the old release's straight run
        m, r, o = fresh()
        m.load_state_dict(old["model"])
        o.load_state_dict(old["opt"])
        r.load_state_dict(old["reducer"])
        T.train(m, r, o, rank, SAVED_AT, TOTAL)
        straight = torch.load(FIXTURES / f"{name}.rank{rank}.pt.straight", weights_only=False)
        out[name] = {"bitwise": torch.equal(straight, T.flat_params(m)), "state_diff": state_diff,
                     "pending": old["reducer"]["engine"]["pending"] is not None,
                     "reconciles": r.engine.reconciler.reconciles}
        r.close()
    return out


@pytest.fixture(scope="module")
def world(request):
    return _world4.results(request, "test_resume_v1")  # _rank_main, in the suite's shared 4-rank world


@pytest.mark.timeout(_world4.TIMEOUT)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_previous_release_checkpoint_resumes_bitwise(world, name):
    for rank, res in enumerate(world):
        r = res[name]
        assert r["state_diff"] is None, f"rank {rank}: {r['state_diff']}"
        assert r["bitwise"], f"rank {rank}: resumed parameters differ from the old release's straight run"
        assert r["reconciles"] >= 2  # steps 9..13 at interval 3 reconcile after the resume too
    if name == "values":
        assert world[0][name]["pending"]  # saved with an asynchronous reconciliation in flight


def test_fixtures_present():
    for name in CONFIGS:
        for rank in range(4):
            assert (FIXTURES / f"{name}.rank{rank}.pt").is_file()
            assert (FIXTURES / f"{name}.rank{rank}.pt.straight").is_file()
