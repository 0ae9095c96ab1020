"""Two test processes on the 2-core machine (pytest-xdist, ``scripts/test.sh -n 2``), one test file each
at a time, the heaviest files first.

Why: a run of the suite in one process kept the two cores about three quarters busy: many modules
wait (on an emulated link, a timeout, a subprocess) or use one core, and their idle core went unused.
With two workers each takes the next file when it is done with its last, so a waiting module's idle
core runs another one's ranks.

What stays together: a file's tests (its module-scoped world starts once, on one worker) and every
module of the shared 4-rank world (tests/_world4.py: they run their parts in one world). Order: by
the seconds each file took in the recorded full run (docs/data/suite-times-after.json), largest first,
so that no heavy file starts last and leaves the other worker idle at the end (files not recorded
go last, in collection order).
"""

from __future__ import annotations

import ast
import json
from collections import OrderedDict
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

HERE = Path(__file__).resolve().parent
RECORD = HERE.parent / "docs" / "data" / "suite-times-after.json"
WORLD4 = "tests/_world4.py"


def world4_modules() -> set[str]:
    """The modules that share tests/_world4.py's world (its PARTS, read without importing torch)."""
    tree = ast.parse((HERE / "_world4.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PARTS" for t in node.targets):
            return {f"tests/{elt.elts[0].value}.py" for elt in node.value.elts}
    raise RuntimeError("tests/_world4.py defines no PARTS list")


def recorded_seconds() -> dict[str, float]:
    try:
        files = json.loads(RECORD.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return {}
    return {name: float(row.get("seconds") or 0.0) for name, row in files.items()}


class FileLanes(LoadFileScheduling):
    """``--dist loadfile`` with the shared world's modules as one unit and the heaviest units first."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._world4 = world4_modules()
        self._seconds = recorded_seconds()
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return WORLD4 if path in self._world4 else path

    def _weight(self, scope: str) -> float:
        return sum(self._seconds.get(f, 0.0) for f in (self._world4 if scope == WORLD4 else {scope}))

    def _assign_work_unit(self, node) -> None:
        # The work queue is complete before the first unit is handed out: order it once, heaviest
        # first (a stable sort: unrecorded files keep the collection's order, at the end).
        if not self._ordered:
            self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda kv: -self._weight(kv[0])))
            self._ordered = True
        super()._assign_work_unit(node)
