"""Equal wall-clock budgets and validation curves (the long-horizon preset, docs/benchmarks.md).

Pure functions: which system runs first and with what budget, the time a validation curve first
reaches a loss (linear interpolation between evaluations), where one curve is not below another.
A curve is a list of ``[step, seconds, loss]`` points: ``seconds`` is training wall time (slowest
rank, evaluations and the per-step budget check left out), step 0 at 0 s.
"""

from __future__ import annotations

from typing import Sequence

from .presets import REFERENCE

__all__ = ["run_order", "budget_for", "train_seconds", "time_to", "value_at", "not_below"]


def run_order(systems: Sequence[str], equal_budget: bool, budget_s: float | None) -> tuple[str, ...]:
    """The systems in run order: when the reference's time sets the budget, it runs first in every
    round (the others of the round need its time); otherwise as given."""
    if equal_budget and budget_s is None and REFERENCE in systems:
        return (REFERENCE, *(s for s in systems if s != REFERENCE))
    return tuple(systems)


def budget_for(key: str, round_budget: float | None, *, equal_budget: bool,
               budget_s: float | None) -> tuple[float | None, str | None]:
    """(budget in training seconds or None = run ``--steps`` steps, reason the run cannot start or None)."""
    if not equal_budget:
        return None, None
    if budget_s is not None:
        return budget_s, None
    if key == REFERENCE:
        return None, None
    if round_budget is None:
        return None, f"no budget: {REFERENCE} did not finish in this round"
    return round_budget, None


def train_seconds(result: dict) -> float:
    """A run's training wall time: the last step's end on the slowest rank."""
    ends = result["step_end_s"]
    return float(ends[-1]) if ends else 0.0


def time_to(curve: Sequence[Sequence[float]], target: float) -> tuple[float, float] | None:
    """(seconds, step) at which ``curve`` first reaches ``target`` or below, interpolated linearly
    between the evaluation before and the first one at or below it; None when it never does."""
    prev = None
    for step, t, v in curve:
        if v <= target:
            if prev is None or prev[2] == v:
                return float(t), float(step)
            f = (prev[2] - target) / (prev[2] - v)
            return prev[1] + f * (t - prev[1]), prev[0] + f * (step - prev[0])
        prev = (step, t, v)
    return None


def value_at(curve: Sequence[Sequence[float]], t: float) -> float | None:
    """The curve's loss at ``t`` seconds (linear between evaluations); None outside its span."""
    for (_, t0, v0), (_, t1, v1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    if curve and curve[-1][1] == t:
        return curve[-1][2]
    return None


def not_below(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], t_from: float,
              t_to: float) -> list[tuple[float, float]]:
    """The spans of [t_from, t_to] (clipped to both curves) where ``a`` is not strictly below ``b``,
    compared at every evaluation time of either curve (both interpolated linearly)."""
    lo = max(t_from, a[0][1], b[0][1]) if a and b else t_from
    hi = min(t_to, a[-1][1], b[-1][1]) if a and b else lo
    if hi < lo:
        return []
    grid = sorted({lo, hi, *(p[1] for p in a if lo <= p[1] <= hi), *(p[1] for p in b if lo <= p[1] <= hi)})
    spans: list[tuple[float, float]] = []
    start = None
    for t in grid:
        bad = value_at(a, t) >= value_at(b, t)
        if bad and start is None:
            start = t
        if not bad and start is not None:
            spans.append((start, t))
            start = None
        if bad and t == grid[-1]:
            spans.append((start, t))
    return spans
