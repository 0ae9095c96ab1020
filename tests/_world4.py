"""One 4-rank gloo world shared by the test modules that each used to start their own.

Starting 4 ranks (processes, their imports, gloo rendezvous) and tearing them down costs far more on
the 2-core machine than most of the checks they run, so the modules listed in :data:`PARTS` run
their rank function (``fn(rank, world)``, unchanged) one after the other inside one world, and each
module's fixture takes its own part's per-rank results from :func:`results`.

Only the parts of modules with a selected test that takes the part run (``pytest
tests/test_dispatch.py`` runs the dispatch part alone). Every part starts from the environment,
``topo_align`` logger and torch seed the world started with, behind a barrier, so no part sees
another's settings or clock skew. A rank
that fails still fails every rank (run_world), and every module sharing the world then reports that
failure, naming the part that raised.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from topo_integrations.reducer.watch.completion import DEFERRED_ENV

# (module, rank function, environment for the part, seconds it may take on the loaded 2-core machine).
# Order matters: reliability runs first, in ranks with no other part's threads yet, and
# discovery_world runs last: its rank 3 skips one bounded arrival check, which leaves its discovery
# counter in the job's store one behind everyone else's.
PARTS = [
    ("test_reliability", "_world", {}, 240),
    ("test_dispatch", "_rank_main", {}, 120),
    ("test_ddp_hook", "_rank_main", {}, 150),
    ("test_reducer_collectives", "_rank_main", {}, 150),
    ("test_completion", "_faithful", {DEFERRED_ENV: "1"}, 200),
    ("test_convergence", "_rank_main", {}, 280),
    ("test_reducer_modes", "_rank_main", {}, 240),
    ("test_resume_v1", "_rank_main", {}, 240),
    ("test_fsdp", "_rank_main", {}, 200),
    ("test_method_auto", "_rank_main", {}, 150),
    ("test_discovery_world", "_worker", {}, 240),
]
TIMEOUT = sum(p[3] for p in PARTS)
"""Bound of the whole world (every part); tests that take a part carry a pytest timeout above it."""

_TORCH_DEFAULT_SEED = 67280421310721  # the CPU generator's seed in a fresh process
_done: dict[str, object] = {}


def _main(rank: int, world: int, parts: list) -> list:
    import time

    import torch.distributed as dist

    from topo_integrations.testing import released_groups, thread_count

    env, lg = dict(os.environ), logging.getLogger("topo_align")
    level, handlers = lg.level, list(lg.handlers)
    out, seconds = [], {}
    for module, fn, part_env, _ in parts:
        os.environ.clear()
        os.environ.update({**env, **part_env})
        lg.setLevel(level)
        lg.handlers[:] = handlers
        torch.manual_seed(_TORCH_DEFAULT_SEED)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            # A part's groups go away with it: idle gloo groups cost CPU (testing.released_groups).
            with released_groups():
                out.append(getattr(importlib.import_module(module), fn)(rank, world))
        except BaseException as exc:
            raise RuntimeError(f"shared world part {module}.{fn} failed on rank {rank}: "
                               f"{type(exc).__name__}: {exc}") from exc
        seconds[module] = (round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1), thread_count())
    return out + [seconds]


def results(request, module: str) -> list:
    """Per-rank results of ``module``'s part; the first call runs every selected part not yet run."""
    if module not in _done:
        # modules with a selected test that takes its part (a fixture of these names calls results())
        selected = {getattr(getattr(item, "module", None), "__name__", None) for item in request.session.items
                    if {"world", "world4", "faithful"} & set(getattr(item, "fixturenames", ()))}
        parts = [p for p in PARTS if (p[0] in selected or p[0] == module) and p[0] not in _done]
        from topo_integrations.testing import run_world

        try:
            res = run_world(4, _main, parts, timeout=sum(p[3] for p in parts), pg_timeout=300,
                            env={"OMP_NUM_THREADS": "1"})
        except Exception as exc:  # noqa: BLE001 - every module sharing the world reports it
            for p in parts:
                _done[p[0]] = exc
        else:
            for i, p in enumerate(parts):
                _done[p[0]] = [r[i] for r in res]
            # where the world's time went (wall, rank 0's CPU seconds per part, its threads after the
            # part: idle gloo groups left alive show here): `pytest -s` shows it
            print("shared 4-rank world, per part (wall s, rank-0 CPU s, rank-0 threads after):", res[0][-1])
    got = _done[module]
    if isinstance(got, Exception):
        raise got
    return got
