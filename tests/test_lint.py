"""The lint configuration (ruff.toml) holds: `ruff check` finds nothing, with the pinned ruff.

The per-file ignores in ruff.toml exist only for modules that other work is rewriting; the last test
fails once an ignore is no longer needed, so the list only shrinks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    if proc.returncode != 0 and "No module named ruff" in proc.stderr:
        pytest.fail("ruff is not installed; install the pinned one: "
                    f"{sys.executable} -m pip install -c constraints.txt ruff")
    return proc


def _pinned() -> str:
    m = re.search(r"^ruff==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert m, "constraints.txt pins no ruff version"
    return m.group(1)


def test_ruff_is_the_pinned_version():
    out = _ruff("--version").stdout.split()
    assert out[-1] == _pinned(), f"ruff {out[-1]} is installed; constraints.txt pins {_pinned()}"


def test_ruff_check_finds_nothing():
    proc = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert proc.returncode == 0, f"ruff check (ruff.toml) found problems:\n{proc.stdout}{proc.stderr}"


def test_per_file_ignores_are_still_needed():
    cfg = tomllib.loads((ROOT / "ruff.toml").read_text())
    ignores = cfg["lint"].get("per-file-ignores", {})
    stale = []
    for path, codes in ignores.items():
        assert (ROOT / path).is_file(), f"ruff.toml ignores findings in {path}, which does not exist"
        proc = _ruff("check", "--isolated", "--no-cache", "--line-length", str(cfg["line-length"]),
                     "--select", ",".join(codes), "--output-format", "json", path)
        found = {f["code"] for f in json.loads(proc.stdout or "[]")}
        stale += [f"{path}: {code}" for code in codes if code not in found]
    assert not stale, ("these ruff.toml per-file ignores match nothing any more; delete them: "
                       + "; ".join(stale))
