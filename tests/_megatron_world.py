"""One 4-rank megatron-core world shared by three test modules (2 virtual nodes x 2, gloo on CPU).

Starting 4 ranks that import megatron-core costs tens of seconds on 2 cores, so the ranks start
once per session and run, in order:

1. the schedule checks of tests/test_megatron_schedule.py (first: they count the dispatcher threads
   of a fresh process);
2. the TopoAlignDDP checks of tests/test_megatron_ddp.py;
3. the runs of ``topo_integrations.train.pretrain_megatron`` of tests/test_pretrain_megatron.py
   (last: each run builds and destroys megatron-core's parallel state itself).

Each module's ``world`` fixture calls `megatron_world`; the first call starts the ranks, the others
get the same per-rank results (or the same failure). A failing rank fails the whole world, and so
every test that reads it.
"""

from __future__ import annotations

from topo_integrations.testing import WorldError, run_world

WORLD = 4
PRETRAIN_MODULE = "topo_integrations.train.pretrain_megatron"
# The three modules' worlds took 190 s + 94 s + 35 s under a load of ~2.4x; room for a loaded machine.
TIMEOUT_S = 1200
TEST_TIMEOUT_S = TIMEOUT_S + 60

_cache: dict = {}


def rank_main(rank: int, world: int, tmpdir: str, runs_dir: str) -> dict:
    import test_megatron_ddp
    import test_megatron_schedule

    from _pretrain_world import rank_main as pretrain_runs

    res = {"schedule": test_megatron_schedule.rank_checks(rank, world)}
    res.update(test_megatron_ddp.rank_checks(rank, world, tmpdir))
    res["threads_before_pretrain"] = _close_engines()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():  # pretrain_megatron initialises its own
        ps.destroy_model_parallel()
    res["pretrain"] = pretrain_runs(rank, world, PRETRAIN_MODULE, runs_dir)
    return res


def _close_engines() -> tuple[int, int]:
    """Close the TopoAlignDDP engines the checks left open (most do not close theirs): each keeps a
    dispatcher and a watch thread polling every 20 ms, which the pretrain runs would share the 2 cores
    with. Issues no collective (``topo_close``). Returns the thread count before and after."""
    import gc
    import threading
    import time

    from topo_integrations.megatron.ddp import TopoAlignDDP

    before = threading.active_count()
    for obj in gc.get_objects():
        if isinstance(obj, TopoAlignDDP):
            obj.topo_close()
    deadline = time.monotonic() + 5  # the threads stop after the items already released
    for t in threading.enumerate():
        if t.name.startswith("topo_align"):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    return before, threading.active_count()


def megatron_world(tmp_path_factory) -> tuple[list[dict], str]:
    """(per-rank results, the pretrain runs' directory); the ranks run at the first call only."""
    if not _cache:
        tmpdir = str(tmp_path_factory.mktemp("megatron"))
        runs = str(tmp_path_factory.mktemp("mg-runs"))
        try:
            results = run_world(WORLD, rank_main, tmpdir, runs, timeout=TIMEOUT_S,
                                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        except WorldError as exc:
            _cache["error"] = exc
        else:
            print("megatron world timings (rank 0, s):", results[0]["timings"], results[0]["pretrain"]["_times"],
                  "threads before the pretrain runs (before, after closing):", results[0]["threads_before_pretrain"])
            _cache["results"] = (results, runs)
    if "error" in _cache:
        raise _cache["error"]
    return _cache["results"]
