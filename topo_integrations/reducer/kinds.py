"""The reducer's vocabularies as enums: modes, gradient classes, traffic kinds.

They are ``StrEnum``: a member equals (and hashes like) its value, so configs, saved states and
logs keep plain strings, while code compares with the member (``mode is Mode.SELECTIVE``).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Mode", "Cls", "Traffic"]


class Mode(StrEnum):
    """How gradients are reduced (``mode`` of the config; docs/design.md)."""

    FLAT = "flat"
    """One all-reduce over the data-parallel group (the fallback)."""
    HIERARCHICAL = "hierarchical"
    """Island reduce-scatter, rail all-reduce of the shard, island all-gather (exact)."""
    SELECTIVE = "selective"
    """SYNC reduced hierarchically every step, LOCAL inside the island, replicas reconciled."""


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
