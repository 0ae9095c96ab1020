"""Suite-wide settings.

``monitor.check_collectives`` is on for every multi-rank module (its ranks inherit the environment):
every engine compares every rank's collectives at the end of every step and raises
CollectiveOrderError at the first divergence (docs/reducer.md, "One schedule"). Modules marked
``emulated`` measure time or cut links on purpose and run without it.
"""

from __future__ import annotations

import os

import pytest

CHECK_ENV = "TOPO_ALIGN_CHECK_COLLECTIVES"
NOT_FAST = ("multirank", "emulated", "slow")
"""Marks that keep a test out of the fast tier (pytest.ini declares them)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in NOT_FAST):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="module", autouse=True)
def _check_collectives(request):
    declared = getattr(request.module, "pytestmark", [])
    marks = {m.name for m in (declared if isinstance(declared, list) else [declared])}
    old = os.environ.get(CHECK_ENV)
    if "emulated" in marks:
        os.environ.pop(CHECK_ENV, None)
    else:
        os.environ[CHECK_ENV] = "1"
    yield
    if old is None:
        os.environ.pop(CHECK_ENV, None)
    else:
        os.environ[CHECK_ENV] = old
