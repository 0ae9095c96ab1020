"""The ``"topo_align"`` block: one typed schema for every adapter's configuration and for the CLI.

Every model forbids unknown keys and validates in strict mode (``"5"`` is not ``5``), so a typo
in a config file is an error at start-up rather than a silently ignored setting. Each field's
docstring becomes its description in the JSON Schema printed by ``topo-align schema``.

Errors: :class:`pydantic.ValidationError` (from ``model_validate``) and :class:`ConfigError` (from
``from_file`` / ``from_block``) are both ``ValueError`` subclasses; their messages name the field,
the value and what is accepted.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .auto_values import (  # noqa: F401 (re-exported)
    BUCKET_MB_MIN,
    BUCKET_MB_PER_GROUP,
    LOCAL_CLASS_KEYS,
    MANY_GROUPS,
    SYNC_AUTO,
    keeps_local_class,
    keys_without_effect,
    local_class_defaults,
    resolve_bucket_mb,
    resolve_sync,
)

__all__ = [
    "ConfigError", "TopoAlignConfig", "TopologyConfig", "SyncConfig", "LocalConfig", "ImportanceConfig",
    "CommunicationConfig", "FallbackConfig", "AdaptiveConfig", "MonitorConfig",
    "DTYPES", "MODES", "Mode", "SOURCE_KINDS", "format_validation_error",
    "MANY_GROUPS", "resolve_sync", "resolve_bucket_mb",
]

Dtype = Literal["fp32", "bf16", "fp16"]
CrossDtype = Literal["fp32", "bf16", "fp16", "int8"]  # wires across groups that may be 8-bit
SyncDtype = Literal["auto", "fp32", "bf16", "fp16", "int8"]  # auto: from the group count (resolve_sync)
ModeName = Literal["flat", "hierarchical", "selective"]
SourceKind = Literal["auto", "file", "nvidia-smi", "nccl-xml", "slurm", "hostfile", "hostnames"]

DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
MODES: tuple[str, ...] = ("flat", "hierarchical", "selective")
SOURCE_KINDS: tuple[str, ...] = ("auto", "file", "nvidia-smi", "nccl-xml", "slurm", "hostfile", "hostnames")


class Mode(StrEnum):
    """``mode`` of the config (see its field). Defined beside its parsing so that every layer, the topology
    planner below the reducer included, compares with members, never with spelled strings (a member
    equals its value, so the parsed ``cfg.mode`` compares with it); ``reducer.kinds`` re-exports it."""

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"
    SELECTIVE = "selective"


# JSON nested deeper than this is refused before it reaches pydantic: a real block is 3 levels deep,
# and Python's recursion limit must never be the thing that rejects a hostile file.
MAX_JSON_DEPTH = 64
# A config file is a few hundred bytes; a multi-megabyte one is a mistake (or an attack).
MAX_CONFIG_BYTES = 4 * 1024 * 1024


class ConfigError(ValueError):
    """A ``topo_align`` block or config file that cannot be used; the message says why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)


class TopologyConfig(_Section):
    source: SourceKind = "auto"
    """Where the topology comes from: `auto` (every rank reports its node: host, GPUs and NVLink islands
    from NVML / nvidia-smi / rocm-smi, NIC rates from /sys, Slurm switches; docs/topology-format.md),
    `file` (a JSON topology file), or a source kind: `nvidia-smi`, `nccl-xml`, `slurm`, `hostfile`,
    `hostnames` (host names only, default tier speeds)."""

    file: str | None = None
    """Path of the topology source to read (required for every source except `auto` and `hostnames`).
    For `slurm` it is `topology.conf,NODELIST`."""

    group_by: Literal["island", "leaf"] = "island"
    """What an intra group is: an NVLink `island` (node, bridged pair or NVL rack), or all ranks under
    one `leaf` switch (scalable unit)."""

    min_tier_ratio: float = Field(default=1.3, ge=1.0, le=1e6)
    """Two tiers count as different only if their bandwidths differ by at least this factor; below it
    the plan has one tier and the reducer falls back (see `fallback.on_flat_topology`)."""

    middle_level: bool = False
    """Add the leaf level between island and spine (3-level hierarchy: island, rail within a leaf,
    rail across leaves)."""

    probe: bool = False
    """With `source: auto`, time an all-reduce inside the groups of every tier at start-up (median of
    5, bus bandwidth as nccl-tests) and plan on the measured numbers instead of the derived ones
    (origin `measured`). Costs a few seconds of start-up; every adapter discovers through the same
    path, so it applies to all of them."""

    @model_validator(mode="after")
    def _file_needed(self) -> TopologyConfig:
        if self.probe and self.source != "auto":
            raise ValueError(
                f"topology.probe = true needs topology.source 'auto' (got {self.source!r}): the probe measures "
                "the discovered tiers; a file or source states its own bandwidths"
            )
        if self.source not in ("auto", "hostnames") and not self.file:
            raise ValueError(
                f"topology.file is required when topology.source is {self.source!r}; "
                "give the path of the source to read"
            )
        return self


class SyncConfig(_Section):
    last_n_layers: int = Field(default=5, ge=0, le=100_000)
    """The last N transformer layers are always SYNC (reduced globally every step)."""

    always_sync: list[str] = Field(default_factory=lambda: ["output_layer", "lm_head"], max_length=1024)
    """Parameter-name patterns (fnmatch, or a plain substring) that are always SYNC, e.g. the output head."""

    top_fraction: float | Literal["auto"] = "auto"
    """Fraction of all gradient elements, chosen by importance, that is SYNC besides the last N layers
    and `always_sync`; 1 equals `hierarchical`. `auto` (default): 1, every tensor SYNC (with `sync.dtype`
    `auto`, on the int8 wire), or 0.15 (bf16) where the user set a LOCAL-class key (`LOCAL_CLASS_KEYS`);
    a number below 1 keeps a LOCAL class (docs/convergence.md, "Many islands")."""

    @field_validator("top_fraction", mode="before")
    @classmethod
    def _number_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1):
            return v
        raise ValueError("Input should be a number in [0, 1] or 'auto'")

    dtype: SyncDtype = "auto"
    """Wire dtype of SYNC gradients across groups (the rail hop; inside the island SYNC stays fp32),
    with error feedback when lossy. `auto` (default): `int8`, with `top_fraction` `auto` for every
    tensor: at 2, 4 and 8 groups that keeps flat's quality where the groups' replicas of a LOCAL
    class cost it, with fewer slow-tier bytes (docs/convergence.md, "Many islands"). `bf16`: half of
    fp32's bytes, within the seed spread of `fp32` at 2 groups (the default with a LOCAL class before).
    `fp32` with `top_fraction` 1 equals `hierarchical`. `int8`: blocks of 256 with one fp32 scale each
    (an all-to-all, an fp32 sum by the owner and an all-gather), error feedback on both roundings;
    with `top_fraction` 0.15 at 2 groups +0.6 points of percent on the 8-layer GPT
    (docs/convergence.md, "Fewer slow-tier bytes")."""

    layer_pattern: str | None = None
    """Regular expression with one group capturing the layer index, overriding layer detection
    (default detection knows `decoder.layers.N`, `h.N`, `layers.N`, `blocks.N` and `nn.Sequential`)."""


class LocalConfig(_Section):
    dtype: Dtype = "bf16"
    """Wire dtype of LOCAL gradients inside a group (with error feedback when lossy). `bf16` keeps
    an exponent per element; `fp16` shares one scale per bucket, which rounds the small gradients of
    a bucket coarsely (16-layer GPT: +3.3 % validation loss against flat with fp16, +1.7 % with bf16;
    docs/convergence.md)."""

    reconcile_interval: int = Field(default=2, ge=1, le=1_000_000)
    """LOCAL parameters are averaged across groups every this many optimizer steps."""

    async_reconcile: bool = True
    """Start the reconciliation without blocking and apply it as a correction one interval later
    (staleness bounded by one interval)."""

    reconcile_dtype: CrossDtype = "int8"
    """Wire dtype of a reconciliation across groups. `fp32` averages the values exactly; `bf16` /
    `fp16` average the change since the last reconciliation (the delta: small numbers, so a 16-bit
    wire with error feedback loses little) and add it to the last reconciled value, halving the
    bytes on the slow tier; `int8` (default since issue 25) sends the delta as 8-bit integers with one
    fp32 scale per 256 elements (error feedback on both roundings; an all-to-all and an all-gather
    instead of an all-reduce), a quarter of fp32's bytes plus 1.6 %: 3 seeds on the 8- and 16-layer
    GPT and digits as good as `bf16` (docs/convergence.md, "Fewer slow-tier bytes"). Optimizer
    moments have their own wire: `moments_dtype`."""

    moments_dtype: Dtype = "bf16"
    """Wire dtype of the optimizer-moment average (Adam's exp_avg / exp_avg_sq of LOCAL tensors, at
    every `moments_interval`-th reconciliation). `fp32` averages the values exactly; `bf16` (default
    since issue 25) / `fp16` average their change since the last moment average (the moment anchor,
    identical on every replica: the first average of a layout is exact in fp32 and sets it) on that
    wire with error feedback, second moments clamped at 0: half the moments' bytes, 3 seeds on the 8-
    and 16-layer GPT and digits as good as fp32 (docs/convergence.md, "Fewer slow-tier bytes"). The
    anchor costs 4 bytes per LOCAL optimizer-state element this rank holds (a ZeRO-1 / distributed
    optimizer shard: only its own) and is saved in the engine state, so a resume is bitwise. No
    `int8`: one scale per 256 elements rounds the small second moments of a block to 0 and Adam's
    step divides by them (digits, seed 0: 1.3 points lower, LOCAL replicas 0.93 apart)."""

    moments_interval: int = Field(default=4, ge=1, le=1_000_000)
    """Optimizer moments of LOCAL tensors (Adam's exp_avg / exp_avg_sq) are averaged at every this
    many-th reconciliation (1 = every one), and always before a checkpoint, a class refresh and a
    drift promotion; in between only the parameters are averaged (a third of the bytes with Adam)."""

    outer_momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Nesterov momentum of an outer optimizer on the averaged delta (as in DiLoCo): the
    reconciled value becomes ``anchor + outer_lr * (delta + m * v)`` with ``v = m * v + delta``.
    0 (default) is plain averaging."""

    outer_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    """Step size of the outer optimizer (1 with outer_momentum 0 is plain averaging)."""

    stream_fragments: int = Field(default=1, ge=1, le=1_000_000)
    """Streaming reconciliation (as in Streaming DiLoCo): the LOCAL set is cut into this many
    fragments of consecutive tensors (about equal elements, in model order) and fragment ``f`` is
    reconciled at the steps ``s`` with ``s % reconcile_interval == (f + 1) * reconcile_interval //
    stream_fragments % reconcile_interval``: every fragment still every `reconcile_interval` steps,
    but the slow-tier bytes of one interval spread over `stream_fragments` steps, each overlapped
    with that step's compute. 1 (default) reconciles the whole set at once. At most
    `reconcile_interval` (one fragment a step). Saves, class refreshes and promotions reconcile every
    fragment at once (blocking), as before."""

    promote_drift_fraction: float = Field(default=0.15, ge=0.0, le=1.0)
    """Drift-driven promotion budget: the LOCAL tensors whose replicas drift apart most (relative
    norm, see `reducer/classes/drift.py`) become SYNC, largest drift first, while the promoted tensors stay
    within this fraction of all gradient elements. The budget is a byte budget on the slow tier:
    a promoted element crosses it on the `sync.dtype` wire every step instead of on the
    `reconcile_dtype` wire every `reconcile_interval` steps (the log line of a promotion gives the
    bytes per step it adds). Classes change only right after a blocking reconciliation, so
    reconciliations block while a promotion (or, with `demote`, a swap) is pending. 0 only measures
    and logs the drift."""

    promote_window: int = Field(default=1, ge=1, le=1_000)
    """How many measured reconciliations a promotion is decided on: a LOCAL tensor's score is the
    mean of its last `promote_window` relative drifts, and only a tensor measured that often is a
    candidate (1: the latest drift alone, the 0.2 behaviour)."""

    demote: bool = False
    """Promotion with demotion: when the budget is full, a LOCAL tensor whose score is at least twice
    the smallest score a promoted tensor had when it was promoted takes its place; the displaced
    tensor turns LOCAL again and is measured anew (twice: a margin, so that two tensors of similar
    drift do not swap back and forth). Off: promotions are for good."""

    @model_validator(mode="after")
    def _fragments_fit_the_interval(self) -> LocalConfig:
        if self.stream_fragments > self.reconcile_interval:
            raise ValueError(
                f"local.stream_fragments = {self.stream_fragments} exceeds local.reconcile_interval = "
                f"{self.reconcile_interval}: each fragment is reconciled every reconcile_interval steps, one "
                "fragment a step at most; use at most reconcile_interval fragments")
        return self


class ImportanceConfig(_Section):
    method: Literal["fisher", "hutchinson", "magnitude"] = "fisher"
    """How tensors are ranked for `sync.top_fraction`: `fisher` (EMA of squared gradients),
    `hutchinson` (Hessian-diagonal estimate; needs a loss closure), `magnitude` (parameter norm)."""

    ema_decay: float = Field(default=0.99, ge=0.0, lt=1.0)
    """Decay of the importance moving average."""

    refresh_interval: int = Field(default=200, ge=1, le=100_000_000)
    """Classes are re-ranked every this many steps (applied right after a reconciliation)."""


class CommunicationConfig(_Section):
    inter_dtype: Dtype = "fp32"
    """Wire dtype of the cross-group (slow tier) step of `hierarchical` reduction."""

    error_feedback: bool = True
    """Keep the rounding residual of lossy casts and add it back on the next step."""

    bucket_size_mb: float | Literal["auto"] = "auto"
    """Gradient bucket size in MiB, a number in (0, 65536]; a bucket is reduced as soon as it is full.
    `auto` (default): 25 MiB (PyTorch DDP's `bucket_cap_mb`) up to 6 groups, then 4 MiB per group
    (e.g. 512 MiB at 128): a ring over the groups pays 2(groups - 1) latencies per bucket, so a fixed
    size turns latency-bound on a long rail (docs/costmodel.md, section 5); megatron-core sizes its
    buckets by the data-parallel size for the same reason."""

    @field_validator("bucket_size_mb", mode="before")
    @classmethod
    def _mib_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 65536):
            return v
        raise ValueError("Input should be a number in (0, 65536] or 'auto'")

    overlap: bool = True
    """Launch buckets from post-accumulate-grad hooks during backward (else all at finish_grad_sync)."""


class FallbackConfig(_Section):
    timeout_s: float = Field(default=600.0, gt=0.0, le=86_400.0)
    """Every collective the plugin issues must finish within this many seconds, else the run ends
    with an error naming the group, ranks and operation."""

    on_flat_topology: Literal["flat", "error"] = "flat"
    """What to do when the plan has a single tier (one node, or tiers within `min_tier_ratio`):
    `flat` (fall back to one all-reduce, logged once) or `error`."""


class AdaptiveConfig(_Section):
    enabled: bool = False
    """Adapt to congested links: longer reconcile interval, lossy inter wire, then flat, and regroup."""

    check_interval: int = Field(default=100, ge=1, le=100_000_000)
    """Measure achieved per-tier bandwidth and decide every this many steps."""

    slowdown_factor: float = Field(default=3.0, gt=1.0, le=1e6)
    """The inter tier counts as degraded when its achieved bandwidth is this many times below plan."""

    window: int = Field(default=3, ge=1, le=10_000)
    """Consecutive checks that must agree before an adaptation is made or reversed."""


class MonitorConfig(_Section):
    log_interval: int = Field(default=10, ge=1, le=100_000_000)
    """Log reducer statistics (bytes and seconds per tier) every this many steps."""
    check_collectives: bool = False
    """Debug: fingerprint every collective of the engine (communicator, op, dtype, size, sequence
    number) and compare them across the data-parallel group at the end of every step, raising
    CollectiveOrderError at the first divergence (one all_gather_object per step; also on with
    ``$TOPO_ALIGN_CHECK_COLLECTIVES=1``)."""


class TopoAlignConfig(_Section):
    """The whole ``"topo_align"`` block (README.md, "Config reference")."""

    enabled: bool = True
    """Turn the plugin on; `false` leaves the framework's own reduction untouched."""

    mode: ModeName = "selective"
    """`flat` (one all-reduce), `hierarchical` (exact: intra reduce-scatter, inter all-reduce, intra
    all-gather) or `selective` (SYNC tensors every step, LOCAL inside groups with periodic reconciliation)."""

    method: Literal["fixed", "auto"] = "fixed"
    """`fixed` (default): the keys as set. `auto` (mode `selective`): the engine times the first steps'
    compute and picks, with the cost model of `topo-align simulate`, every tensor SYNC on fp32 (=
    `hierarchical`) or int8, or a LOCAL class reconciled every H steps; it sets `sync.dtype`,
    `sync.top_fraction`, `local.reconcile_interval` (docs/costmodel.md, section 6). GroupedReducer only."""

    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    """How the topology is discovered and planned."""

    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Which tensors are reduced globally every step (`selective`)."""

    local: LocalConfig = Field(default_factory=LocalConfig)
    """How LOCAL tensors are reduced and reconciled (`selective`)."""

    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    """How tensor importance is scored (`selective`)."""

    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    """Wire formats and bucketing."""

    fallback: FallbackConfig = Field(default_factory=FallbackConfig)
    """Timeouts and behaviour on a topology with one tier."""

    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    """Adaptation to slow or congested links."""

    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Statistics logging."""

    @model_validator(mode="after")
    def _keys_have_an_effect(self) -> TopoAlignConfig:
        # A key accepted and then ignored is an error (auto_values.keys_without_effect).
        if why := keys_without_effect(self, Mode.SELECTIVE):
            raise ValueError(why)
        return self

    def explicit_keys(self) -> set[str]:
        """Dotted names of the keys the user set (``"local.async_reconcile"``), from pydantic's
        ``model_fields_set``: an adapter refuses a key it cannot honour only when it was set, so the
        defaults never trip a refusal."""
        out: set[str] = set()

        def walk(m: BaseModel, prefix: str) -> None:
            for name in m.model_fields_set:
                v = getattr(m, name)
                if isinstance(v, BaseModel):
                    walk(v, f"{prefix}{name}.")
                else:
                    out.add(prefix + name)

        walk(self, "")
        return out

    # -- construction helpers ----------------------------------------------------------------------

    @classmethod
    def from_block(cls, block: Any, *, where: str = "topo_align") -> TopoAlignConfig:
        """Validate a block (a dict) and raise :class:`ConfigError` with one readable line on failure."""
        if not isinstance(block, dict):
            raise ConfigError(
                f"{where}: expected a JSON object (the \"topo_align\" block), got {type(block).__name__}"
            )
        try:
            return cls.model_validate(block)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix=where)) from None
        except RecursionError:
            raise ConfigError(f"{where}: nested too deeply") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TopoAlignConfig:
        """Read a JSON file holding the block, or a framework config that holds it under a top-level
        "topo_align" key (framework-specific readers live in the adapters, e.g. deepspeed/block.py)."""
        data = load_json_file(path, what="topo-align config")
        if isinstance(data, dict) and "topo_align" in data:
            return cls.from_block(data["topo_align"], where=f"{path}: topo_align")
        return cls.from_block(data, where=str(path))

    def with_overrides(self, overrides: dict[str, Any]) -> TopoAlignConfig:
        """A copy with dotted-key overrides applied, e.g. ``{"local.reconcile_interval": 8}``.

        Only the keys set before and the overridden ones count as set in the copy
        (:meth:`explicit_keys`), so an adapter's refusal of a key never trips on a default."""
        data = self.model_dump(exclude_unset=True)
        for dotted, value in overrides.items():
            node, model = data, type(self)
            *parents, leaf = dotted.split(".")
            for key in parents:
                field = model.model_fields.get(key)
                sub = field.annotation if field is not None else None
                if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
                    raise ConfigError(f"topo_align: unknown section {dotted!r} in override")
                node = node.setdefault(key, {})
                model = sub
            if leaf not in model.model_fields:
                raise ConfigError(f"topo_align: unknown field {dotted!r} in override")
            node[leaf] = value
        return TopoAlignConfig.from_block(data)


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of decoded JSON, iteratively (no recursion on hostile input)."""
    stack = [(obj, 1)]
    deepest = 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


def load_json_text(text: str, *, where: str) -> Any:
    """Decode JSON text; every failure becomes a one-line :class:`ConfigError`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. integers with too many digits
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if _depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ConfigError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    return data


def load_json_file(path: str | os.PathLike[str], *, what: str) -> Any:
    """Read and decode a JSON file with size, encoding and nesting checks."""
    try:
        size = os.path.getsize(path)
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {what} is {size} bytes; at most {MAX_CONFIG_BYTES} are accepted")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:  # a device or pipe (e.g. /dev/zero) whose size stat() does not tell
            raise ConfigError(
                f"{path}: {what} is more than {MAX_CONFIG_BYTES} bytes; at most {MAX_CONFIG_BYTES} are accepted"
            )
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        raise ConfigError(f"{path}: cannot read {what} ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: {what} is not UTF-8 text") from None
    return load_json_text(text, where=str(path))


def format_validation_error(exc: ValidationError, *, prefix: str = "topo_align") -> str:
    """One line per problem: ``prefix.field.path: got VALUE; MESSAGE``, joined with '; '."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ()))
        field = f"{prefix}.{loc}" if loc else prefix
        value = err.get("input")
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "value_error" and not loc:  # a check across sections names its keys itself
            parts.append(f"{field}: {msg}")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"{field}: unknown key (value {shown}); see `topo-align schema` for the accepted keys")
        else:
            parts.append(f"{field}: got {shown}; {msg}")
    return "; ".join(parts) if parts else str(exc)
