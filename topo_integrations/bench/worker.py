"""One rank of one benchmarked system: ``python -m topo_integrations.bench.worker SPEC.json``.

Started by the driver once per rank inside the emulated node's namespace (RANK, WORLD_SIZE,
MASTER_ADDR... from the emulator's runner). Every system trains the same GPT from the same seed on
the same pre-cut token samples with the same AdamW schedule and clipping; only the gradient /
parameter exchange differs (systems.py; the systems themselves are in trainers.py).

Phases (communication in brackets):
  1. start the process group [rendezvous], build the system (its own set-up traffic: parameter
     broadcast, group creation...);
  2. with ``eval_interval``: the validation loss of the untrained model (off the clock); mark ``start``
     [barrier; rank 0 asks the driver to read the interface counters and waits for its answer;
     barrier];
  3. training steps, each timed on every rank [the system's own collectives only: the loss is kept
     locally]: ``steps`` of them, or, with a ``budget_s``, as many as fit in the budget (with
     ``equal_budget`` every rank agrees after each step on the slowest rank's clock [one scalar
     all-reduce, off the clock]); every ``eval_interval`` steps a validation between marks
     ``pause<k>`` and ``resume<k>`` [the driver leaves their bytes out; off the clock];
  4. mark ``end`` [as in 2], so the counters' difference holds the training steps and the barriers;
     the last point of the validation curve;
  5. the per-step losses of all ranks [one all-reduce], the validation loss of every rank's own
     replica on the same fixed batches after the system's final reconciliation [one all-reduce];
     rank 0 writes ``result.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist

from .trainers import build, lr_at_step

__all__ = ["main"]


def _mark(name: str, spec: dict, rank: int) -> None:
    """Barrier; rank 0 asks the driver to read the counters (file ``mark-NAME``) and waits for
    ``ack-NAME``; barrier."""
    dist.barrier()
    if rank == 0:
        ctl = spec["ctl_dir"]
        with open(os.path.join(ctl, f"mark-{name}.tmp"), "w") as fh:
            fh.write(str(time.time()))
        os.replace(os.path.join(ctl, f"mark-{name}.tmp"), os.path.join(ctl, f"mark-{name}"))
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(ctl, f"ack-{name}")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bench driver did not answer mark {name!r} within 120 s")
            time.sleep(0.01)
    dist.barrier()


# ---------------------------------------------------------------------------------------- main

def _batches(path: str, rank: int, world: int, mb: int) -> tuple[int, callable]:
    data = np.load(path)
    tokens, labels, mask = data["tokens"], data["labels"], data["loss_mask"]

    def get(step: int) -> dict:
        lo = (step * world + rank) * mb
        sl = slice(lo, lo + mb)
        return {"tokens": torch.from_numpy(tokens[sl].astype(np.int64)),
                "labels": torch.from_numpy(labels[sl].astype(np.int64)),
                "loss_mask": torch.from_numpy(mask[sl].astype(np.float32))}

    return tokens.shape[0] // (world * mb), get


def _eval_batches(sysm, spec: dict, val, world: int) -> float:
    """Mean over ranks of each rank's loss on the held-out batches [one scalar all-reduce]."""
    vals = []
    for i in range(spec["eval_batches"]):
        sl = slice(i * spec["micro_batch"], (i + 1) * spec["micro_batch"])
        vals.append(sysm.eval_loss({"tokens": torch.from_numpy(val["tokens"][sl].astype(np.int64)),
                                    "labels": torch.from_numpy(val["labels"][sl].astype(np.int64)),
                                    "loss_mask": torch.from_numpy(val["loss_mask"][sl].astype(np.float32))}))
    vt = torch.tensor([sum(vals) / len(vals)], dtype=torch.float64)
    dist.all_reduce(vt)
    return float(vt.item()) / world


@torch.no_grad()
def _validation(sysm, spec: dict, val, world: int) -> float:
    """Validation loss along the run. A local method (replicas differ between groups) is evaluated
    on the exact mean of the replicas [one fp32 all-reduce of the parameters], i.e. the model a
    blocking reconciliation would give, and its replicas are then restored bit for bit, so the
    evaluation leaves the training trajectory untouched (docs/benchmarks.md, "The long-horizon preset")."""
    if not spec.get("local_method"):
        return _eval_batches(sysm, spec, val, world)
    params = [p for p in sysm.model.parameters()]
    saved = [p.detach().clone() for p in params]
    flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p in params:
        p.data.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()
    try:
        return _eval_batches(sysm, spec, val, world)
    finally:
        for p, s in zip(params, saved):
            p.data.copy_(s)


def run(spec: dict) -> dict | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    if spec["system"].startswith("ds-"):
        import logging

        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        try:
            from ..deepspeed.compat import skip_shm_comm_build

            skip_shm_comm_build()
        except ImportError:
            pass
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    n_batches, train = _batches(spec["train_npz"], rank, world, spec["micro_batch"])
    if n_batches < spec["steps"]:
        raise ValueError(f"{spec['train_npz']} holds {n_batches} global batches; {spec['steps']} steps need more")
    t_build = time.perf_counter()
    sysm = build(spec)
    t_build = time.perf_counter() - t_build

    val = np.load(spec["val_npz"])
    every = spec.get("eval_interval")
    curve = [[0, _validation(sysm, spec, val, world)]] if every else []  # before the window: off the clock
    _mark("start", spec, rank)
    times, ends, losses = [], [], []
    budget, cap, agree = spec.get("budget_s"), spec.get("max_steps") or spec["steps"], spec.get("equal_budget")
    paused, stopped = 0.0, "steps"
    t0 = time.perf_counter()
    for step in range(cap if budget is not None else spec["steps"]):
        sysm.set_lr(lr_at_step(step, spec))
        b = train(step)
        ts = time.perf_counter()
        loss = sysm.step(b)
        te = time.perf_counter()
        times.append(te - ts)
        ends.append(te - t0 - paused)
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: loss is {loss}")
        tp = time.perf_counter()
        if agree:  # every rank stops after the same step: the slowest rank's clock decides
            clock = torch.tensor([ends[-1]], dtype=torch.float64)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            if budget is not None and float(clock) >= budget:
                stopped = "budget"
        if stopped != "budget" and every and (step + 1) % every == 0 and step + 1 < cap:
            k = (step + 1) // every
            _mark(f"pause{k}", spec, rank)  # the driver leaves this evaluation's bytes out
            curve.append([step + 1, _validation(sysm, spec, val, world)])
            _mark(f"resume{k}", spec, rank)
        paused += time.perf_counter() - tp
        if stopped == "budget":
            break
    else:
        stopped = "steps" if budget is None else "max_steps"
    sysm.drain()
    _mark("end", spec, rank)
    n = len(times)
    if every and (not curve or curve[-1][0] != n):
        curve.append([n, _validation(sysm, spec, val, world)])

    # Step times: the slowest rank's per step (a step is done when every rank is done with it).
    tt = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    te = torch.tensor(ends, dtype=torch.float64)
    dist.all_reduce(te, op=dist.ReduceOp.MAX)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    lt /= world
    info = {"steps": n, **sysm.info()}  # before the final reconciliation (outside the window)
    sysm.before_eval()
    vt = _eval_batches(sysm, spec, val, world)
    result = {
        "system": spec["system"], "params": sysm.params, "world_size": world, "build_s": t_build,
        "step_times_s": tt.tolist(), "step_end_s": te.tolist(), "losses": lt.tolist(),
        "val_loss": vt, "info": info, "steps_taken": n, "stopped": stopped, "budget_s": budget,
        "val_curve": [[k, float(te[k - 1]) if k else 0.0, v] for k, v in curve],
    }
    if rank == 0:
        with open(os.path.join(spec["out_dir"], "result.json.tmp"), "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        os.replace(os.path.join(spec["out_dir"], "result.json.tmp"), os.path.join(spec["out_dir"], "result.json"))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m topo_integrations.bench.worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    # The frameworks' import-time notices and deprecations say nothing about the benchmark; this
    # process is only a worker, so they are silenced here, in its entry point, not at import.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        run(spec)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not wait in gloo's destructors for peers that may be gone
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown: a framework thread still joinable at static destruction
    # aborted a finished stock DeepSpeed rank once ("terminate called without an active
    # exception", exit 134, after its result was written), which the driver rightly counts as a
    # failed run. The result and the logs are written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
