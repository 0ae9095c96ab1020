"""The GPU check (docs/reliability.md, "GPU check"): what this machine's GPUs can check, one row per case.

The cases and the plan are in scripts/gpu_plan.py (``--list`` prints them): with one GPU, every adapter
at world 1 on NCCL, the schedule's communication stream and its abort path on NCCL, each adapter's
steps under ``torch.cuda.set_sync_debug_mode``, the 2 x 2 adapter cases on four gloo ranks sharing
the GPU (CUDA tensors), and the int8 wire's bandwidth against the GPU's; two GPUs add the 2-rank
NCCL cases, four add every adapter on 4 NCCL ranks. Each case has its own time limit
(scripts/gpu_world.py). A case that cannot run here fails and says why; nothing is skipped.

Prints a line per finished case, then a table (case, world, backend, result, seconds, detail) and a
summary line; ``--out FILE`` writes the results as JSON. Exit status: 0 every case passed, 1 a case
failed or could not run, 2 bad arguments (an unknown case is refused before torch is imported),
3 no GPU (a CPU build of torch, or no GPU visible): nothing was run. ``--device cpu`` runs the
gloo adapter cases on CPU instead: the suite's check of the case code (tests/test_gpu_check.py),
not a GPU check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpu_plan  # noqa: E402  (scripts/ is on sys.path: this file's directory)

FORMAT = "topo-align/gpu-check/v1"
ADAPTER_FAMILIES = ("torch", "deepspeed", "megatron")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case ids (default: every case this machine can run; "
                                               "--list shows them)")
    ap.add_argument("--out", metavar="FILE", help="write the results as JSON (e.g. docs/data/gpu-check.json)")
    ap.add_argument("--list", action="store_true", help="print every case and exit")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the gloo adapter cases on CPU (checks the case code; not a GPU check)")
    ap.add_argument("--bandwidth-floor", type=float, default=0.8, metavar="FRACTION",
                    help="wire-bandwidth fails below this fraction of the nominal HBM bandwidth (default 0.8)")
    return ap.parse_args(argv)


def wanted_cases(text: str) -> list[str]:
    """The ``--cases`` ids, in order, each once."""
    out: list[str] = []
    for c in (x.strip() for x in text.split(",")):
        if c and c not in out:
            out.append(c)
    return out


def _environment(torch) -> dict:
    out = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "gpus": 0, "devices": []}
    if torch.cuda.is_available():
        out["gpus"] = torch.cuda.device_count()
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informative only
            out["nccl"] = None
    for dist_name in ("deepspeed", "megatron-core"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:  # the cases that need it fail on their own
            out[dist_name] = None
    return out


def _env(family: str, args: argparse.Namespace) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": args.device,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
           "GPU_CHECK_BANDWIDTH_FLOOR": repr(args.bandwidth_floor)}
    # The adapter cases: a rank that issues other collectives than its peers fails. Off elsewhere (the
    # sync-debug steps: its per-step exchange is a host round trip), whatever the caller's environment.
    env["TOPO_ALIGN_CHECK_COLLECTIVES"] = "1" if family in ADAPTER_FAMILIES else "0"
    return env


def _print_result(res: gpu_plan.Result) -> None:
    print(f"{res.result} {res.case.id} ({res.seconds:.1f} s) {res.detail}", flush=True)


def report(results: list[gpu_plan.Result], *, env: dict, args: argparse.Namespace, started: float,
           gpus: int) -> dict:
    return {"format": FORMAT, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "seconds": round(time.time() - started, 1), "device": args.device, "gpus": gpus,
            "environment": env, "argv": sys.argv[1:], "passed": sum(r.result == "PASS" for r in results),
            "failed": sum(r.result != "PASS" for r in results), "exit": gpu_plan.exit_code(results),
            "results": [r.as_dict() for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = wanted_cases(args.cases)
    bad = gpu_plan.unknown(wanted)
    if bad:
        print(gpu_plan.unknown_message(bad), file=sys.stderr)
        return gpu_plan.EXIT_USAGE
    if args.list:
        print(gpu_plan.case_list())
        return gpu_plan.EXIT_OK
    import torch  # after the refusal above: a mistyped case name answers at once, not after torch's import

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        print(gpu_plan.no_gpu_message(torch.__version__, torch.version.cuda), file=sys.stderr)
        return gpu_plan.EXIT_NO_GPU
    # Children inherit it at spawn: megatron-core and torch warn at import, once per rank, about what
    # a CPU or plain-torch install lacks; the case lines are what this check prints.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from gpu_world import run_cases

    started = time.time()
    planned = gpu_plan.plan(gpus, wanted, cpu=args.device == "cpu")
    results: list[gpu_plan.Result] = []
    for case, why in planned:
        if why is not None:
            res = gpu_plan.Result(case, "FAIL", 0.0, f"cannot run here: {why}")
            _print_result(res)
            results.append(res)
    runnable = [c for c, why in planned if why is None]
    for cases in gpu_plan.worlds(runnable):
        results += run_cases(cases, kind=args.device, env=_env(cases[0].family, args), report=_print_result)
    order = {c.id: i for i, (c, _) in enumerate(planned)}
    results.sort(key=lambda r: order[r.case.id])
    print()
    print(gpu_plan.table(results))
    print(gpu_plan.summary_line(results, time.time() - started), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report(results, env=_environment(torch), args=args, started=started, gpus=gpus),
                                  indent=2) + "\n", encoding="utf-8")
        print(f"gpu_check: results written to {out}", flush=True)
    return gpu_plan.exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
