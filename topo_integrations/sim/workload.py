"""The training workload: model size, gradient dtype, TP x PP x DP layout and compute per step.

Inputs come from flags, a DeepSpeed config (its "topo_align" block, precision, batch size) or a
Megatron argument file (``.args``: the command line's flags; ``.json``: ``{"num-layers": 96, ...}``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..config import ConfigError, TopoAlignConfig, load_json_file
from .compute import DEFAULT_SEQ_LENGTH
from .model import DTYPE_BYTES, GRADIENT_DTYPES, SimError

__all__ = ["Workload", "dp_groups", "megatron_param_count", "workload_from_megatron_args",
           "workload_from_deepspeed_config", "read_megatron_args"]

# Megatron's GPT vocabulary (50257) padded to a multiple of 128 * TP; the model uses 51200.
DEFAULT_VOCAB = 51200


@dataclass(frozen=True)
class Workload:
    params: float
    """Model parameters (all of them, before TP/PP sharding)."""
    grad_dtype: str = "bf16"
    tp: int = 1
    pp: int = 1
    compute_s: float | None = None
    """Forward + backward time per step; or derived from the three fields below (defaults for them:
    sim/compute.py, :func:`~topo_integrations.sim.compute.with_compute_defaults`)."""
    mfu: float | None = None
    peak_tflops: float | None = None
    tokens_per_step: float | None = None
    num_layers: int | None = None
    backward_share: float = 2.0 / 3.0
    """Share of compute that is backward (backward costs twice the forward)."""
    topo_align: TopoAlignConfig | None = None
    source: str = "flags"
    assumed: tuple[str, ...] = ()
    """Inputs that were not given and took a default (sim/compute.py), as readable phrases."""

    def validate(self, world_size: int) -> None:
        if not (isinstance(self.params, (int, float)) and math.isfinite(self.params) and self.params > 0):
            raise SimError(f"params = {self.params!r}; expected a positive number (e.g. 175e9)")
        if self.grad_dtype not in GRADIENT_DTYPES:
            raise SimError(f"grad dtype = {self.grad_dtype!r}; expected one of {list(GRADIENT_DTYPES)}")
        for what, v in (("tp", self.tp), ("pp", self.pp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimError(f"{what} = {v!r}; expected an integer >= 1")
        if world_size % (self.tp * self.pp):
            raise SimError(f"tp x pp = {self.tp} x {self.pp} = {self.tp * self.pp} does not divide the "
                           f"{world_size} GPUs of the topology; expected a divisor")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise SimError(f"num_layers = {self.num_layers!r}; expected an integer >= 1")
        if self.compute_s is not None:
            if not (math.isfinite(self.compute_s) and self.compute_s >= 0):
                raise SimError(f"compute_s = {self.compute_s!r}; expected a number >= 0")
        else:
            missing = [k for k in ("mfu", "peak_tflops", "tokens_per_step") if getattr(self, k) is None]
            if missing:
                raise SimError("compute per step is unknown: give --compute-s, or --mfu, --peak-tflops and "
                               f"--tokens-per-step (missing: {', '.join('--' + m.replace('_', '-') for m in missing)})")
            if not (0 < self.mfu <= 1):
                raise SimError(f"mfu = {self.mfu!r}; expected a number in (0, 1]")
            if not (self.peak_tflops > 0 and math.isfinite(self.peak_tflops)):
                raise SimError(f"peak_tflops = {self.peak_tflops!r}; expected a positive number")
            if not (self.tokens_per_step > 0 and math.isfinite(self.tokens_per_step)):
                raise SimError(f"tokens_per_step = {self.tokens_per_step!r}; expected a positive number")

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    @property
    def grad_elements(self) -> float:
        """Data-parallel gradient elements per GPU: params / (TP x PP)."""
        return self.params / (self.tp * self.pp)

    @property
    def grad_bytes(self) -> float:
        return self.grad_elements * DTYPE_BYTES[self.grad_dtype]

    def compute_seconds(self, world_size: int) -> float:
        """Given, or 6 * params * tokens / (GPUs * MFU * peak)."""
        if self.compute_s is not None:
            return float(self.compute_s)
        return 6.0 * self.params * self.tokens_per_step / (world_size * self.mfu * self.peak_tflops * 1e12)

    def with_(self, **kw: Any) -> Workload:
        return replace(self, **kw)


def dp_groups(world_size: int, tp: int, pp: int) -> np.ndarray:
    """Data-parallel groups in Megatron's default order (TP fastest, then DP, then PP):
    rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank. Row = one (pp_rank, tp_rank) position."""
    dp = world_size // (tp * pp)
    r = np.arange(world_size, dtype=np.int64).reshape(pp, dp, tp)
    return r.transpose(0, 2, 1).reshape(pp * tp, dp)


def megatron_param_count(num_layers: int, hidden: int, vocab: int = DEFAULT_VOCAB, seq: int = 2048,
                         ffn: int | None = None) -> float:
    """GPT parameters: per layer 4h^2 (attention) + 2*h*ffn (MLP) + biases/norms, plus embeddings."""
    ffn = ffn or 4 * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn
    return float(num_layers * per_layer + (vocab + seq) * hidden + 2 * hidden)


def read_megatron_args(path: str) -> dict[str, Any]:
    """Flags of a Megatron command line file (``.args``) or JSON object, as ``{"num-layers": "96", ...}``."""
    if str(path).endswith(".json"):
        try:
            data = load_json_file(path, what="Megatron argument file")
        except ConfigError as exc:
            raise SimError(str(exc)) from None
        if not isinstance(data, dict):
            raise SimError(f"{path}: expected a JSON object of Megatron flags, got {type(data).__name__}")
        return {str(k).lstrip("-").replace("_", "-"): v for k, v in data.items()}
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4 * 1024 * 1024)
    except OSError as exc:
        raise SimError(f"{path}: cannot read Megatron argument file ({exc.strerror or exc})") from None
    lines = [ln.split("#", 1)[0] for ln in text.replace("\\\n", " ").splitlines()]
    try:
        tokens = shlex.split(" ".join(lines))
    except ValueError as exc:
        raise SimError(f"{path}: cannot split Megatron arguments ({exc})") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key = tok[2:].replace("_", "-")
            if "=" in key:
                key, val = key.split("=", 1)
                out[key] = val
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                out[key] = tokens[i + 1]
                i += 1
            else:
                out[key] = True
        i += 1
    return out


def _as_int(flags: dict, key: str, path: str) -> int | None:
    if key not in flags:
        return None
    v = flags[key]
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise SimError(f"{path}: --{key} = {v!r}; expected an integer") from None
    if n < 1:
        raise SimError(f"{path}: --{key} = {v!r}; expected an integer >= 1")
    return n


def workload_from_megatron_args(path: str, base: Workload) -> Workload:
    """Fill model size, layout, precision, tokens and the topo-align settings from Megatron flags."""
    flags = read_megatron_args(path)
    layers = _as_int(flags, "num-layers", path)
    hidden = _as_int(flags, "hidden-size", path)
    kw: dict[str, Any] = {"source": f"megatron:{path}"}
    if layers and hidden:
        kw["params"] = megatron_param_count(
            layers, hidden, _as_int(flags, "vocab-size", path) or DEFAULT_VOCAB,
            _as_int(flags, "seq-length", path) or 2048, _as_int(flags, "ffn-hidden-size", path))
    if layers:
        kw["num_layers"] = layers
    for key, field in (("tensor-model-parallel-size", "tp"), ("pipeline-model-parallel-size", "pp")):
        v = _as_int(flags, key, path)
        if v:
            kw[field] = v
    if flags.get("accumulate-allreduce-grads-in-fp32"):
        kw["grad_dtype"] = "fp32"
    elif flags.get("bf16"):
        kw["grad_dtype"] = "bf16"
    elif flags.get("fp16"):
        kw["grad_dtype"] = "fp16"
    gbs, seq = _as_int(flags, "global-batch-size", path), _as_int(flags, "seq-length", path)
    if gbs and seq:
        kw["tokens_per_step"] = float(gbs * seq)
    cfg = base.topo_align
    if "topo-align-config" in flags:
        try:
            cfg = TopoAlignConfig.from_file(str(flags["topo-align-config"]))
        except ConfigError as exc:
            raise SimError(str(exc)) from None
    overrides = {}
    for key, dotted, conv in (
        ("topo-align-mode", "mode", str), ("topo-align-sync-last-n-layers", "sync.last_n_layers", int),
        ("topo-align-top-fraction", "sync.top_fraction", float),
        ("topo-align-reconcile-interval", "local.reconcile_interval", int),
        ("topo-align-inter-dtype", "communication.inter_dtype", str),
        ("topo-align-local-dtype", "local.dtype", str),
    ):
        if key in flags:
            try:
                overrides[dotted] = conv(flags[key])
            except (TypeError, ValueError):
                raise SimError(f"{path}: --{key} = {flags[key]!r}; expected {conv.__name__}") from None
    if flags.get("topo-align-async-reconcile"):
        overrides["local.async_reconcile"] = True
    if overrides or cfg is not None:
        try:
            cfg = (cfg or TopoAlignConfig()).with_overrides(overrides)
        except ConfigError as exc:
            raise SimError(f"{path}: {exc}") from None
    kw["topo_align"] = cfg
    return replace(base, **kw)


def workload_from_deepspeed_config(path: str, base: Workload, *, seq_length: int | None = None) -> Workload:
    """Precision, tokens per step (``train_batch_size`` x ``seq_length``, default 2048) and the
    "topo_align" block of a DeepSpeed config (params come from flags)."""
    try:
        data = load_json_file(path, what="DeepSpeed config")
        if not isinstance(data, dict):
            raise SimError(f"{path}: expected a JSON object (a DeepSpeed config), got {type(data).__name__}")
        cfg = TopoAlignConfig.from_block(data["topo_align"], where=f"{path}: topo_align") \
            if "topo_align" in data else None
    except ConfigError as exc:
        raise SimError(str(exc)) from None
    kw: dict[str, Any] = {"source": f"deepspeed:{path}", "topo_align": cfg}
    tbs = data.get("train_batch_size")
    if tbs is not None:
        if isinstance(tbs, bool) or not isinstance(tbs, int) or tbs < 1:
            raise SimError(f"{path}: train_batch_size = {tbs!r}; expected an integer >= 1")
        kw["tokens_per_step"] = float(tbs * (seq_length or DEFAULT_SEQ_LENGTH))
        if seq_length is None:
            kw["assumed"] = (*base.assumed, f"sequence length {DEFAULT_SEQ_LENGTH} (default; --seq-length) "
                             f"for the DeepSpeed config's train_batch_size {tbs}")
    comm = data.get("communication_data_type")
    names = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
    if comm is not None:
        if comm not in names:
            raise SimError(f"{path}: communication_data_type = {comm!r}; expected one of {sorted(names)}")
        kw["grad_dtype"] = names[comm]
    elif isinstance(data.get("bf16"), dict) and data["bf16"].get("enabled"):
        kw["grad_dtype"] = "bf16"
    elif isinstance(data.get("fp16"), dict) and data["fp16"].get("enabled"):
        kw["grad_dtype"] = "fp16"
    return replace(base, **kw)
