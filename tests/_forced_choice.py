"""`method: auto` with the cost model's verdict fixed, for the tests that drive an adapter through a
switch to a LOCAL class and back (tests/test_method_auto.py, tests/test_deepspeed_multirank.py,
tests/test_megatron_ddp.py)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def forced_method_choices(first: tuple[str, int | None] = ("local", 2),
                          rechosen: tuple[str, int | None] = ("hierarchical", None)):
    """`method: auto` with the cost model's verdict fixed, so a test can drive an adapter through a
    switch to a LOCAL class and back: inside the block DP position 0's first choice is ``first`` and
    every re-choice (the adaptive monitor's trigger, ``MethodAuto.rechoose``) is ``rechosen``, each a
    (candidate, H or None). Only the verdict is fixed: the timing, the broadcast to every rank and
    the switch run as in a job. Not thread-safe (a module attribute is swapped)."""
    import topo_integrations.reducer.adaptive.method as mm
    from topo_integrations.sim.choose import MethodChoice, method_config

    def fixed(inp):
        m, h = rechosen if "adaptive monitor" in inp.slow_origin else first
        return MethodChoice(m, method_config(m, h), {"hierarchical": 2.0, "int8": 1.5, "local": 1.0}, 1.0,
                            "int8", h or 2, "fixed by the test")

    real, mm.choose_for_groups = mm.choose_for_groups, fixed
    try:
        yield
    finally:
        mm.choose_for_groups = real
