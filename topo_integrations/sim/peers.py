"""The peers' algorithms (what other systems run instead of the plugin), priced with model.py's
primitives like algorithms.py's: post-local SGD, DiLoCo and PowerSGD. `simulate` prices them only
when asked for (``localsgd``, ``diloco``, ``powersgd``). Communication only: what they cost in
model quality (they do not average the gradient exactly every step) is not priced here.
"""

from __future__ import annotations

import math

import numpy as np

from .algorithms import ALGORITHMS, CommCost, Stream, split_groups
from .model import Fabric, SimError, ring_phase
from .workload import DEFAULT_VOCAB

__all__ = ["local_sgd", "diloco", "powersgd", "gpt_matrices", "powersgd_elements", "MIN_COMPRESSION_RATE"]

MIN_COMPRESSION_RATE = 2
"""PyTorch's ``PowerSGDState.min_compression_rate`` default: a matrix is compressed only when its
(rows + cols) x rank elements are less than half of rows x cols."""


def _positive_int(v, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SimError(f"{what} = {v!r}; expected an integer >= 1")


def local_sgd(fab: Fabric, groups: np.ndarray, elements: float, grad_bytes: float, param_bytes: float,
              period: int, group_by: str = "island") -> CommCost:
    """Post-local SGD (PyTorch's post_localSGD_hook + a one-level HierarchicalModelAverager), after
    its warm-up:
      1. every step, a ring all-reduce of the gradient inside each intra group (the DDP subgroup);
      2. every ``period`` steps, a ring all-reduce of the parameters over the whole data-parallel
         group, blocking (the averager runs after the optimizer step), charged 1/period per step.
    """
    if not (isinstance(period, int) and period >= 1):
        raise SimError(f"post-local SGD period = {period!r}; expected an integer >= 1")
    intra, _ = split_groups(fab, groups, group_by)
    stream = Stream("grad", 1.0, [ring_phase(fab, intra, elements * grad_bytes, "allreduce", "intra all-reduce")],
                    True)
    avg = ring_phase(fab, groups, elements * param_bytes, "allreduce", "parameter all-reduce").scaled(1.0 / period)
    avg.latency_s /= period
    return CommCost("localsgd", ALGORITHMS["localsgd"], [stream], [avg], background_blocking=True)


def diloco(fab: Fabric, groups: np.ndarray, elements: float, grad_bytes: float, period: int,
           group_by: str = "island", outer_bytes: float = 4.0) -> CommCost:
    """DiLoCo as torchft's users run it (``torchft.local_sgd.DiLoCo``, non-streaming), one replica
    group per island:
      1. every step, a ring all-reduce of the gradient inside each island (the replica group's own
         data parallelism), in the gradient dtype;
      2. every ``period`` (H) steps, the pseudo-gradient (the parameters' change since the last sync)
         of the whole model in fp32 (``outer_bytes``) all-reduced across the replica groups: each
         rank with the rank of the same position in every other island, a ring over its rail, the
         full model size per rank (2(R-1)/R * elements * outer_bytes for R islands); blocking
         (training waits for the sync), charged 1/H per step, its latency too;
      3. the outer Nesterov step on the averaged pseudo-gradient: local, free.
    """
    _positive_int(period, "DiLoCo period")
    intra, rails = split_groups(fab, groups, group_by)
    stream = Stream("grad", 1.0, [ring_phase(fab, intra, elements * grad_bytes, "allreduce", "intra all-reduce")],
                    True)
    outer = ring_phase(fab, rails, elements * outer_bytes, "allreduce", "pseudo-gradient rail all-reduce")
    outer = outer.scaled(1.0 / period)
    outer.latency_s /= period
    return CommCost("diloco", ALGORITHMS["diloco"], [stream], [outer], background_blocking=True)


def gpt_matrices(params: float, num_layers: int, vocab: int = DEFAULT_VOCAB) -> tuple[list[tuple[float, float, int]],
                                                                                       float]:
    """An assumed GPT's gradient shapes: ``([(rows, cols, count), ...], vector elements)``.

    The hidden size h solves params = 12 L h^2 + (vocab + 13 L + 2) h (real-valued, so the shapes
    add up to ``params``): per layer the weight matrices QKV 3h x h, projection h x h, fc1 4h x h and
    fc2 h x 4h (12 h^2), the biases and two layer norms (13 h); the embedding vocab x h (tied with the
    output layer) and the final layer norm (2 h). An assumption: the workload knows only the
    parameter and layer counts.
    """
    _positive_int(num_layers, "num_layers")
    n_l = num_layers
    lin = vocab + 13 * n_l + 2
    h = (-lin + math.sqrt(lin * lin + 48.0 * n_l * params)) / (24.0 * n_l)
    mats = [(3 * h, h, n_l), (h, h, n_l), (4 * h, h, n_l), (h, 4 * h, n_l), (float(vocab), h, 1)]
    return mats, (13 * n_l + 2) * h


def powersgd_elements(params: float, num_layers: int | None, rank: int) -> tuple[float, float, float]:
    """(P, Q, uncompressed) elements per step of PyTorch's PowerSGD hook over :func:`gpt_matrices`:
    each matrix of n x m is sent as P (n x r) and Q (m x r), r = min(n, m, rank), when
    (n + m) r x :data:`MIN_COMPRESSION_RATE` < n m, else whole with the vectors."""
    if num_layers is None:
        raise SimError("PowerSGD needs the layer count to shape the gradient's matrices: give --num-layers "
                       "(or --megatron-args; Python: Workload(num_layers=...))")
    _positive_int(rank, "PowerSGD rank")
    mats, rest = gpt_matrices(params, num_layers)
    p = q = 0.0
    for n, m, count in mats:
        r = min(n, m, rank)
        if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            p += count * n * r
            q += count * m * r
        else:
            rest += count * n * m
    return p, q, rest


def powersgd(fab: Fabric, groups: np.ndarray, elements: float, params: float, num_layers: int | None, rank: int,
             wire_bytes: float = 4.0) -> CommCost:
    """PyTorch's PowerSGD DDP comm hook (``powerSGD_hook``) at rank ``rank``, after its warm-up
    (``start_powerSGD_iter``), over the whole data-parallel group, per bucket and step:
      1. the uncompressed tensors (vectors, and matrices too small to gain) in one flat ring
         all-reduce;
      2. then P = M Q of every compressed matrix (n x r) in a second ring all-reduce;
      3. then, after orthogonalising P, Q = M^T P (m x r) in a third.
    The hook chains the three (each waits for the one before), so they are priced back-to-back per
    bucket (DDP's buckets, cut from the uncompressed gradient). Wire: ``wire_bytes`` per element (the
    bucket's dtype: fp32, the gradient of fp32 parameters under AMP).

    Assumptions: the gradient's shapes are :func:`gpt_matrices`' (whole model, P, Q and vector
    elements shared evenly by TP x PP: ``elements / params`` of each). Not priced: PowerSGD's own
    compute (the matmuls and the QR orthogonalisation), error feedback's memory, and its quality
    (a rank-r approximation of the gradient, corrected over steps by error feedback).
    """
    p, q, rest = powersgd_elements(params, num_layers, rank)
    share = elements / params
    phases = [
        ring_phase(fab, groups, rest * share * wire_bytes, "allreduce", "uncompressed all-reduce"),
        ring_phase(fab, groups, p * share * wire_bytes, "allreduce", "P all-reduce"),
        ring_phase(fab, groups, q * share * wire_bytes, "allreduce", "Q all-reduce"),
    ]
    return CommCost("powersgd", ALGORITHMS["powersgd"], [Stream("grad", 1.0, phases, False)])
