"""Rank entry of tests/test_megatron_lm_train.py: Megatron-LM's own ``pretrain_gpt.py`` through the
project's launcher (``topo_integrations.megatron.__main__.main``), with a probe around two of
Megatron-LM's functions that records what the tests assert on. Started by torchrun, or as its own
launcher that forks the ranks after importing Megatron-LM's training code once (`forked_ranks`):

    torchrun --nproc-per-node 4 tests/_megatron_lm_probe.py OUT_DIR pretrain_gpt.py ARGS...
    python tests/_megatron_lm_probe.py --ranks 4 OUT_DIR pretrain_gpt.py ARGS...
    python tests/_megatron_lm_probe.py --serve 4    # many runs, one a line on stdin (`serve`)

The probe never changes what the run computes; it only reads parameters and gathers them:

* after every ``train_step``: each rank's parameters are all-gathered and rank 0 writes one JSON
  line to ``OUT_DIR/steps.jsonl``: iteration, whether the 2 islands (ranks 0-1, 2-3) hold bitwise
  equal parameters inside, whether every rank does, whether every SYNC parameter does, and the
  engine's reconciliation count; at ``--train-iters`` every rank saves its parameters to
  ``OUT_DIR/params_rankR.pt``;
* inside ``save_checkpoint`` (after the plugin's reconciliation, before Megatron writes): whether
  every rank holds the same parameters (``OUT_DIR/saves.jsonl``).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys

import torch
import torch.distributed as dist


def _params(model) -> dict[str, torch.Tensor]:
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return {n: p.detach().float().clone() for n, p in chunk.module.named_parameters()}


def _gathered(params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _same(flats: list[torch.Tensor], ranks, sl=slice(None)) -> bool:
    return all(torch.equal(flats[ranks[0]][sl], flats[r][sl]) for r in ranks[1:])


def _write(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def _install_probe(out_dir: str) -> None:
    from megatron.training import get_args, training

    stock_step, stock_save = training.train_step, training.save_checkpoint

    @functools.wraps(stock_step)
    def train_step(*args, **kwargs):
        result = stock_step(*args, **kwargs)
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        params = _params(model)
        flats = _gathered(params)
        chunk = model[0]
        classes = chunk.topo_param_classes() if hasattr(chunk, "topo_param_classes") else {}
        engines = getattr(chunk, "topo_engines", [])
        iteration = kwargs.get("iteration", get_args().curr_iteration) + 1
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            offs, sync_ok = 0, True
            for name, p in params.items():
                if classes.get(name) == "SYNC":
                    sync_ok = sync_ok and _same(flats, list(range(world)), slice(offs, offs + p.numel()))
                offs += p.numel()
            half = world // 2
            _write(os.path.join(out_dir, "steps.jsonl"), {
                "iteration": iteration, "islands_equal": _same(flats, list(range(half)))
                and _same(flats, list(range(half, world))), "all_equal": _same(flats, list(range(world))),
                "sync_equal": sync_ok, "n_sync": sum(c == "SYNC" for c in classes.values()),
                "n_local": sum(c == "LOCAL" for c in classes.values()),
                "reconciles": engines[0].reconciler.reconciles if engines else None,
                "type": type(chunk).__name__})
        if iteration == get_args().train_iters:
            torch.save(params, os.path.join(out_dir, f"params_rank{dist.get_rank()}.pt"))
        return result

    @functools.wraps(stock_save)
    def save_checkpoint(iteration, model, *args, **kwargs):
        flats = _gathered(_params(model))
        if dist.get_rank() == 0:
            _write(os.path.join(out_dir, "saves.jsonl"),
                   {"iteration": iteration, "all_equal": _same(flats, list(range(dist.get_world_size())))})
        return stock_save(iteration, model, *args, **kwargs)

    training.train_step = train_step
    training.save_checkpoint = save_checkpoint


def main(argv: list[str]) -> int:
    out_dir, script, *rest = argv
    os.makedirs(out_dir, exist_ok=True)
    from topo_integrations.megatron import cpu_compat
    from topo_integrations.megatron.__main__ import main as launch

    cpu_compat.apply_training()  # what the launcher does first; megatron.training imports after it
    _install_probe(out_dir)
    return launch([script, *rest])


def _rank(argv: list[str]) -> int:
    """One rank: `main`, then the exit handlers (multiprocessing's shuts the torch_dist writer's
    process manager down), then out without the interpreter's teardown of the Megatron and torch
    modules (seconds per rank on 2 cores; everything the tests read is written and closed)."""
    import atexit
    import traceback

    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, and the rank exits non-zero
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _import_once() -> None:
    """What the ranks share, imported before they fork: Megatron-LM's training code (4 interpreters
    importing it cost tens of seconds on 2 cores)."""
    from topo_integrations.megatron import cpu_compat

    cpu_compat.apply_training()
    import megatron.training  # noqa: F401 - the import the ranks share


def forked_ranks(n: int, argv: list[str], out_fd: int | None = None) -> int:
    """What ``torchrun --standalone --nproc-per-node n`` does for this probe, with the ranks forked
    from this process (after :func:`_import_once`). Each rank gets torchrun's variables (and, with
    ``out_fd``, that descriptor as its stdout and stderr); the first rank that exits non-zero ends the
    others (a failing rank fails the run), and its status is returned."""
    import signal
    import threading

    from topo_integrations.testing import free_port

    assert threading.active_count() == 1, threading.enumerate()  # a fork copies this thread only
    # Megatron-LM's imports are never garbage in a rank: frozen before the forks, a collection in a
    # rank walks only what the rank made (testing.run_world's ranks do the same).
    gc.freeze()
    port, pids = free_port(), []
    for rank in range(n):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            if out_fd is not None:
                os.dup2(out_fd, 1)
                os.dup2(out_fd, 2)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(n),
                              LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            _rank(argv)
        pids.append(pid)
    rc, left = 0, set(pids)
    while left:
        pid, status = os.wait()
        left.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code
            for other in left:
                os.kill(other, signal.SIGKILL)
    return rc


def serve(n: int) -> int:
    """Many runs from one import: reads a JSON object a line on stdin (``{"argv": [OUT_DIR, SCRIPT,
    ARGS...], "log": PATH}``), runs it on ``n`` forked ranks with their output in ``PATH``, answers
    ``{"rc": N}`` a line on stdout; ends at the end of stdin. The import is 4 CPU seconds of a run
    that takes 6 to 10 (tests/test_megatron_lm_train.py starts one server for its six runs)."""
    _import_once()
    for line in sys.stdin:
        req = json.loads(line)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            rc = forked_ranks(n, req["argv"], out_fd=fd)
        finally:
            os.close(fd)
        print(json.dumps({"rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--ranks":
        _import_once()
        sys.exit(forked_ranks(int(sys.argv[2]), sys.argv[3:]))
    if sys.argv[1] == "--serve":
        sys.exit(serve(int(sys.argv[2])))
    _rank(sys.argv[1:])
