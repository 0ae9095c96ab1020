"""One rank of one benchmarked system: ``python -m topo_integrations.bench.worker SPEC.json``.

Started by the driver once per rank inside the emulated node's namespace (RANK, WORLD_SIZE,
MASTER_ADDR... from the emulator's runner). Every system trains the same GPT from the same seed on
the same pre-cut token samples with the same AdamW schedule and clipping; only the gradient /
parameter exchange differs (systems.py; the systems themselves are in trainers.py).

Phases (communication in brackets):
  1. start the process group [rendezvous], build the system (its own set-up traffic: parameter
     broadcast, group creation...);
  2. mark ``start`` [barrier; rank 0 asks the driver to read the interface counters and waits for its
     answer; barrier];
  3. ``steps`` training steps, each timed on every rank [the system's own collectives only: the loss
     is kept locally];
  4. mark ``end`` [as in 2], so the counters' difference holds the training steps and two barriers;
  5. the per-step losses of all ranks [one all-reduce], the validation loss of every rank's own
     replica on the same fixed batches [one all-reduce]; rank 0 writes ``result.json``.
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

    _mark("start", spec, rank)
    times, ends, losses = [], [], []
    t0 = time.perf_counter()
    for step in range(spec["steps"]):
        sysm.set_lr(lr_at_step(step, spec))
        b = train(step)
        ts = time.perf_counter()
        loss = sysm.step(b)
        te = time.perf_counter()
        times.append(te - ts)
        ends.append(te - t0)
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: loss is {loss}")
    sysm.drain()
    _mark("end", spec, rank)

    # Step times: the slowest rank's per step (a step is done when every rank is done with it).
    tt = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    te = torch.tensor(ends, dtype=torch.float64)
    dist.all_reduce(te, op=dist.ReduceOp.MAX)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    lt /= world
    info = {"steps": spec["steps"], **sysm.info()}  # before the final reconciliation (outside the window)
    sysm.before_eval()
    val = np.load(spec["val_npz"])
    vals = []
    for i in range(spec["eval_batches"]):
        sl = slice(i * spec["micro_batch"], (i + 1) * spec["micro_batch"])
        vals.append(sysm.eval_loss({"tokens": torch.from_numpy(val["tokens"][sl].astype(np.int64)),
                                    "labels": torch.from_numpy(val["labels"][sl].astype(np.int64)),
                                    "loss_mask": torch.from_numpy(val["loss_mask"][sl].astype(np.float32))}))
    vt = torch.tensor([sum(vals) / len(vals)], dtype=torch.float64)
    dist.all_reduce(vt)
    result = {
        "system": spec["system"], "params": sysm.params, "world_size": world, "build_s": t_build,
        "step_times_s": tt.tolist(), "step_end_s": te.tolist(), "losses": lt.tolist(),
        "val_loss": float(vt.item()) / world, "info": info,
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
