"""The reducer's vocabularies as enums: modes, gradient classes, traffic kinds, adaptive levels,
importance methods.

They are ``StrEnum``: a member equals (and hashes like) its value, so configs, saved states and
logs keep plain strings, while code compares with the member (``mode is Mode.SELECTIVE``,
``cfg.mode == Mode.FLAT``). ``Mode`` is defined in config.py (the topology planner, below the
reducer, compares with it too) and re-exported here.
"""

from __future__ import annotations

from enum import StrEnum

from ..config import Mode

__all__ = ["Mode", "Cls", "Traffic", "Level", "Method"]


class Cls(StrEnum):
    """The class of a tensor in `selective` (every tensor is SYNC outside it)."""

    SYNC = "SYNC"
    LOCAL = "LOCAL"


class Traffic(StrEnum):
    """What a collective carries, as booked by Stats (bytes and seconds per tier and traffic)."""

    SYNC = "sync"
    """Gradients reduced over every rank (all of them in `flat`/`hierarchical`)."""
    LOCAL = "local"
    """LOCAL gradients inside the island."""
    RECONCILE = "reconcile"
    """Averaging LOCAL parameters and optimizer state across islands."""
    CONTROL = "control"
    """Scores, agreement scalars, probes, fingerprints."""


class Level(StrEnum):
    """An adaptive degradation level (adaptive.py), in escalation order."""

    NORMAL = "normal"
    """As configured."""
    RECONCILE = "reconcile"
    """`selective`: reconcile ``reconcile_factor`` times less often."""
    FP16 = "fp16"
    """The inter-group wire becomes FP16 with error feedback (only from an fp32 wire)."""
    FLAT = "flat"
    """One all-reduce over the data-parallel group, kept only where measured faster."""


class Method(StrEnum):
    """How per-tensor importance is scored (``importance.method``; importance.py)."""

    FISHER = "fisher"
    """EMA of the squared reduced gradient, fed by the adapter every step."""
    MAGNITUDE = "magnitude"
    """Mean squared parameter value at the refresh."""
    HUTCHINSON = "hutchinson"
    """Hessian-diagonal estimate from a loss closure at the refresh."""
