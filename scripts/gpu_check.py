"""The GPU check (docs/reliability.md, "GPU check"): one line per case, ``PASS|FAIL|SKIP case detail``.

Runs tests/test_reducer_cuda.py (pytest), then every adapter on 4 NCCL ranks, one GPU each, as 2
virtual islands x 2 (scripts/gpu_cases.py): GroupedReducer, the DDP comm hook, DeepSpeed ZeRO 0-3,
Megatron DDP and distributed optimizer, hierarchical (equal to the framework's flat all-reduce
within 1e-6) and selective (SYNC parameters identical on all ranks, LOCAL inside each island,
everything after a reconciliation), with ``monitor.check_collectives`` on. Two ranks would make one
island each, a single tier that every adapter hands back to the framework, so the adapter cases
need 4 GPUs and are skipped, each with a line, on fewer.

Without CUDA it prints one SKIP line and exits 0. ``--backend gloo --device cpu`` runs the same
cases on CPU (the suite does, for a few cases: tests/test_gpu_check.py). Exit status 1 if any case
failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_cases import FAMILIES  # noqa: E402  (scripts/ is on sys.path: this file's directory)

WORLD = 4


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: every case)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per family's world (default 240)")
    return ap.parse_args(argv)


def _line(status: str, case: str, detail: str) -> str:
    line = f"{status} {case} {detail}"
    print(line, flush=True)
    return status


def _pytest_cuda() -> str:
    """tests/test_reducer_cuda.py in a child pytest: one line with its summary."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_reducer_cuda.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return _line("PASS" if proc.returncode == 0 else "FAIL", "pytest-test_reducer_cuda", tail)


def _run_family(family: str, cases: list[str], args: argparse.Namespace) -> list[str]:
    import gpu_cases

    from topo_integrations.testing import WorldError, run_world

    env = {"OMP_NUM_THREADS": "1", "TOPO_ALIGN_CHECK_COLLECTIVES": "1",
           "DS_ACCELERATOR": args.device, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])}
    try:
        per_rank = run_world(WORLD, gpu_cases.run_family, family, cases, args.device, timeout=args.timeout,
                             env=env, backend=args.backend)
    except WorldError as exc:
        first = str(exc).splitlines()[0]
        return [_line("FAIL", case, f"the {family} world failed: {first}") for case in cases]
    out = []
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        failed = [(rank, r) for rank, r in enumerate(results) if r[1] == "FAIL"]
        rank, (_, status, detail) = failed[0] if failed else (0, results[0])
        out.append(_line(status, case, detail + (f" [rank {rank}]" if failed else "")))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when nothing failed (skips included), 1 otherwise."""
    args = _args(argv)
    wanted = [c for c in args.cases.split(",") if c]
    known = [c for cases in FAMILIES.values() for c in cases]
    unknown = [c for c in wanted if c not in known]
    if unknown:
        print(f"gpu_check: unknown case(s) {unknown}; expected some of {known}", file=sys.stderr)
        return 2
    import torch  # after the refusal above: a mistyped case name answers at once, not after torch's import

    if args.device == "cuda" and not torch.cuda.is_available():
        _line("SKIP", "gpu-check", f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is "
                                   "False); nothing was run")
        return 0
    # Children inherit it at spawn: megatron-core and torch warn at import, once per rank, about
    # what a CPU or plain-torch install lacks; the case lines are what this check prints.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    statuses = []
    if args.device == "cuda" and not wanted:
        statuses.append(_pytest_cuda())
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    for family, cases in FAMILIES.items():
        cases = [c for c in cases if not wanted or c in wanted]
        if not cases:
            continue
        if args.device == "cuda" and gpus < WORLD:
            statuses += [_line("SKIP", c, f"needs {WORLD} GPUs (2 islands x 2 NCCL ranks, one GPU each), found "
                                          f"{gpus}") for c in cases]
            continue
        statuses += _run_family(family, cases, args)
    failed = statuses.count("FAIL")
    print(f"gpu_check: {statuses.count('PASS')} passed, {failed} failed, {statuses.count('SKIP')} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
