"""Per-engine state of the adapter: config, groups, wire, classes, importance, counters.

Attached to the engine as ``engine.topo_align`` (and to its ZeRO optimizer as ``optimizer.topo_align``);
saved with every checkpoint (one file per rank, because error-feedback residuals differ per rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .classes import classify
from .wire import DTYPES, Wire

__all__ = ["TopoAlignState"]

log = logging.getLogger("topo_align")

STATE_VERSION = 1


@dataclass
class TopoAlignState:
    cfg: Any
    """The validated `TopoAlignConfig`."""
    groups: Any
    """The reducer's `ReducerGroups` for this rank."""
    stage: int
    wire: Wire
    mode: str
    """'hierarchical' or 'selective' (flat never gets here: the engine stays stock)."""
    names: list[str] = field(default_factory=list)
    """Trainable parameter names, registration order."""
    numels: dict[str, int] = field(default_factory=dict)
    sync: dict[str, bool] = field(default_factory=dict)
    """Name -> SYNC (True) / LOCAL (False); all True in `hierarchical`."""
    scores: dict[str, float] = field(default_factory=dict)
    """Per-tensor importance EMA (this rank's view; agreed across ranks at each refresh)."""
    steps: int = 0
    """Optimizer steps seen (boundaries, including overflow-skipped ones)."""
    last_reconcile: int = 0
    last_refresh: int = 0
    reconciles: int = 0
    last_clip_norm: float | None = None
    last_overflow: bool = False
    last_local_overflow: bool = False
    engine_reduces: bool = False
    """Gradients are reduced by the engine's buffered all-reduce (ZeRO-0, or ZeRO-1 with DeepSpeed's
    BF16_Optimizer) rather than by a ZeRO optimizer."""
    class_version: int = 0
    """Bumped whenever classes change (the ZeRO-1/2 route recomputes its partition slices)."""

    @classmethod
    def create(cls, cfg, groups, stage: int, module: torch.nn.Module) -> "TopoAlignState":
        c = cfg.communication
        inter = cfg.sync.dtype if cfg.mode == "selective" else c.inter_dtype
        wire = Wire(groups, inter_dtype=inter, error_feedback=c.error_feedback)
        st = cls(cfg=cfg, groups=groups, stage=stage, wire=wire, mode=cfg.mode)
        # ZeRO-3 partitions parameters in place (p.numel() is then 0): ds_numel is the full size.
        named = [(n, int(getattr(p, "ds_numel", p.numel()))) for n, p in module.named_parameters() if p.requires_grad]
        st.names = [n for n, _ in named]
        st.numels = dict(named)
        if cfg.mode == "selective":
            st.sync = classify(named, cfg.sync, None, model=module)
        else:
            st.sync = {n: True for n in st.names}
        return st

    @property
    def local_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.local.dtype]

    @property
    def selective(self) -> bool:
        return self.mode == "selective"

    def sync_fraction(self) -> float:
        total = sum(self.numels.values()) or 1
        return sum(self.numels[n] for n in self.names if self.sync[n]) / total

    # -- importance ------------------------------------------------------------------------------

    def observe(self, name: str, sq_norm: float) -> None:
        """Fold one tensor's squared gradient norm (per element) into its importance EMA."""
        if self.cfg.importance.method != "fisher":
            return
        d = self.cfg.importance.ema_decay
        v = sq_norm / max(1, self.numels.get(name, 1))
        old = self.scores.get(name)
        self.scores[name] = v if old is None else d * old + (1 - d) * v

    def refresh_due(self) -> bool:
        return self.selective and self.steps - self.last_refresh >= self.cfg.importance.refresh_interval

    def refresh_classes(self, module: torch.nn.Module) -> bool:
        """Re-rank on agreed scores (one all-reduce over the DP group); True when classes changed.

        Called only right after a reconciliation, when every replica is identical, so a tensor
        moving between classes never carries a group-specific value into SYNC.
        """
        self.last_refresh = self.steps
        if self.cfg.importance.method == "magnitude":
            params = dict(module.named_parameters())
            local = [float(params[n].detach().float().pow(2).sum()) / max(1, self.numels[n]) for n in self.names]
        else:
            local = [self.scores.get(n, 0.0) for n in self.names]
        t = torch.tensor(local, dtype=torch.float64)
        self.wire.agree_(t, "sum")
        t /= self.groups.dp_size
        agreed = {n: float(v) for n, v in zip(self.names, t.tolist())}
        new = classify([(n, self.numels[n]) for n in self.names], self.cfg.sync, agreed, model=module)
        changed = new != self.sync
        if changed:
            self.sync = new
            self.class_version += 1
            log.info("topo_align: classes refreshed at step %d: SYNC is %.1f%% of gradient elements",
                     self.steps, 100 * self.sync_fraction())
        return changed

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "mode": self.mode,
            "steps": self.steps,
            "last_reconcile": self.last_reconcile,
            "last_refresh": self.last_refresh,
            "reconciles": self.reconciles,
            "sync": dict(self.sync),
            "scores": dict(self.scores),
            "class_version": self.class_version,
            "residuals": self.wire.residual_state(),
            "plan": self.groups.plan.dumps(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"topo_align checkpoint state version {sd.get('version')!r}; expected {STATE_VERSION}")
        if sd.get("mode") != self.mode:
            raise ValueError(f"topo_align checkpoint was saved with mode {sd.get('mode')!r}; this engine runs "
                             f"{self.mode!r}; load it with the same topo_align.mode")
        if set(sd["sync"]) != set(self.names):
            raise ValueError("topo_align checkpoint lists different parameter names than this model")
        self.steps = sd["steps"]
        self.last_reconcile = sd["last_reconcile"]
        self.last_refresh = sd["last_refresh"]
        self.reconciles = sd["reconciles"]
        if sd["sync"] != self.sync:
            self.sync = dict(sd["sync"])
        self.class_version = sd["class_version"] + 1
        self.scores = dict(sd["scores"])
        self.wire.load_residual_state(sd["residuals"])
