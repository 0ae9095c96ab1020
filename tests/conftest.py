"""Suite-wide settings.

``monitor.check_collectives`` is on for every multi-rank module (its ranks inherit the environment):
every engine compares every rank's collectives at the end of every step and raises
CollectiveOrderError at the first divergence (docs/reducer.md, "One schedule"). Modules marked
``emulated`` measure time or cut links on purpose and run without it.
"""

from __future__ import annotations

import os
import resource

import pytest

CHECK_ENV = "TOPO_ALIGN_CHECK_COLLECTIVES"
CPU_PROPERTY = "cpu_s"
"""JUnit property of every test: CPU seconds (user + system) of pytest and of every child it waited
for, from its setup to its teardown. Unlike wall time it hardly moves with the machine's load, so
scripts/suite_times.py records it beside the seconds (docs/testing.md)."""
NOT_FAST = ("multirank", "emulated", "slow")
"""Marks that keep a test out of the fast tier (pytest.ini declares them)."""


def pytest_configure(config):
    # `scripts/test.sh` runs the suite on two pytest-xdist workers (-n 2 --dist loadfile): a file's
    # tests stay together, the shared 4-rank world's modules too, heaviest first (tests/_lanes.py).
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Lanes(), "topo_align_lanes")


class _Lanes:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from _lanes import FileLanes

        return FileLanes(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in NOT_FAST):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session", autouse=True)
def _world_preload():
    """run_world's fork server (one per test process, started by its first world) imports what the
    suite's worlds import besides torch, once: megatron-core (2.5 CPU s a rank otherwise) and, where
    its CPU accelerator is chosen (DS_ACCELERATOR, scripts/test.sh), DeepSpeed (0.9 s a rank)."""
    from topo_integrations import testing

    extra = ["megatron.core.parallel_state", "megatron.core.distributed"]
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        extra.append("deepspeed")
    testing.PRELOAD.extend(m for m in extra if m not in testing.PRELOAD)
    yield


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


def _cpu_s() -> float:
    # children: every process pytest waited for (torchrun and its workers, commands); the ranks of
    # run_world are the fork server's children (topo_integrations.testing.server_cpu_s)
    from topo_integrations.testing import server_cpu_s

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + server_cpu_s()


def pytest_runtest_logstart(nodeid, location):
    _cpu_at_start[nodeid] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":
        start = _cpu_at_start.pop(item.nodeid, None)
        if start is not None:
            outcome.get_result().user_properties.append((CPU_PROPERTY, round(_cpu_s() - start, 2)))


_cpu_at_start: dict[str, float] = {}
