"""`method: auto`'s quality pricing (sim/quality.py; docs/costmodel.md, section 6): every measured point
and the loss exponent are the data files' figures, the LOCAL candidate is the class those runs
measured, and the steps factor behaves as the rule needs (exact = 1, never below 1, never cheaper
with more islands or a longer H, an H under the measured priced as the shortest measured)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from _scripts import script

from topo_integrations.sim.choose import H_STEPS, method_config
from topo_integrations.sim.quality import ALPHA, POINTS, quality_cost, steps_factor

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).resolve().parents[1] / "docs" / "data"
LAYOUT = {2: "2x2", 4: "4x2", 8: "8x1"}


def _runs(folder: str) -> list[dict]:
    return json.loads((DATA / folder / "results.json").read_text())


def _flat(runs: list[dict], seed: int) -> float:
    """The 16-layer GPT's flat of ``seed`` (layout-independent: the first layout that ran it)."""
    return next(r["final"] for r in runs if r["task"] == "gpt16" and r["name"] == "flat" and r["seed"] == seed)


@pytest.mark.parametrize("point", POINTS, ids=lambda p: f"{p.method}-{p.islands}-{p.interval}")
def test_every_point_is_the_mean_gap_of_its_runs(point):
    folder, name = point.source.split(": ", 1)
    runs = _runs(folder)
    mine = [r for r in runs if r["task"] == "gpt16" and r["name"] == name and r["layout"] == LAYOUT[point.islands]]
    assert sorted(r["seed"] for r in mine) == [0, 1, 2]
    gap = statistics.mean((r["final"] - _flat(runs, r["seed"])) / _flat(runs, r["seed"]) for r in mine)
    assert point.gap == round(gap, 4)


def test_alpha_is_flats_loss_exponent():
    """Least squares of log(loss) on log(step) over steps 200-400 of flat's curve, the mean of 3 seeds."""
    slopes = []
    for r in _runs("convergence-many-islands"):
        if r["task"] == "gpt16" and r["name"] == "flat" and r["layout"] == "2x2":
            pts = [(math.log(s), math.log(v)) for s, v in r["curve"] if 200 <= s <= 400]
            mx, my = statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts)
            slopes.append(-sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
    assert len(slopes) == 3 and ALPHA == round(statistics.mean(slopes), 2)


def test_the_local_candidate_is_the_class_that_was_measured():
    lean = script("convergence").LEAN
    for h in (16, 64):
        keys = method_config("local", h)
        assert {k: keys[k] for k in lean} == lean
    assert method_config("local", 64)["local.stream_fragments"] == 4 and method_config("local", 16)[
        "local.stream_fragments"] == 1  # as the grid's "H 64, 4 fragments" and "H 16" runs


def test_the_steps_factor_never_rewards_more_islands_a_longer_h_or_an_unmeasured_h():
    assert quality_cost("hierarchical", 64) == 0.0 and steps_factor("hierarchical", 1000) == 1.0
    for method in ("int8", "local"):
        for n in (2, 4, 8, 16, 128):
            h = [steps_factor(method, n, h) for h in H_STEPS]
            assert all(f >= 1.0 for f in h) and h == sorted(h)
            assert steps_factor(method, n, 1) == steps_factor(method, n, 16)  # priced as the shortest measured
            assert steps_factor(method, 2 * n, 16) >= steps_factor(method, n, 16)
    # a gap c at equal steps needs (1 + c) ** (1 / ALPHA) x flat's steps
    c = quality_cost("local", 4, 16)
    assert steps_factor("local", 4, 16) == pytest.approx((1 + c) ** (1 / ALPHA))
