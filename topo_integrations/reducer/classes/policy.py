"""The class policy of `selective`: which tensors are SYNC and which LOCAL, and why.

Owns the tensors the adapter reduces (names, sizes, layer indices, parameters), the importance
scores (fisher EMA fed by :meth:`ClassPolicy.observe`, magnitude, hutchinson from a loss closure),
the drift monitor's promotions, the current classes and the step of their latest refresh
(the engine's part ``engine.policy``). Everything here is local arithmetic: the
one collective it needs (agreeing the scores over the data-parallel group) is the engine's, which
passes the local scores to its dispatcher and the agreed ones back (:meth:`ClassPolicy.local_scores`,
:meth:`ClassPolicy.classify`), so every rank computes the same classes.
"""

from __future__ import annotations

import torch

from ...config import ConfigError, TopoAlignConfig
from ..kinds import Method
from .adapter_spec import EngineTensors
from .classes import LOCAL, SYNC, classify
from .drift import DriftMonitor
from .importance import Importance

__all__ = ["ClassPolicy"]


class ClassPolicy:
    """Classes of the engine's tensors (all SYNC outside `selective`)."""

    def __init__(self, cfg: TopoAlignConfig, tensors: EngineTensors, *, device, selective: bool):
        self.cfg = cfg
        self.names = list(tensors.names)
        self.numels = dict(zip(self.names, (int(k) for k in tensors.numels)))
        self.layers = tensors.layers
        self.num_layers = tensors.num_layers
        self.params = tensors.params or {}
        self.forced_sync = set(tensors.forced_sync)
        self.loss_closure = tensors.loss_closure
        self.importance = Importance(cfg.importance.method, cfg.importance.ema_decay, self.names, device=device)
        self.drift = DriftMonitor(cfg.local.promote_drift_fraction, sum(self.numels.values()),
                                  window=cfg.local.promote_window, demote=cfg.local.demote)
        self.class_version = 0
        self.classes = self._initial(selective)
        self.last_refresh = 0
        """The optimizer step of the latest class refresh (the next is due ``importance.refresh_interval``
        steps later)."""

    def set_config(self, cfg: TopoAlignConfig) -> list[str]:
        """Classify under ``cfg`` from now on (`method: auto` puts the engine on a candidate's keys):
        its ``sync.*`` at the next :meth:`classify`, its promotion budget, window and demotion in the
        drift monitor (built with the configured ones). Returns the promotions beyond the new budget,
        turned LOCAL again."""
        self.cfg = cfg
        loc = cfg.local
        return self.drift.configure(loc.promote_drift_fraction, window=loc.promote_window, demote=loc.demote,
                                    numels=self.numels)

    def refresh_due(self, step: int) -> bool:
        """Whether a class refresh is due at optimizer step ``step``."""
        return step - self.last_refresh >= self.cfg.importance.refresh_interval

    # ------------------------------------------------------------------ the classes

    def classify(self, scores: list[float] | None) -> dict[str, str]:
        """Classes for (agreed) per-tensor scores: last N layers, always_sync, top fraction, promotions."""
        c = self.cfg.sync
        out = classify(self.names, [self.numels[n] for n in self.names], last_n_layers=c.last_n_layers,
                       always_sync=list(c.always_sync), top_fraction=c.top_fraction,
                       scores=scores, layers=self.layers, num_layers=self.num_layers, exact_names=self.forced_sync)
        return self.drift.apply(out)

    def fixed_sync_fraction(self, sync=None) -> float:
        """Share of elements SYNC whatever the importance: the last N layers, `always_sync`, forced names
        (under ``sync``, a `SyncConfig`, where given: `method: auto` prices a candidate's)."""
        c = sync or self.cfg.sync
        out = classify(self.names, [self.numels[n] for n in self.names], last_n_layers=c.last_n_layers,
                       always_sync=list(c.always_sync), top_fraction=0.0, scores=None, layers=self.layers,
                       num_layers=self.num_layers, exact_names=self.forced_sync)
        total = sum(self.numels.values()) or 1
        return sum(self.numels[n] for n, k in out.items() if k == SYNC) / total

    def _initial(self, selective: bool) -> dict[str, str]:
        if not selective:
            return {n: SYNC for n in self.names}
        # Parameters are equal on every rank at start, so magnitude ranks identically without a collective.
        scores = None
        if self.params and all(n in self.params for n in self.names):
            scores = Importance.magnitude([self.params[n] for n in self.names]).cpu().tolist()
        return self.classify(scores)

    def set_classes(self, classes: dict[str, str]) -> bool:
        """Adopt ``classes`` (every name); True when they differ from the current ones."""
        if classes == self.classes:
            return False
        if set(classes) != set(self.names):
            raise ValueError("topo_align: reconfigure(classes=...) must name every parameter of the engine")
        self.classes = dict(classes)
        self.class_version += 1
        return True

    def is_sync(self, name: str) -> bool:
        return self.classes[name] == SYNC

    def local_names(self) -> list[str]:
        return [n for n in self.names if self.classes[n] == LOCAL]

    def has_local(self) -> bool:
        return any(c == LOCAL for c in self.classes.values())

    def sync_fraction(self) -> float:
        total = sum(self.numels.values()) or 1
        return sum(self.numels[n] for n in self.names if self.classes[n] == SYNC) / total

    def counts(self) -> tuple[int, int]:
        """(SYNC tensors, LOCAL tensors)."""
        n_sync = sum(c == SYNC for c in self.classes.values())
        return n_sync, len(self.classes) - n_sync

    # ------------------------------------------------------------------ importance

    def tracks_fisher(self, selective: bool) -> bool:
        """Whether :meth:`observe` is worth calling (fisher scores that can change the classes)."""
        t = self.cfg.sync.top_fraction
        return selective and self.cfg.importance.method == Method.FISHER and 0.0 < t < 1.0

    def observe(self, names: list[str], sq_sums: torch.Tensor) -> None:
        """Fisher: fold this step's squared gradient sums of ``names`` into the per-element EMA."""
        self.importance.observe(names, sq_sums.to(self.importance.ema.device), [self.numels[n] for n in names])

    def local_scores(self, step: int) -> torch.Tensor:
        """This rank's scores (fp64, one per name), before the engine agrees them."""
        m = self.cfg.importance.method
        if m == Method.FISHER:
            return self.importance.ema.clone().double()
        if m == Method.MAGNITUDE:
            return Importance.magnitude([self.params[n] for n in self.names]).double()
        if self.loss_closure is None:
            raise ConfigError(
                "topo_align: importance.method = 'hutchinson' needs a loss closure at the class refresh "
                f"(step {step}): the adapter captures the model's own loss when its forward returns "
                "one; otherwise call set_loss_closure(fn) (or use 'fisher' / 'magnitude')")
        return Importance.hutchinson([self.params[n] for n in self.names], self.loss_closure,
                                     seed=self.importance.next_seed()).double()
