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
parameter is then identical on all ranks, so a class change cannot break invariant 1 of docs/reducer.md) the
LOCAL tensors with the largest drift become SYNC, largest first, while the promoted tensors stay
within that fraction of all gradient elements. Promotions are sticky (they survive class refreshes
and checkpoints): a tensor that drifted once is likely to drift again.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = ["DriftMonitor"]

log = logging.getLogger("topo_align")


class DriftMonitor:
    """Measures, logs and keeps the drift of LOCAL tensors; proposes promotions to SYNC.

    ``promote_fraction``: budget of promoted tensors as a fraction of all gradient elements
    (``total_numel``); 0 disables promotion (measuring and logging stay on).
    """

    def __init__(self, promote_fraction: float, total_numel: int):
        if not 0.0 <= promote_fraction <= 1.0:
            raise ValueError(f"local.promote_drift_fraction = {promote_fraction!r}; expected a float in [0, 1]")
        self.promote_fraction = float(promote_fraction)
        self.total_numel = int(total_numel)
        self.last: dict[str, float] = {}
        """Relative drift per LOCAL tensor at the latest measured reconciliation."""
        self.last_step: int | None = None
        self.history: list[tuple[int, float, float]] = []
        """(step, max drift, element-weighted mean drift) of every measured reconciliation."""
        self.promoted: list[str] = []
        """Tensors promoted to SYNC, in promotion order (sticky)."""

    # ------------------------------------------------------------------ measuring

    def measure_segments(self, segs: list[tuple[str, int, int]], before: torch.Tensor, after: torch.Tensor,
                         wire, step: int) -> dict[str, float]:
        """Agreed relative drift per LOCAL parameter of one reconciliation; logs a summary.

        ``segs``: (parameter name, offset, numel) of the flat vectors' parameter values; a name may
        have several segments, and on a partitioned optimizer each rank holds only part of a tensor
        (the sums over ranks are then over the whole tensor, the ratio is unchanged). ``before`` is
        this rank's values before averaging (its group's replica), ``after`` the cross-group average.
        Phases: 1. per name, the local ``||before - after||^2`` and ``||after||^2`` in fp64;
        2. one SUM all-reduce of both vectors over the data-parallel group (``wire.agree``); 3. ratio.
        Collective over the DP group: every rank must call it at the same reconciliation, with the
        same names (ranks holding no part of a tensor contribute zeros).
        """
        names = sorted({n for n, _, _ in segs})
        if not names:
            return {}
        pos = {n: i for i, n in enumerate(names)}
        dev = torch.zeros(2 * len(names), dtype=torch.float64, device=before.device)
        for name, off, n in segs:
            b = before[off:off + n].double()
            a = after[off:off + n].double()
            dev[pos[name]] += (b - a).pow(2).sum()
            dev[len(names) + pos[name]] += a.pow(2).sum()
        agreed = wire.agree(dev, "sum").cpu().tolist()
        drift = {}
        for i, name in enumerate(names):
            ref = agreed[len(names) + i]
            drift[name] = math.sqrt(agreed[i]) / math.sqrt(ref) if ref > 0 else (0.0 if agreed[i] == 0 else math.inf)
        self.last = drift
        self.last_step = step
        weights: dict[str, int] = {}
        for name, _, n in segs:
            weights[name] = weights.get(name, 0) + n
        total = sum(weights.values())
        mx = max(drift.values())
        mean = sum(drift[n] * weights[n] for n in drift) / total if total else 0.0
        self.history.append((step, mx, mean))
        worst = max(drift, key=lambda n: (drift[n], n))
        log.info("topo_align: step %d: LOCAL drift at reconciliation: max %.3e (%s), mean %.3e over %d tensors",
                 step, mx, worst, mean, len(drift))
        return drift

    # ------------------------------------------------------------------ promotion

    def promotions(self, classes: dict[str, str], numels: dict[str, int]) -> list[str]:
        """LOCAL tensors to promote now (largest latest drift first, ties by name) within the budget.

        Deterministic from agreed inputs, so every rank returns the same list. Records them as promoted.
        """
        if self.promote_fraction <= 0 or not self.last:
            return []
        budget = self.promote_fraction * self.total_numel - sum(numels[n] for n in self.promoted)
        out = []
        for name in sorted(self.last, key=lambda n: (-self.last[n], n)):
            if classes.get(name) != "LOCAL" or name in self.promoted:
                continue
            if numels[name] <= budget:
                out.append(name)
                budget -= numels[name]
        self.promoted.extend(out)
        if out:
            log.info("topo_align: promoting %d drifting LOCAL tensor(s) to SYNC: %s", len(out), ", ".join(out))
        return out

    def wants_blocking(self, classes: dict[str, str], numels: dict[str, int]) -> bool:
        """True when promotion is on and a promotion could still happen (then the next reconciliation
        must block: classes may change only when every replica is identical)."""
        if self.promote_fraction <= 0:
            return False
        budget = self.promote_fraction * self.total_numel - sum(numels[n] for n in self.promoted)
        return any(c == "LOCAL" and numels[n] <= budget for n, c in classes.items() if n not in self.promoted)

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
            "promote_fraction": self.promote_fraction,
        }

    def state_dict(self) -> dict:
        return {"last": dict(self.last), "last_step": self.last_step, "history": [list(h) for h in self.history],
                "promoted": list(self.promoted)}

    def load_state_dict(self, sd: dict | None) -> None:
        if not sd:
            return
        self.last = {str(k): float(v) for k, v in sd.get("last", {}).items()}
        self.last_step = sd.get("last_step")
        self.history = [(int(s), float(m), float(a)) for s, m, a in sd.get("history", [])]
        self.promoted = [str(n) for n in sd.get("promoted", [])]
