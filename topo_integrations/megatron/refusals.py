"""The Megatron adapter's refuse table: ``topo_align`` keys it cannot honour, refused at start.

Every key of the block either works in `TopoAlignDDP` (docs/megatron.md, "Keys") or is listed here
with why and what to use instead. A key is refused only when the user set it
(`TopoAlignConfig.explicit_keys`) to a value other than its default and the setting conflicts with
what Megatron owns, so the schema defaults never trip a refusal. The messages name the key, the value, the
adapter and the replacement; tests/test_megatron_unit.py checks them word for word.

Megatron settings that the plugin cannot combine with a mode (not ``topo_align`` keys) are checked
here too (`check_megatron_settings`), with the same message shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import ConfigError, Mode, TopoAlignConfig
from ..reducer.kinds import Method
from .flags import FLAG_FIELDS

__all__ = ["TopoAlignDDPError", "MegatronSide", "REFUSALS", "Refusal", "check_config", "check_megatron_settings",
           "ADAPTER"]

ADAPTER = "the Megatron adapter (TopoAlignDDP)"


class TopoAlignDDPError(ConfigError):
    """TopoAlignDDP cannot run with these settings; the message names the setting and the fix."""


@dataclass(frozen=True)
class MegatronSide:
    """What Megatron decided for this model chunk (the settings the refusals compare against)."""

    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    pipeline_parallel_size: int = 1
    calculate_per_token_loss: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False


@dataclass(frozen=True)
class Refusal:
    key: str
    """Dotted ``topo_align`` key."""
    applies: Callable[[TopoAlignConfig, MegatronSide], bool]
    """True when this value cannot be honoured with these Megatron settings."""
    why: str
    instead: str
    explicit_only: bool = True
    """Refuse only when the user set the key (a default value never trips it)."""


def _get(cfg: TopoAlignConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "communication.bucket_size_mb", lambda c, m: c.communication.bucket_size_mb != "auto",
        "Megatron builds the gradient buckets itself",
        "set the bucket size with --ddp-bucket-size (DistributedDataParallelConfig.bucket_size, in elements) "
        "and remove the key"),
    Refusal(
        "communication.overlap", lambda c, m: c.communication.overlap != m.overlap_grad_reduce,
        "Megatron decides whether buckets are reduced during backward",
        "use --overlap-grad-reduce (DistributedDataParallelConfig.overlap_grad_reduce) and remove the key"),
    Refusal(
        "local.dtype", lambda c, m: c.mode == Mode.SELECTIVE and m.use_distributed_optimizer,
        "with the distributed optimizer LOCAL gradients travel in the island reduce-scatter of the whole "
        "bucket, in the gradient buffer's dtype",
        "remove the key (or choose the buffer dtype with --accumulate-allreduce-grads-in-fp32), or use plain DDP "
        "(no --use-distributed-optimizer) where local.dtype applies"),
    Refusal(
        "importance.method", lambda c, m: (c.mode == Mode.SELECTIVE and c.importance.method == Method.HUTCHINSON
                                           and m.pipeline_parallel_size > 1),
        "with pipeline parallelism no stage computes the whole loss, so there is no loss closure to "
        "differentiate twice",
        "use 'fisher' or 'magnitude'", explicit_only=False),
)


def _flag(key: str) -> str:
    """`` (--topo-align-...)`` when a Megatron flag sets ``key`` (flags.py), so a refusal of a value
    that came from the command line names the flag too."""
    flags = ["--" + d.replace("_", "-") for d, k in FLAG_FIELDS.items() if k == key]
    return f" ({flags[0]})" if flags else ""


def check_config(cfg: TopoAlignConfig, side: MegatronSide) -> None:
    """Raise :class:`TopoAlignDDPError` for the first key of `REFUSALS` this config trips.

    A key counts as set when the user gave it a value other than the schema default: a block that
    spells out every default (e.g. a dumped config) behaves as one that leaves them out.
    """
    defaults = TopoAlignConfig()
    explicit = {k for k in cfg.explicit_keys() if _get(cfg, k) != _get(defaults, k)}
    for r in REFUSALS:
        if (r.key in explicit or not r.explicit_only) and r.applies(cfg, side):
            raise TopoAlignDDPError(f"topo_align: {r.key} = {_get(cfg, r.key)!r}{_flag(r.key)} is not supported by "
                                    f"{ADAPTER}: {r.why}; {r.instead}")


def check_megatron_settings(cfg: TopoAlignConfig, side: MegatronSide) -> None:
    """Megatron settings the plugin cannot combine with the configured mode."""
    if cfg.mode == Mode.SELECTIVE and side.calculate_per_token_loss:
        raise TopoAlignDDPError(
            f"topo_align: mode = 'selective' is not supported by {ADAPTER} with calculate_per_token_loss: Megatron "
            "all-reduces the token count over the whole data-parallel group, LOCAL gradients would need group "
            "counts; turn --calculate-per-token-loss off or use mode 'hierarchical'")
    if side.reduce_scatter_with_fp32_accumulation:
        raise TopoAlignDDPError(
            f"topo_align: mode = {cfg.mode!r} is not supported by {ADAPTER} with "
            "reduce_scatter_with_fp32_accumulation: the plugin issues its own reduce-scatter; turn "
            "--ddp-reduce-scatter-with-fp32-accumulation off")
