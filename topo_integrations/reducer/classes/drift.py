"""Drift monitor: how far the groups' LOCAL replicas had moved apart when they were reconciled.

In `selective` mode LOCAL parameters are averaged inside a group only, so between two
reconciliations each group follows its own trajectory. At every reconciliation the reducer holds,
for each LOCAL parameter, this group's value ``p_g`` (the snapshot) and the cross-group mean
``mean`` (the average). The monitor turns them into one number per tensor,

    drift(t) = sqrt( mean_over_ranks ||p_g(t) - mean(t)||^2 ) / ||mean(t)||

(the root-mean-square distance of the groups from their mean, relative to the mean), agreed across
the data-parallel group so that every rank logs the same value and takes the same promotion
decision. Optimizer state is reconciled too but not measured: the parameters are what the model is.

Promotion (``local.promote_drift_fraction`` > 0): after a *blocking* reconciliation (every
parameter it covered is then identical on all ranks, so a class change cannot break invariant 1 of
docs/reducer.md) the LOCAL tensors with the largest score become SYNC, largest first, while the
promoted tensors stay within that fraction of all gradient elements. A tensor's score is the mean
of its last ``local.promote_window`` measured drifts (1: the latest), and only a tensor measured
that often is a candidate. Promotions survive class refreshes and checkpoints; with
``local.demote`` a full budget admits a candidate whose score is at least ``DEMOTE_MARGIN`` times
the smallest score a promoted tensor had at its promotion, and that tensor turns LOCAL again
(a SYNC tensor is identical everywhere, so demoting it is safe at any reconciliation).
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = ["DriftMonitor", "DEMOTE_MARGIN"]

log = logging.getLogger("topo_align")

DEMOTE_MARGIN = 2.0
"""A candidate displaces a promoted tensor only when its score is at least this many times the
displaced tensor's score at promotion, so that two tensors of similar drift do not swap back and
forth at every reconciliation."""


class DriftMonitor:
    """Measures, logs and keeps the drift of LOCAL tensors; proposes promotions to SYNC.

    ``promote_fraction``: budget of promoted tensors as a fraction of all gradient elements
    (``total_numel``); 0 disables promotion (measuring and logging stay on).
    """

    def __init__(self, promote_fraction: float, total_numel: int, *, window: int = 1, demote: bool = False):
        if not 0.0 <= promote_fraction <= 1.0:
            raise ValueError(f"local.promote_drift_fraction = {promote_fraction!r}; expected a float in [0, 1]")
        if window < 1:
            raise ValueError(f"local.promote_window = {window!r}; expected an integer >= 1")
        self.promote_fraction = float(promote_fraction)
        self.total_numel = int(total_numel)
        self.window = int(window)
        self.demote = bool(demote)
        self._last: dict[str, float] = {}
        self._recent: dict[str, list[float]] = {}
        self.promoted_score: dict[str, float] = {}
        """The score each promoted tensor had when it was promoted (demotion compares with it)."""
        self.demoted: list[str] = []
        """Tensors demoted back to LOCAL, in order (reporting)."""
        self._last_step: int | None = None
        self._history: list[tuple[int, float, float]] = []
        self.promoted: list[str] = []
        """Tensors promoted to SYNC, in promotion order (sticky)."""
        self._pending: list[tuple] = []
        """Measurements whose agreed sums have not been read on the host yet (:meth:`poll`)."""

    # The measured values, read through :meth:`settle` (a measurement in flight is read first).

    @property
    def last(self) -> dict[str, float]:
        """Relative drift per LOCAL tensor at the latest measured reconciliation (with streaming
        reconciliation: of the latest fragment's tensors)."""
        self.settle()
        return self._last

    @last.setter
    def last(self, value: dict[str, float]) -> None:
        self.settle()
        self._last = value

    @property
    def recent(self) -> dict[str, list[float]]:
        """The last ``window`` measured drifts of each tensor (oldest first)."""
        self.settle()
        return self._recent

    @property
    def history(self) -> list[tuple[int, float, float]]:
        """(step, max drift, element-weighted mean drift) of every measured reconciliation."""
        self.settle()
        return self._history

    @property
    def last_step(self) -> int | None:
        self.settle()
        return self._last_step

    # ------------------------------------------------------------------ measuring

    def measure_segments(self, segs: list[tuple[str, int, int]], before: torch.Tensor, after: torch.Tensor,
                         wire, step: int) -> None:
        """Agreed relative drift per LOCAL parameter of one reconciliation (read into :attr:`last`,
        :attr:`recent`, :attr:`history` once the agreed sums have landed; logged then).

        ``segs``: (parameter name, offset, numel) of the flat vectors' parameter values; a name may
        have several segments, and on a partitioned optimizer each rank holds only part of a tensor
        (the sums over ranks are then over the whole tensor, the ratio is unchanged). ``before`` is
        this rank's values before averaging (its group's replica), ``after`` the cross-group average.
        Phases: 1. per name, the local ``||before - after||^2`` and ``||after||^2`` in fp64;
        2. one SUM all-reduce of both vectors over the data-parallel group (``wire.agree_later``:
        issued now, in the schedule); 3. ratio, on the host, when the sums have landed (:meth:`poll`
        at every step, or the first read: no host wait at the reconciliation itself).
        Collective over the DP group: every rank must call it at the same reconciliation, with the
        same names (ranks holding no part of a tensor contribute zeros).
        """
        names = sorted({n for n, _, _ in segs})
        if not names:
            return
        pos = {n: i for i, n in enumerate(names)}
        dev = torch.zeros(2 * len(names), dtype=torch.float64, device=before.device)
        for name, off, n in segs:
            b = before[off:off + n].double()
            a = after[off:off + n].double()
            dev[pos[name]] += (b - a).pow(2).sum()
            dev[len(names) + pos[name]] += a.pow(2).sum()
        weights: dict[str, int] = {}
        for name, _, n in segs:
            weights[name] = weights.get(name, 0) + n
        self._pending.append((names, weights, step, wire.agree_later(dev, "sum")))
        self.poll()

    def poll(self) -> None:
        """Read the measurements whose agreed sums have landed, in order (never waits)."""
        while self._pending and self._pending[0][3].landed():
            self._read(*self._pending.pop(0))

    def settle(self) -> None:
        """Read every measurement in flight (a bounded wait for the agreed sums not landed yet)."""
        while self._pending:
            self._read(*self._pending.pop(0))

    def _read(self, names: list[str], weights: dict[str, int], step: int, agreed) -> None:
        # A host copy made inside the agreement (Wire.agree_later), already landed: no device sync.
        agreed = agreed.value().tolist()
        drift = {}
        for i, name in enumerate(names):
            ref = agreed[len(names) + i]
            drift[name] = math.sqrt(agreed[i]) / math.sqrt(ref) if ref > 0 else (0.0 if agreed[i] == 0 else math.inf)
        self._last = drift
        self._last_step = step
        for name, d in drift.items():
            self._recent[name] = (self._recent.get(name, []) + [d])[-self.window:]
        total = sum(weights.values())
        mx = max(drift.values())
        mean = sum(drift[n] * weights[n] for n in drift) / total if total else 0.0
        self._history.append((step, mx, mean))
        worst = max(drift, key=lambda n: (drift[n], n))
        log.info("topo_align: step %d: LOCAL drift at reconciliation: max %.3e (%s), mean %.3e over %d tensors",
                 step, mx, worst, mean, len(drift))

    # ------------------------------------------------------------------ promotion

    def score(self, name: str, *, partial: bool = False) -> float | None:
        """The promotion score of ``name``: its latest drift (window 1) or the mean of its last
        ``window`` drifts; None while it was measured fewer times (``partial``: any number >= 1)."""
        if self.window == 1:
            return self.last.get(name)
        h = self.recent.get(name, [])
        if not h or (len(h) < self.window and not partial):
            return None
        return sum(h) / len(h)

    def configure(self, promote_fraction: float, *, window: int, demote: bool, numels: dict[str, int]) -> list[str]:
        """New knobs from now on (`method: auto` puts the engine on a candidate's ``local.*``): the
        budget, the window, demotion. Promotions beyond the new budget turn LOCAL again, the latest
        first (safe at any step: a SYNC tensor is identical everywhere). Returns them."""
        if not 0.0 <= promote_fraction <= 1.0:
            raise ValueError(f"local.promote_drift_fraction = {promote_fraction!r}; expected a float in [0, 1]")
        if window < 1:
            raise ValueError(f"local.promote_window = {window!r}; expected an integer >= 1")
        self.promote_fraction, self.window, self.demote = float(promote_fraction), int(window), bool(demote)
        dropped = []
        while self.promoted and self._budget(numels) < 0:
            v = self.promoted.pop()
            self.promoted_score.pop(v, None)
            self.recent.pop(v, None)
            dropped.append(v)
        self.demoted.extend(dropped)
        return dropped

    def _budget(self, numels: dict[str, int]) -> float:
        return self.promote_fraction * self.total_numel - sum(numels[n] for n in self.promoted)

    def promotions(self, classes: dict[str, str], numels: dict[str, int],
                   eligible: set[str] | None = None) -> tuple[list[str], list[str]]:
        """(tensors to promote now, promoted tensors to demote now): largest score first, ties by
        name, within the budget; ``eligible`` limits the candidates to the tensors that are
        identical on every rank now (those of the reconciliation just done).

        Deterministic from agreed inputs, so every rank returns the same lists. Records them."""
        if self.promote_fraction <= 0:
            return [], []
        scored = [(self.score(n), n) for n, c in classes.items()
                  if c == "LOCAL" and n not in self.promoted and (eligible is None or n in eligible)]
        budget = self._budget(numels)
        out, demoted = [], []
        for sc, name in sorted(((sc, n) for sc, n in scored if sc is not None), key=lambda x: (-x[0], x[1])):
            if numels[name] > budget and self.demote:
                # Displace the promoted tensors of smallest score at promotion (older first), while
                # the candidate beats each by the margin, until it fits.
                victims, freed = [], 0
                for v in sorted((v for v in self.promoted if v not in out),
                                key=lambda v: (self.promoted_score.get(v, 0.0), self.promoted.index(v))):
                    if budget + freed >= numels[name] or sc < DEMOTE_MARGIN * self.promoted_score.get(v, 0.0):
                        break
                    victims.append(v)
                    freed += numels[v]
                if budget + freed >= numels[name]:
                    for v in victims:
                        self.promoted.remove(v)
                        self.promoted_score.pop(v, None)
                        self.recent.pop(v, None)  # measured anew as a LOCAL tensor
                    demoted += victims
                    budget += freed
            if numels[name] <= budget:
                out.append(name)
                self.promoted.append(name)
                self.promoted_score[name] = sc
                budget -= numels[name]
        self.demoted.extend(demoted)
        if out:
            log.info("topo_align: promoting %d drifting LOCAL tensor(s) to SYNC: %s", len(out), ", ".join(out))
        if demoted:
            log.info("topo_align: demoting %d promoted tensor(s) back to LOCAL (displaced by larger drift): %s",
                     len(demoted), ", ".join(demoted))
        return out, demoted

    def wants_blocking(self, classes: dict[str, str], numels: dict[str, int]) -> bool:
        """True when the next reconciliation may promote or demote (then it must block: classes may
        change only when every replica is identical): a LOCAL tensor fits the budget and will have
        been measured ``window`` times after it, or (``demote``) one would displace a promoted
        tensor on the scores measured so far."""
        if self.promote_fraction <= 0:
            return False
        budget = self._budget(numels)
        local = [n for n, c in classes.items() if c == "LOCAL" and n not in self.promoted]
        ready = [n for n in local if len(self.recent.get(n, [])) >= self.window - 1 or self.window == 1]
        if any(numels[n] <= budget for n in ready):
            return True
        if not (self.demote and self.promoted):
            return False
        low = min(self.promoted_score.get(v, 0.0) for v in self.promoted)
        return any((self.score(n, partial=True) or 0.0) >= DEMOTE_MARGIN * low for n in ready)

    def apply(self, classes: dict[str, str]) -> dict[str, str]:
        """``classes`` with every promoted tensor forced to SYNC (used after a class refresh)."""
        if not self.promoted:
            return classes
        out = dict(classes)
        for n in self.promoted:
            if n in out:
                out[n] = "SYNC"
        return out

    # ------------------------------------------------------------------ reporting and state

    def as_dict(self) -> dict:
        return {
            "last_step": self.last_step,
            "max": max(self.last.values()) if self.last else None,
            "mean": self.history[-1][2] if self.history else None,
            "per_tensor": dict(self.last),
            "history": [list(h) for h in self.history],
            "promoted": list(self.promoted),
            "demoted": list(self.demoted),
            "promote_fraction": self.promote_fraction,
        }

    def state_dict(self) -> dict:
        return {"last": dict(self.last), "last_step": self.last_step, "history": [list(h) for h in self.history],
                "promoted": list(self.promoted), "recent": {k: list(v) for k, v in self.recent.items()},
                "promoted_score": dict(self.promoted_score), "demoted": list(self.demoted)}

    def load_state_dict(self, sd: dict | None) -> None:
        if not sd:
            return
        self.settle()  # a measurement in flight belongs to the state being replaced
        self._last = {str(k): float(v) for k, v in sd.get("last", {}).items()}
        self._last_step = sd.get("last_step")
        self._history = [(int(s), float(m), float(a)) for s, m, a in sd.get("history", [])]
        self.promoted = [str(n) for n in sd.get("promoted", [])]
        # states of 0.2 and older carry no window, scores or demotions: the latest drift stands in
        self._recent = {str(k): [float(x) for x in v] for k, v in sd.get("recent", {}).items()} or \
            {k: [v] for k, v in self._last.items()}
        self.promoted_score = {str(k): float(v) for k, v in sd.get("promoted_score", {}).items()}
        self.demoted = [str(n) for n in sd.get("demoted", [])]
