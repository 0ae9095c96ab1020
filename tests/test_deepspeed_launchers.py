"""The plugin under real launchers: ``torchrun`` (always) and the ``deepspeed`` launcher (opt-in).

Each launch starts 4 fresh processes (about a minute on a loaded 2-core machine), so only one short
run per launcher: ``install()`` + plain ``deepspeed.initialize``, topology from a file (a launcher
cannot give each rank its own fake hostname), 2 steps vs stock DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "tests" / "fixtures" / "deepspeed" / "virtual-2x2.json"


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _check(out: Path, proc: subprocess.CompletedProcess, stage: int):
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    res = json.loads(out.read_text())
    assert res["world_size"] == 4 and res["plugin"] and res["engine"] == "TopoAlignDeepSpeedEngine", res
    assert res["rel_err_vs_stock"] <= 1e-6, res
    assert res["plan"].startswith("2 islands of 2 ranks"), res
    return res


@pytest.mark.timeout(480)
def test_torchrun_short_run(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "-m", "topo_integrations.deepspeed.selfcheck", "--topology", str(TOPOLOGY), "--stage", "2",
           "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=460)
    res = _check(out, proc, 2)
    assert res["launcher_env"]["TORCHELASTIC_RUN_ID"]


@pytest.mark.timeout(480)
@pytest.mark.skipif(os.environ.get("TOPO_ALIGN_LAUNCHER_TESTS") != "1",
                    reason="the deepspeed launcher run takes 1-2.5 minutes; set TOPO_ALIGN_LAUNCHER_TESTS=1")
def test_deepspeed_launcher_short_run(tmp_path):
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed beside this Python")
    from topo_integrations.testing import free_port

    out = tmp_path / "result.json"
    env = _env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()), "--module",
           "topo_integrations.deepspeed.selfcheck", "--topology", str(TOPOLOGY), "--stage", "1", "--steps", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=460)
    res = _check(out, proc, 1)
    assert res["launcher_env"]["LOCAL_SIZE"] == "4"
