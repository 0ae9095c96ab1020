"""Ending the process groups of what an emulated cluster started (cluster.py and runner.py both do).

Below both: runner.py supervises a launch and cluster.py cleans up at close, and neither imports the
other for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence

__all__ = ["kill_groups", "ranked_pids"]


def kill_groups(procs: Sequence[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM the process groups of processes started with start_new_session=True, wait up to
    ``grace_s`` for all of them together, then SIGKILL what is left. A group may outlive its leader
    (torchrun's workers), so every group is signalled even when its leader is gone."""
    # Only leaders not yet reaped: a reaped leader's pid may belong to someone else by now. Their
    # orphans, if any, are still inside our namespaces and die with them (netns.delete_namespace).
    procs = [p for p in procs if p.poll() is None]
    groups = [p.pid for p in procs]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()  # reap leaders, or they stay zombies and keep their group "alive"
            if not any(_group_alive(g) for g in groups):
                return
            time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def ranked_pids(pids: Sequence[int], rank: int) -> list[int]:
    """Those of ``pids`` that run global rank ``rank`` (``RANK=<rank>`` in their environment) and
    whose parent does not: the rank's own process, not the helpers it started."""
    want = f"RANK={rank}".encode()

    def has(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                return want in fh.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            return False

    def parent(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
                return int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    mine = {p for p in pids if has(p)}
    return sorted(p for p in mine if parent(p) not in mine)
