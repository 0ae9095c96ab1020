"""`method: auto`: which method a cluster should run, predicted with the cost model (docs/costmodel.md,
section 6).

Three candidates, each a setting of mode `selective` (so the engine switches between them without
changing mode):

* ``hierarchical``: every tensor SYNC on an fp32 wire across groups (``sync.top_fraction`` 1,
  ``sync.dtype`` fp32), which equals mode `hierarchical` (invariant 3): the exact mean;
* ``int8``: every tensor SYNC on the int8 wire (``sync.dtype`` int8), a quarter of fp32's slow-tier
  bytes and flat's quality at 2, 4 and 8 islands (docs/convergence.md, "Many islands");
* ``local``: a LOCAL class reconciled DiLoCo-style, lean: the last :data:`LOCAL_LAST_N_LAYERS`
  layer(s), `always_sync` and the top :data:`LOCAL_TOP_FRACTION` by importance SYNC on the
  :data:`LOCAL_SYNC_DTYPE` wire, no drift promotion, the rest reduced in the island and averaged
  across islands every H steps (``local.reconcile_interval``), in :func:`stream_fragments` fragments
  (streamed from :data:`STREAM_FROM_H` on).

Each is priced by :func:`~topo_integrations.sim.scenario.simulate` (algorithm ``selective``: its
SYNC stream is the back-to-back 2-level all-reduce, its reconciliation the rail all-reduce and
group all-gather, buckets overlapped with backward), so the choice and ``topo-align simulate``
price the links alike (the engine adds the int8 codec time it timed, :attr:`MethodInputs.codec_s`).
A lossy candidate needs more steps to reach flat's quality: :func:`~topo_integrations.sim.quality.steps_factor`,
from its gap to flat measured at 2, 4 and 8 islands (sim/quality.py). The rule (constants below,
each stated in docs/costmodel.md), on the predicted *time to flat quality* = step x that factor:

1. ``hierarchical`` (the exact mean, factor 1) when its predicted step is within :data:`HIDDEN` of
   compute (its slow-tier time hides behind backward) or its time within :data:`TIE` of the best;
2. else the shorter time of ``int8`` (its step with the wire's own quantisation work,
   :attr:`MethodInputs.codec_s`) and ``local`` (``int8`` on a tie within :data:`TIE`: it keeps one
   replica), where ``local``'s H is the power of two up to :data:`H_CAP` with the shortest time
   (of H priced alike, the longest: fewer bytes for the same time; sim/quality.py prices an H below
   the shortest measured as that one).

The runner-up is the fastest of the other two by predicted time. Pure (no communication): the
engine's rank 0 calls :func:`choose_for_groups` and broadcasts the result (reducer/adaptive/method.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..topology.model import RankPlace, Tier, Topology
from .algorithms import split_groups
from .model import Fabric, SimError, apply_rank_order
from .quality import steps_factor
from .report import fmt_bytes
from .scenario import SimOptions, simulate
from .workload import Workload, dp_groups

__all__ = ["CANDIDATES", "HIDDEN", "TIE", "H_CAP", "LOCAL_TOP_FRACTION", "LOCAL_SYNC_DTYPE", "LOCAL_LAST_N_LAYERS",
           "LOCAL_PROMOTE", "STREAM_FROM_H", "STREAM_FRAGMENTS", "stream_fragments", "local_options",
           "MethodInputs", "MethodChoice", "choose", "choose_for_groups", "choose_for_cli", "method_config",
           "figures_of"]

CANDIDATES: tuple[str, ...] = ("hierarchical", "int8", "local")
"""In order of preference on a tie: the exact mean first, the LOCAL class last."""
HIDDEN = 0.02
"""A predicted step within 2 % of compute counts as hidden (and a reconciliation within 2 % of the
step without it, for the log line's "H capped")."""
TIE = 0.01
"""Times to flat quality within 1 % tie: the earlier candidate of :data:`CANDIDATES` wins."""
H_CAP = 64
"""The longest reconciliation interval the choice takes (DiLoCo's H ranges up to a few hundred; this
repository measured up to 64: docs/convergence.md); the log line says when the best H is the cap."""
H_STEPS: tuple[int, ...] = tuple(2 ** i for i in range(int(math.log2(H_CAP)) + 1))
LOCAL_TOP_FRACTION = 0.05
"""SYNC share by importance of the LOCAL candidate (with the last layer: 13 % of the bench's deep GPT,
20 % of the 8-layer GPT; about the share of the last 5 of 96 layers)."""
LOCAL_SYNC_DTYPE = "int8"
"""SYNC wire of the LOCAL candidate (what its quality, sim/quality.py, was measured with)."""
LOCAL_LAST_N_LAYERS = 1
"""Layers at the end of the model SYNC in the LOCAL candidate (`sync.last_n_layers`, unless the user set it)."""
LOCAL_PROMOTE = 0.0
"""Drift-promotion budget of the LOCAL candidate (`local.promote_drift_fraction`, unless the user set
it): none, so that its SYNC class, and its bytes, stay what was priced."""
STREAM_FROM_H = 64
"""From this H on the LOCAL candidate streams its reconciliation in :data:`STREAM_FRAGMENTS`
fragments (``local.stream_fragments``); below it, all at once. 3 seeds at 2 and 4 islands
(docs/convergence.md, "The LOCAL class of `method: auto` at long H"): at H = 64 4 fragments ended
closer to flat than one reconciliation (by a quarter of a point at 2 islands, to flat's level at 4),
at H = 16 a few tenths further."""
STREAM_FRAGMENTS = 4
_NO_RECONCILE = 1 << 30


def stream_fragments(reconcile_interval: int) -> int:
    """``local.stream_fragments`` of the LOCAL candidate at H = ``reconcile_interval``."""
    return STREAM_FRAGMENTS if reconcile_interval >= STREAM_FROM_H else 1


def method_config(method: str, reconcile_interval: int | None = None) -> dict:
    """The ``topo_align`` keys a candidate sets (dotted), all in mode `selective`."""
    keys = {
        "hierarchical": {"sync.dtype": "fp32", "sync.top_fraction": 1.0},
        "int8": {"sync.dtype": "int8", "sync.top_fraction": 1.0},
        "local": {"sync.dtype": LOCAL_SYNC_DTYPE, "sync.top_fraction": LOCAL_TOP_FRACTION,
                  "sync.last_n_layers": LOCAL_LAST_N_LAYERS, "local.promote_drift_fraction": LOCAL_PROMOTE,
                  "local.reconcile_interval": int(reconcile_interval or H_CAP),
                  "local.stream_fragments": stream_fragments(int(reconcile_interval or H_CAP))},
    }
    if method not in keys:
        raise ValueError(f"method {method!r}; expected one of {list(CANDIDATES)}")
    return {"mode": "selective", **keys[method]}


@dataclass(frozen=True)
class MethodInputs:
    """The figures a choice is made on (the log line repeats them)."""

    n_groups: int
    group_size: int
    slow_gbps: float
    """Bandwidth of the slow tier (the rail between groups), GB/s per GPU."""
    slow_latency_us: float
    slow_origin: str
    """Where ``slow_gbps`` came from (`Tier.origin`: measured, nic-rate, file, default ...)."""
    grad_elements: float
    """Data-parallel gradient elements per GPU."""
    grad_dtype: str
    compute_s: float
    """Forward + backward seconds per step."""
    compute_from: str
    """Where ``compute_s`` came from (e.g. ``timed over steps 2-5``)."""
    fast_gbps: float = 230.0
    fast_latency_us: float = 2.0
    options: SimOptions = field(default_factory=SimOptions)
    """The rest of the model's inputs (bucket size, overlap, last-N share, local.* wires)."""
    local_only: bool = False
    """LOCAL-class keys were set by the user: they mean a LOCAL class (docs/costmodel.md, section 6), so
    only the H of the ``local`` candidate is chosen."""
    codec_s: float = 0.0
    """Seconds per step the int8 wire's own work takes on the rank (quantise and decode its share of
    the slow tier's payload, twice: the all-to-all and the all-gather of lossy_wire.py), added to the
    ``int8`` candidate's step: the cost model's links do not carry it. Timed by the engine on its
    device (on a CPU rank it runs on the cores the compute runs on; on a GPU it is small); 0 where
    nothing timed it (``topo-align simulate``)."""
    local_options: SimOptions | None = None
    """The LOCAL candidate's knobs where the engine knows them exactly (its fixed SYNC share under the
    candidate's keys and the user's); None: :func:`local_options` of ``options``."""

    @property
    def grad_bytes(self) -> float:
        return self.grad_elements * {"fp32": 4, "bf16": 2, "fp16": 2}[self.grad_dtype]

    def scaled(self, factor: float, origin: str) -> MethodInputs:
        """The same inputs with the slow tier ``factor`` times as fast (a re-choice)."""
        return replace(self, slow_gbps=self.slow_gbps * factor, slow_origin=origin)


@dataclass(frozen=True)
class MethodChoice:
    """The choice, the keys it sets, every candidate's predicted step and the runner-up."""

    method: str
    config: dict
    step_s: dict
    """Predicted step seconds per candidate (``local`` at the chosen H)."""
    compute_s: float
    runner_up: str | None
    reconcile_interval: int | None
    """H of the ``local`` candidate (also when it is not chosen)."""
    figures: str
    """The inputs in words (groups, slow tier, gradient, compute)."""
    h_capped: bool = False
    """The best H is :data:`H_CAP` (a longer one might be better still)."""
    steps_factor: dict = field(default_factory=dict)
    """Flat's steps x this = a candidate's steps to flat quality (sim/quality.py); 1 where absent."""

    def time_s(self, method: str) -> float:
        """Predicted seconds per flat step to flat quality: the step x its steps factor."""
        return self.step_s[method] * self.steps_factor.get(method, 1.0)

    def _priced(self, k: str) -> str:
        return f"{self.step_s[k]:.4g} s x {self.steps_factor.get(k, 1.0):.3g}"

    def line(self) -> str:
        """The one log line: the choice, the figures it used and the runner-up."""
        keys = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in self.config.items() if k != "mode")
        cand = "; ".join(f"{k} {self._priced(k)}" + (f" (H {self.reconcile_interval})" if k == "local" else "")
                         for k in CANDIDATES if k in self.step_s)
        cap = f" (H capped at {H_CAP})" if self.h_capped and self.method == "local" else ""
        ru = f"runner-up {self.runner_up} ({self._priced(self.runner_up)})" if self.runner_up else "no runner-up"
        return (f"topo_align: method auto: {self.method} ({keys}){cap}: predicted step "
                f"{self.step_s[self.method]:.4g} s against {self.compute_s:.4g} s of compute, "
                f"{self.steps_factor.get(self.method, 1.0):.3g} x flat's steps to flat quality; {ru}; "
                f"predicted step x steps: {cand}; figures: {self.figures}")

    def to_json(self) -> dict:
        return {"method": self.method, "config": dict(self.config), "step_s": dict(self.step_s),
                "steps_factor": dict(self.steps_factor), "compute_s": self.compute_s, "runner_up": self.runner_up,
                "reconcile_interval": self.reconcile_interval, "h_capped": self.h_capped,
                "figures": self.figures, "line": self.line()}


def _step(topo: Topology, wl: Workload, opt: SimOptions, **kw) -> float:
    res = simulate(topo, wl, replace(opt, algorithms=("selective",), **kw))
    try:
        return res.row("selective").step_s
    except KeyError:
        why = next((n for n in res.notes if n.startswith("selective: not applicable")), "selective not applicable")
        raise SimError(why) from None


def local_options(opt: SimOptions) -> SimOptions:
    """``opt`` with the LOCAL candidate's knobs: its last layer(s), no promotion budget. A given
    ``last_n_share`` (the user's N layers, with `always_sync`) is taken per layer: the engine, which
    knows the tensors, passes the exact share instead (:attr:`MethodInputs.local_options`)."""
    share = opt.last_n_share
    if share is not None:
        share *= LOCAL_LAST_N_LAYERS / max(1, opt.last_n_layers)
    return replace(opt, last_n_layers=LOCAL_LAST_N_LAYERS, last_n_share=share, promote_fraction=LOCAL_PROMOTE)


def choose(topo: Topology, wl: Workload, opt: SimOptions, *, figures: str, islands: int, local_only: bool = False,
           codec_s: float = 0.0, local_opt: SimOptions | None = None) -> MethodChoice:
    """Price the candidates on ``topo`` with ``wl`` and ``opt`` (its selective knobs other than the
    ones a candidate sets: buckets, overlap, local.* wires; the LOCAL candidate with ``local_opt``, else
    :func:`local_options` of ``opt``), the ``int8`` one with ``codec_s`` more
    (:attr:`MethodInputs.codec_s`), weigh each step with its steps to flat quality at ``islands``
    islands (sim/quality.py) and apply the rule of the module docstring. Raises :class:`SimError`
    where `selective` does not apply."""
    compute = wl.compute_seconds(topo.world_size)
    base = replace(opt, stream_fragments=1)  # a candidate's H may be below the user's fragments
    steps: dict[str, float] = {}
    factor: dict[str, float] = {}
    if not local_only:
        steps["hierarchical"] = _step(topo, wl, base, top_fraction=1.0, sync_dtype="fp32")
        steps["int8"] = _step(topo, wl, base, top_fraction=1.0, sync_dtype="int8") + codec_s
        factor["hierarchical"], factor["int8"] = 1.0, steps_factor("int8", islands)
    lo = replace(local_opt or local_options(opt), stream_fragments=1, top_fraction=LOCAL_TOP_FRACTION,
                 sync_dtype=LOCAL_SYNC_DTYPE)
    unbounded = _step(topo, wl, lo, reconcile_interval=_NO_RECONCILE)
    by_h = {}
    for h in H_STEPS:
        t = _step(topo, wl, lo, reconcile_interval=h, stream_fragments=stream_fragments(h))
        by_h[h] = (t, steps_factor("local", islands, h))
    # The shortest time; of H the model prices alike (the quality below 16, the shortest measured; a
    # reconciliation hidden either way) the longest: fewer bytes for the same predicted time.
    best = min(t * q for t, q in by_h.values())
    h = max(k for k in H_STEPS if by_h[k][0] * by_h[k][1] <= best * (1 + 1e-9))
    steps["local"], factor["local"] = by_h[h]
    capped = h == H_CAP and by_h[h][0] > unbounded * (1 + HIDDEN)
    time = {k: steps[k] * factor[k] for k in steps}
    if local_only:
        pick = "local"
    else:
        fastest = min(time.values())
        if steps["hierarchical"] <= compute * (1 + HIDDEN) or time["hierarchical"] <= fastest * (1 + TIE):
            pick = "hierarchical"
        else:
            pick = "int8" if time["int8"] <= time["local"] * (1 + TIE) else "local"
    others = [k for k in CANDIDATES if k in steps and k != pick]
    runner = min(others, key=lambda k: (time[k], CANDIDATES.index(k))) if others else None
    return MethodChoice(pick, method_config(pick, h), steps, compute, runner, h, figures, h_capped=capped,
                        steps_factor=factor)


def _two_tier_topology(inp: MethodInputs) -> Topology:
    """``n_groups`` hosts of ``group_size`` ranks, one island each, under one leaf: the island tier at
    the fast figures, the leaf tier (and the unused spine) at the slow tier's."""
    places = tuple(RankPlace(g * inp.group_size + i, f"g{g}", i, f"g{g}", "leaf0")
                   for g in range(inp.n_groups) for i in range(inp.group_size))
    fast = (inp.fast_gbps, inp.fast_latency_us)
    slow = (inp.slow_gbps, inp.slow_latency_us)
    tiers = {"island": Tier("island", *fast), "host": Tier("host", *fast), "leaf": Tier("leaf", *slow),
             "spine": Tier("spine", *slow)}
    return Topology(places, tiers, name=f"{inp.n_groups} groups of {inp.group_size}", source="method auto")


def figures_of(inp: MethodInputs) -> str:
    ranks = f"{inp.group_size} rank{'s' if inp.group_size != 1 else ''}"
    codec = f"; int8 codec {inp.codec_s:.4g} s per step (timed)" if inp.codec_s > 0 else ""
    return (f"{inp.n_groups} groups of {ranks}; slow tier {inp.slow_gbps:.4g} GB/s per GPU "
            f"({inp.slow_origin}), {inp.slow_latency_us:g} us; gradient {fmt_bytes(inp.grad_bytes)} per GPU "
            f"({inp.grad_elements:.4g} x {inp.grad_dtype}); compute {inp.compute_s:.4g} s per step "
            f"({inp.compute_from}){codec}")


def choose_for_groups(inp: MethodInputs) -> MethodChoice:
    """The choice for ``n_groups`` groups of ``group_size`` ranks joined by the slow tier (the engine's
    view of its plan): priced on the two-tier topology of those figures."""
    if inp.n_groups < 2:
        raise SimError(f"method auto needs two groups or more (got {inp.n_groups})")
    for what in ("slow_gbps", "fast_gbps", "grad_elements"):
        v = getattr(inp, what)
        if not (math.isfinite(v) and v > 0):
            raise SimError(f"method auto: {what} = {v!r}; expected a positive number")
    for what in ("compute_s", "codec_s"):
        v = getattr(inp, what)
        if not (math.isfinite(v) and v >= 0):
            raise SimError(f"method auto: {what} = {v!r}; expected a number >= 0")
    wl = Workload(params=float(inp.grad_elements), grad_dtype=inp.grad_dtype, compute_s=float(inp.compute_s))
    opt = replace(inp.options, rank_order="file", group_by="island")
    lo = None if inp.local_options is None else replace(inp.local_options, rank_order="file", group_by="island")
    return choose(_two_tier_topology(inp), wl, opt, figures=figures_of(inp), islands=inp.n_groups,
                  local_only=inp.local_only, codec_s=inp.codec_s, local_opt=lo)


def choose_for_cli(topo: Topology, wl: Workload, opt: SimOptions) -> MethodChoice:
    """The choice ``topo-align simulate`` prints: the candidates priced on the whole topology and
    workload (TP x PP layout, rank order, the user's selective knobs); the figures name the groups
    of one data-parallel group and the plan's slow tier. Raises :class:`SimError` where `selective`
    does not apply (e.g. unequal groups)."""
    from ..topology.planner import plan_groups

    world = topo.world_size
    fab = Fabric.from_topology(apply_rank_order(topo, opt.rank_order, seed=opt.seed))
    intra, rails = split_groups(fab, dp_groups(world, wl.tp, wl.pp), opt.group_by)
    plan = plan_groups(topo, group_by=opt.group_by, mode="selective")
    slow = topo.tiers[plan.inter_tier]
    fast = topo.tiers[plan.intra_tier]
    if wl.compute_s is not None:
        src = "--compute-s"
    else:
        src = "6 x params x tokens / (GPUs x MFU x peak)" + (" with defaults" if wl.assumed else "")
    inp = MethodInputs(int(rails.shape[1]), int(intra.shape[1]), slow.effective_gbps, slow.latency_us,
                       f"{plan.inter_tier}, {slow.origin}", wl.grad_elements, wl.grad_dtype, wl.compute_seconds(world),
                       src, fast.effective_gbps, fast.latency_us)
    return choose(topo, wl, opt, figures=figures_of(inp), islands=inp.n_groups)
