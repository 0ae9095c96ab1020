"""What a candidate of `method: auto` costs in quality, as steps: the factor on flat's steps it needs to
reach flat's validation loss (docs/costmodel.md, section 6).

The cost model (scenario.py) prices a step; a lossy candidate needs more of them. Two measured
pieces turn one into the other:

1. the candidate's gap to flat at equal steps, ``c`` (relative validation loss): the means of 3
   seeds of the 16-layer GPT of docs/convergence.md at 2, 4 and 8 islands (:data:`POINTS`), fitted
   per candidate as a plane in log2(islands) and log2(H) (:func:`quality_cost`): more islands and a
   longer H are never cheaper (a slope the points put below 0 is taken as 0), and a gap is never
   below 0 (a candidate that ended under flat is priced as flat), and an H shorter than the
   shortest measured is priced as that one (never better than measured);
2. how much longer flat trains to gain ``c``: its validation loss falls as ``steps ** -ALPHA`` near
   the end of those runs, so a candidate ``c`` above flat at equal steps reaches flat's loss after
   ``(1 + c) ** (1 / ALPHA)`` x flat's steps (:func:`steps_factor`).

Both are this repository's small GPT: a model whose loss falls faster with steps (a larger ALPHA) or
whose replicas drift less makes a LOCAL class cheaper than priced here, and the reverse. Beyond the
measured islands (2-8) and H (16-64) the plane extrapolates; tests/test_method_auto.py ties every
point and ALPHA to the data files they come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["ALPHA", "POINTS", "QualityPoint", "quality_cost", "steps_factor"]

ALPHA = 0.11
"""Exponent of flat's validation loss against steps over steps 200-400 of the 16-layer GPT (least
squares on log-log, the mean of seeds 0-2: docs/data/convergence-many-islands, flat)."""


@dataclass(frozen=True)
class QualityPoint:
    """A candidate's measured gap to flat: the mean of 3 seeds' final validation loss, relative."""

    method: str
    islands: int
    interval: int | None
    """H of a LOCAL class (None for a candidate without one)."""
    gap: float
    """(candidate - flat) / flat, the seeds' means."""
    source: str
    """The data file (under docs/data) and the run's name in it."""


POINTS: tuple[QualityPoint, ...] = (
    QualityPoint("int8", 2, None, -0.0025, "convergence-many-islands: **default: int8, every tensor SYNC**"),
    QualityPoint("int8", 4, None, -0.0036, "convergence-many-islands: **default: int8, every tensor SYNC**"),
    QualityPoint("int8", 8, None, -0.0030, "convergence-many-islands: **default: int8, every tensor SYNC**"),
    QualityPoint("local", 2, 16, 0.0392, "convergence-lean-candidate: lean, H 16"),
    QualityPoint("local", 4, 16, 0.0726, "convergence-lean-candidate: lean, H 16"),
    QualityPoint("local", 2, 64, 0.0514, "convergence-lean-candidate: lean, H 64, 4 fragments"),
    QualityPoint("local", 4, 64, 0.0881, "convergence-lean-candidate: lean, H 64, 4 fragments"),
)


@lru_cache(maxsize=None)
def _plane(method: str) -> tuple[float, float, float]:
    """(a, b, d) of ``gap = a + b log2(islands / 2) + d log2(H / 16)`` for ``method``, least squares
    over its points; a negative slope is dropped (set to 0) and the rest fitted again."""
    pts = [p for p in POINTS if p.method == method]
    if not pts:
        return 0.0, 0.0, 0.0
    x = np.array([[1.0, math.log2(p.islands / 2), math.log2((p.interval or 16) / 16)] for p in pts])
    y = np.array([p.gap for p in pts])
    keep = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0]  # a regressor the points do not vary is left out
    while True:
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        neg = [j for j in keep[1:] if coef[j] < 0]
        if not neg:
            return float(coef[0]), float(coef[1]), float(coef[2])
        keep = [j for j in keep if j not in neg]


def quality_cost(method: str, islands: int, interval: int | None = None) -> float:
    """The gap to flat at equal steps :func:`_plane` predicts for ``method`` at ``islands`` islands
    (and H = ``interval`` for the LOCAL class, at least 16: the shortest measured), at least 0: 0 for
    ``hierarchical``, the exact mean."""
    a, b, d = _plane(method)
    h = max(0.0, math.log2(interval / 16)) if interval else 0.0
    return max(0.0, a + b * math.log2(max(islands, 2) / 2) + d * h)


def steps_factor(method: str, islands: int, interval: int | None = None) -> float:
    """Flat's steps x this = the steps ``method`` needs to reach flat's validation loss."""
    return (1.0 + quality_cost(method, islands, interval)) ** (1.0 / ALPHA)
