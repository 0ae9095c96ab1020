"""scripts/gpu_check.sh and its driver (docs/reliability.md, "GPU check") without a GPU: the one
SKIP line, and the driver's cases on 4 gloo ranks on CPU (the code the GPU run executes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", PYTHON=sys.executable)


def _run(*cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_a_gpu_the_script_prints_one_skip_line_and_exits_0():
    out = _run("bash", "scripts/gpu_check.sh", timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"SKIP gpu-check no CUDA device (torch {torch.__version__}: "
                                       "torch.cuda.is_available() is False); nothing was run"]


@pytest.mark.timeout(60)
def test_an_unknown_case_is_refused():
    out = _run(sys.executable, "scripts/gpu_check.py", "--cases", "zero4", timeout=50)
    assert out.returncode == 2
    assert out.stderr.startswith("gpu_check: unknown case(s) ['zero4']; expected some of "
                                 "['grouped-reducer-hierarchical', ")


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_the_driver_runs_its_cases_on_gloo_and_cpu():
    """Two families on 4 gloo ranks: hierarchical equals the flat all-reduce within 1e-6 and the
    selective invariants hold, one PASS line each; the summary line counts them."""
    out = _run(sys.executable, "scripts/gpu_check.py", "--backend", "gloo", "--device", "cpu", "--timeout", "300",
               "--cases", "grouped-reducer-hierarchical,ddp-hook-selective,deepspeed-zero1-selective",
               timeout=390)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert [ln.split(" ")[:2] for ln in lines[:-1]] == [
        ["PASS", "grouped-reducer-hierarchical"], ["PASS", "ddp-hook-selective"], ["PASS", "deepspeed-zero1-selective"]]
    assert "grad rel err vs flat all-reduce" in lines[0] and "(<= 1e-06)" in lines[0]
    assert "broken: []" in lines[2]
    assert lines[-1] == "gpu_check: 3 passed, 0 failed, 0 skipped"
