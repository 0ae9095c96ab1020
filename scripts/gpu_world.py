"""The GPU check's worlds: ranks that run a list of cases, each within its own time limit.

Driver side, :func:`run_cases`: the cases of one family, world size and backend run in one world
(``topo_integrations.testing.run_world``); every rank appends a ``start`` and an ``end`` record per case
to its own file, so when a rank dies or a case runs past its limit the records still say which case
it was, what the others finished, and which cases never started: those run again in a new world.

Rank side, :func:`rank_main`: before each case a timer is set to the case's limit; on expiry the rank
writes the case's failure and exits at once (a hung collective cannot be interrupted otherwise). A
case returns ``(status, detail)`` or ``(status, detail, data)``; an exception is a failure naming it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from gpu_plan import Case, Result, world_timeout_s

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TIMED_OUT_EXIT = 124


def _runner(family: str):
    """The rank-side function of ``family``: ``fn(name, rank, device) -> (status, detail[, data])``;
    ``module:function`` names one directly (tests/test_gpu_check.py's stand-ins)."""
    if ":" in family:
        import importlib

        module, fn = family.split(":", 1)
        return getattr(importlib.import_module(module), fn)
    if family in ("torch", "deepspeed", "megatron"):
        import gpu_cases

        return gpu_cases.RUNNERS[family]
    if family in ("single", "abort", "engine"):
        import gpu_single

        return gpu_single.RUNNERS[family]
    if family == "sync":
        import gpu_sync

        return gpu_sync.run
    if family == "wire":
        import gpu_bandwidth

        return gpu_bandwidth.run
    raise ValueError(f"gpu_check: no runner for family {family!r}")


def _device(rank: int, kind: str):
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()  # NCCL: one GPU per rank (planned); gloo: ranks share them
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _record(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    last = traceback.format_exc().strip().splitlines()[-1]
    return f"{type(exc).__name__}: {text[0] if text else last}"


def rank_main(rank: int, world: int, family: str, cases: list[tuple[str, str, float]], kind: str,
              progress: str) -> int:
    """Run ``cases`` (``(id, name, limit_s)``) of ``family`` on this rank; records go to
    ``progress/rank<r>.jsonl``. Returns how many cases ran."""
    os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank // 2}"  # islands {0, 1} and {2, 3}
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    path = Path(progress) / f"rank{rank}.jsonl"
    dev = _device(rank, kind)
    run = _runner(family)
    for case_id, name, limit in cases:
        _record(path, {"case": case_id, "event": "start"})
        t0 = time.perf_counter()

        def expire(case_id=case_id, limit=limit, t0=t0):
            _record(path, {"case": case_id, "event": "end", "status": "FAIL", "seconds": time.perf_counter() - t0,
                           "detail": f"timed out: still running after the case's limit of {limit:g} s", "data": {}})
            os._exit(TIMED_OUT_EXIT)

        timer = threading.Timer(limit, expire)
        timer.daemon = True
        timer.start()
        try:
            status, detail, data = (*run(name, rank, dev), {})[:3]
        except Exception as exc:  # noqa: BLE001 - reported as the case's failure
            status, detail, data = "FAIL", _error_line(exc), {}
        finally:
            timer.cancel()
        _record(path, {"case": case_id, "event": "end", "status": status, "detail": detail,
                       "seconds": time.perf_counter() - t0, "data": data})
    return len(cases)


def read_records(progress: Path, world: int) -> list[list[dict]]:
    """Every rank's records (a rank without a file has none)."""
    out = []
    for r in range(world):
        p = progress / f"rank{r}.jsonl"
        lines = p.read_text(encoding="utf-8").splitlines() if p.exists() else []
        out.append([json.loads(ln) for ln in lines if ln.strip()])
    return out


def merge(cases: list[Case], records: list[list[dict]], world_error: str | None) -> tuple[list[Result], list[Case]]:
    """The results of the cases that started in this world, and the cases that never started.

    A case passes when every rank ended it with PASS; it fails with the first failing rank's detail
    (``[rank r]``), or, when a rank has no end record, with the world's error."""
    done, left = [], []
    for c in cases:
        ends = [next((x for x in recs if x["case"] == c.id and x["event"] == "end"), None) for recs in records]
        started = any(x["case"] == c.id for recs in records for x in recs)
        if not started:
            left.append(c)
            continue
        seconds = max((e["seconds"] for e in ends if e is not None), default=0.0)
        failed = [(r, e) for r, e in enumerate(ends) if e is not None and e["status"] != "PASS"]
        if failed:
            r, e = failed[0]
            res = Result(c, "FAIL", seconds, f"{e['detail']} [rank {r}]", e.get("data") or {})
        elif any(e is None for e in ends):
            missing = [r for r, e in enumerate(ends) if e is None]
            res = Result(c, "FAIL", seconds, f"ranks {missing} did not finish it: {world_error or 'no error reported'}")
        else:
            res = Result(c, "PASS", seconds, ends[0]["detail"], ends[0].get("data") or {})
        done.append(res)
    return done, left


CPU_LIMIT_SCALE = 4.0
"""``--device cpu`` (the suite's run on a shared 2-core machine): the cases' limits, made for a GPU
machine, times this."""


def run_cases(cases: list[Case], *, kind: str, env: dict[str, str], report) -> list[Result]:
    """Run the cases of one world (same family, world size, backend); a world that ends early is
    started again for the cases that never started. ``report(result)`` is called per finished case."""
    scale = CPU_LIMIT_SCALE if kind == "cpu" else 1.0
    from topo_integrations.testing import WorldError, run_world

    out: list[Result] = []
    todo = list(cases)
    while todo:
        first = todo[0]
        backend = "gloo" if first.backend in ("gloo", "-") else first.backend
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as progress:
            error = None
            try:
                run_world(first.world, rank_main, first.family, [(c.id, c.name, c.timeout_s * scale) for c in todo],
                          kind, progress, timeout=world_timeout_s(todo) * scale, env=env, backend=backend)
            except WorldError as exc:
                error = str(exc).strip().splitlines()[0]
            done, left = merge(todo, read_records(Path(progress), first.world), error)
        for res in done:
            report(res)
        out += done
        if left and not done:  # the world ended before any case started: it would again
            for c in left:
                res = Result(c, "FAIL", 0.0, f"its world did not start a case: {error or 'no error reported'}")
                report(res)
                out.append(res)
            break
        todo = left
    return out
