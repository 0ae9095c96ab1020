"""What a failure of the reducer's communication is: :class:`CollectiveError`.

Its own module at the bottom of the reducer, so that everything that raises or catches it (the
collectives, the completion watch, the dispatcher, the process-group planning) depends on the
vocabulary, not on the collectives.
"""

from __future__ import annotations

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective of the reducer failed or timed out; the message names op, group and ranks."""
