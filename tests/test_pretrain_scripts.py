"""The launch script end to end: `scripts/pretrain_gpt_deepspeed.sh` (torchrun, 4 gloo ranks as 2
virtual nodes x 2) killed with SIGKILL mid-run, then started again with `--resume`."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.multirank

FLAGS = ["--skip-setup", "--run-name", "kill", "--train-steps", "30", "--save-interval", "3",
         "--eval-interval", "100", "--eval-batches", "1", "--micro-batch-size", "2", "--seq-length", "32",
         "--corpus-max-bytes", "1500000", "--no-tensorboard", "--lr", "1e-3"]


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts each rank in a session of its own, so
    killing the launcher's process group would leave the ranks running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL the launcher and every rank at once, as when a node dies."""
    for p in _tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rows(path: str) -> list[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return [r for r in csv.DictReader(fh) if r["loss"]]
    except (OSError, KeyError):
        return []


@pytest.mark.timeout(280)
def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    script = os.path.join(ROOT, "scripts", "pretrain_gpt_deepspeed.sh")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", script, "--runs-dir", str(tmp_path), *FLAGS]
    csv_path = tmp_path / "kill" / "metrics.csv"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_rows(str(csv_path))) >= 4:  # past the first checkpoint (step 3)
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read()}"
        _kill_tree(proc.pid)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
        proc.wait(timeout=30)
    before = {int(r["step"]): r["loss"] for r in _rows(str(csv_path))}
    with open(tmp_path / "kill" / "checkpoints" / "latest") as fh:
        ckpt = int(fh.read().strip().split("_")[-1])
    killed_at = max(before)
    assert 3 <= ckpt <= killed_at and ckpt % 3 == 0 and killed_at < 30

    r = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from the checkpoint of step {ckpt}" in r.stdout
    after = {int(x["step"]): x["loss"] for x in _rows(str(csv_path))}
    assert sorted(after) == list(range(1, 31))  # every step once: none lost, none doubled
    # Steps the killed run did after its checkpoint are redone with the same data and state.
    assert all(after[s] == before[s] for s in before)
    assert "==== summary" in r.stdout
