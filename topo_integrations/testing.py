"""Multi-rank CPU harness: run a function on N gloo ranks in forked processes, fail together.

Used by the test suite, the benchmarks and the convergence scripts. Each rank runs
``fn(rank, world_size, *args)`` after ``init_process_group("gloo")``; its return value (picklable)
comes back to the caller. If any rank raises or dies, the others are killed at once and
:class:`WorldError` carries the failing rank's traceback, so a broken rank never leaves the rest
waiting in a collective. The whole world is bounded by ``timeout`` seconds.

Start the ranks once per test module and run many checks inside them: importing DeepSpeed or
Megatron and creating groups costs seconds per process on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["WorldError", "run_world", "free_port", "released_groups", "server_cpu_s", "thread_count"]


TEARDOWN_GRACE_S = 2.0
"""How long all ranks together get to exit on their own once every result has arrived."""


class WorldError(RuntimeError):
    """A rank failed, died or the world timed out; the message holds the first failure."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", __name__]
"""What the fork server imports once, when it starts, before it forks ranks (see :func:`_context`).
A caller whose worlds import more may add to it before its first world (tests/conftest.py adds the
frameworks); a module that is not installed is left out."""


def _context():
    """The ranks' start method: forked from a server process that imported torch once (multiprocessing's
    ``forkserver``), instead of a fresh interpreter per rank that imports torch again (``spawn``):
    a 4-rank world of a trivial function cost 11 CPU seconds and 20 s on the loaded 2-core machine
    when spawned, 0.2 s from the server once it runs. The server starts at the first world of this
    process and serves every later one. A forked rank has the server's environment, so
    :func:`_entry` sets the caller's (as a spawned rank would have inherited it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def server_cpu_s() -> float:
    """CPU seconds of the fork server and of every rank it forked and reaped (0 before it runs):
    the ranks are its children, not the caller's, so ``RUSAGE_CHILDREN`` leaves them out
    (tests/conftest.py adds this)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the command: state is field 3, utime stime cutime cstime are fields 14-17 (man 5 proc)
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict, results, pg_timeout: float,
           backend: str = "gloo", environ: dict | None = None):
    import torch
    import torch.distributed as dist

    # The server's heap (torch, the frameworks: about a million objects) is never garbage here:
    # frozen, a collection (released_groups collects after every block) walks only what this rank
    # made. Walking it all cost a quarter of a CPU second per collection, 37 of test_every_key's 67.
    gc.freeze()
    if environ is not None:  # the caller's environment, not the fork server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
    })
    # Two cores for the whole world: one intra-op thread per rank avoids oversubscription stalls.
    torch.set_num_threads(1)
    try:
        tmo = datetime.timedelta(seconds=pg_timeout)
        # A client of the store run_world holds: no rank binds a port of its own (see run_world).
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=tmo)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=tmo)
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message: the queue's own pickler would pass them as
        # file descriptors that the parent can only open while this process lives (it may be gone).
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _groups_held_by(modules) -> set:
    """Process groups a module global of ``modules`` holds (directly, or in a list, tuple or dict)."""
    import torch.distributed as dist

    held = set()
    for mod in modules:
        for value in list(vars(mod).values()):
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else [value]
            held.update(v for v in items if isinstance(v, dist.ProcessGroup))
    return held


@contextlib.contextmanager
def released_groups(*, keep_held_by=(), older_too: bool = False):
    """Destroy, on leaving the block, every process group created inside it, except those a module
    global of ``keep_held_by`` still holds (a framework's cached groups, e.g. megatron-core's
    ``parallel_state`` or DeepSpeed's ``utils.groups``, reused by the next block). ``older_too``:
    groups from before the block as well (all but the default group), for a framework that drops
    its groups when it is re-initialised (megatron-core's parallel state for another layout).

    Why: on gloo every group keeps its own TCP loop thread, and an idle one still costs about 0.1 %
    of a core (measured: 60 idle groups of 4 ranks took 8 % of a core per rank, torch 2.13). A test
    world that builds a hundred engines, each with its own groups, ended up spending more than one
    of the machine's two cores on idle groups. Collective in effect: every rank must leave the
    block (a barrier first, so that no rank destroys a group a peer still uses); on an exception
    nothing is destroyed (a peer may be waiting in a collective).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    before = {c10d._get_default_group()} if older_too else set(c10d._world.pg_map)
    yield
    dist.barrier()
    keep = before | _groups_held_by(keep_held_by)
    for pg in [g for g in list(c10d._world.pg_map) if g not in keep]:
        dist.destroy_process_group(pg)
    # An engine in a reference cycle holds its groups (and their threads) until the collector runs.
    gc.collect()


def thread_count() -> int:
    """This process's threads, native ones included (Linux: /proc; else Python's). On gloo each live
    process group has three, so a count that grows section after section shows groups kept alive."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or ``backend``, e.g. nccl
    with one GPU per rank); return results by rank.

    The rendezvous store is this process's, listening before any rank starts (on a port the kernel
    picks): a port chosen free and bound later by rank 0 could be taken in between (by a
    connection, or by another world: the suite runs two test workers), and the ranks of another
    world could join this one's rendezvous."""
    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout or timeout))
    port = store.port
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, args, dict(env or {}), results, pg_timeout or timeout, backend,
                  dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    failure: str | None = None
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = f"world of {world_size} timed out after {timeout:.0f}s; ranks done: {sorted(out)}"
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    # A rank died without reporting (segfault, OOM kill, os._exit).
                    failure = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    break
                continue
            if status == "error":
                failure = f"rank {rank} failed: {payload}"
                break
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive() and failure is not None:
                p.kill()
        # Every result is in: what is left is each rank's teardown (process group, interpreter exit),
        # which nobody waits for. It takes seconds per world on a loaded 2-core machine, so ranks
        # still tearing down after a short grace are killed.
        grace = time.monotonic() + TEARDOWN_GRACE_S
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failure is not None:
        raise WorldError(failure)
    return [out[r] for r in range(world_size)]
