"""Collective fingerprints and their cross-rank check (``monitor.check_collectives``).

The ordering rule (docs/reducer.md, "One schedule"): every collective of the engine is issued by
one thread, the dispatcher's, in an order that the program fixes and that is the same on every rank.
This module checks the rule instead of trusting it: with the check on, every collective issued
through ``collectives.run`` appends a fingerprint ``(communicator, ranks, op, dtype, elements)`` to
a :class:`Trace`, and at the end of every step the dispatcher gathers the traces over the
data-parallel group and :func:`compare` raises :class:`CollectiveOrderError` at the first divergence:

1. **per communicator**: every member issued the same sequence of collectives on it;
2. **across communicators**: any two ranks issued the collectives of the communicators they share
   in the same relative order (a rank that waits in communicator A while its peer waits in B, each
   for the other, is the classic multi-communicator deadlock of NCCL).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["Fingerprint", "Trace", "CollectiveOrderError", "compare", "CHECK_ENV", "check_requested"]

CHECK_ENV = "TOPO_ALIGN_CHECK_COLLECTIVES"
"""Set to 1 to turn ``monitor.check_collectives`` on without touching the config (the suite does)."""


def check_requested(configured: bool) -> bool:
    """The config's ``monitor.check_collectives`` or ``$TOPO_ALIGN_CHECK_COLLECTIVES=1``."""
    return configured or os.environ.get(CHECK_ENV, "").strip() not in ("", "0", "false", "no")


class CollectiveOrderError(RuntimeError):
    """Two ranks issued different collectives, or the same ones in a different order (names both)."""


@dataclass(frozen=True)
class Fingerprint:
    comm: str
    """The communicator's name, e.g. 'intra group (global ranks 0, 1)'."""
    ranks: tuple[int, ...]
    """Its members (global ranks)."""
    op: str
    dtype: str
    numel: int
    seq: int
    """Position in this rank's trace of the step."""

    def what(self) -> str:
        return f"#{self.seq} {self.op} of {self.numel} x {self.dtype} on the {self.comm}"


class Trace:
    """This rank's fingerprints since the last :meth:`take` (appended by the issuing thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Fingerprint] = []

    def add(self, comm: str, ranks, op: str, dtype, numel: int) -> None:
        with self._lock:
            self._items.append(Fingerprint(comm, tuple(int(r) for r in ranks), op, str(dtype).replace("torch.", ""),
                                           int(numel), len(self._items)))

    def take(self) -> list[Fingerprint]:
        with self._lock:
            out, self._items = self._items, []
        return out


def compare(traces: dict[int, list[Fingerprint]], *, step: int) -> None:
    """Raise :class:`CollectiveOrderError` at the first divergence between the ranks' traces.

    ``traces``: global rank -> its fingerprints of the step, for every rank of the data-parallel
    group (communicators outside it are not checked).
    """
    # 1. Per communicator: the members' sequences are equal.
    comms: dict[tuple, tuple[int, ...]] = {}
    for fps in traces.values():
        for f in fps:
            comms.setdefault((f.comm, f.ranks), f.ranks)
    for (comm, ranks), members in sorted(comms.items()):
        seqs = {m: [f for f in traces.get(m, []) if (f.comm, f.ranks) == (comm, ranks)]
                for m in members if m in traces}
        ref_rank = min(seqs)
        ref = seqs[ref_rank]
        for m, seq in sorted(seqs.items()):
            for i in range(max(len(ref), len(seq))):
                a = ref[i] if i < len(ref) else None
                b = seq[i] if i < len(seq) else None
                if a is None or b is None or (a.op, a.dtype, a.numel) != (b.op, b.dtype, b.numel):
                    raise CollectiveOrderError(
                        f"topo_align: collectives diverge at step {step} on the {comm}, call {i} there: "
                        f"rank {ref_rank} issued {a.what() if a else 'nothing'}, rank {m} issued "
                        f"{b.what() if b else 'nothing'} (monitor.check_collectives)")
    # 2. Across communicators: two ranks order the calls of their shared communicators alike.
    ranks = sorted(traces)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            def shared(r, a=a, b=b):
                return [(f.comm, f.ranks, f.op) for f in traces[r] if a in f.ranks and b in f.ranks]
            sa, sb = shared(a), shared(b)
            if sa != sb:
                k = next(j for j in range(min(len(sa), len(sb)) + 1)
                         if j >= len(sa) or j >= len(sb) or sa[j] != sb[j])
                fa = sa[k] if k < len(sa) else None
                fb = sb[k] if k < len(sb) else None
                raise CollectiveOrderError(
                    f"topo_align: ranks {a} and {b} order their shared collectives differently at step {step}: "
                    f"call {k} is {fa[2] + ' on the ' + fa[0] if fa else 'nothing'} on rank {a} but "
                    f"{fb[2] + ' on the ' + fb[0] if fb else 'nothing'} on rank {b} (a peer waiting in one "
                    "communicator while the other waits in another deadlocks NCCL; monitor.check_collectives)")
