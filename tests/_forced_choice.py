"""`method: auto` with the cost model's verdict fixed, for the tests that drive an adapter through a
switch to a LOCAL class and back (tests/test_method_auto.py, tests/test_deepspeed_multirank.py,
tests/test_megatron_ddp.py), and the schedule they share: the first choice takes effect after step 5
(DP position 0 timed steps 2-5: ``TIMED_STEPS``), :func:`rechoose` before step ``RECHOICE_STEP``,
``STEPS`` steps in all."""

from __future__ import annotations

import contextlib

RECHOICE_STEP, STEPS = 8, 10

AUTO_BLOCK = {"mode": "selective", "method": "auto", "adaptive": {"enabled": True, "check_interval": 1000},
              "sync": {"last_n_layers": 1}, "local": {"promote_drift_fraction": 0.0}}
"""`method: auto` with the adaptive controller on (renewed at each switch; its own checks out of the
way) and no drift promotion (it would move LOCAL tensors to SYNC and blur what the switch did)."""


def auto_block(**over) -> dict:
    """:data:`AUTO_BLOCK` with ``over``'s sections merged in (``sync={"always_sync": [...]}``)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in AUTO_BLOCK.items()}
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def rechoose(engine) -> None:
    """What the adaptive monitor does when the slow tier measures 4x slower than its reference
    (0.25 x: beyond ``RECHOOSE_FACTOR``): choose again, collectively over the DP group."""
    engine.method.rechoose(0.25, 1.0, 4.0)


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
