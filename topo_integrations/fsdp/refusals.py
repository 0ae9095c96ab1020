"""What the FSDP2 adapter refuses at start (docs/fsdp.md, "Refused"): ``topo_align`` keys it cannot
honour, and FSDP2 set-ups it cannot drive, each named with the reason and what to do instead.

A key is refused only when the user set it (``TopoAlignConfig.explicit_keys``) to a value other than
its default and the value conflicts with what FSDP2 owns, so the schema defaults never trip a
refusal; ``enabled`` and ``mode`` are refused for the values that would leave the model's islands
unreduced against each other. Every other key works (docs/fsdp.md, "Keys"); tests/test_every_key.py
holds the table to "works or is refused" and tests/test_fsdp.py checks the messages word for word.
"""

from __future__ import annotations

from typing import Callable

from ..config import ConfigError, Mode, TopoAlignConfig
from ..reducer.kinds import Method

__all__ = ["TopoAlignFSDPError", "ADAPTER", "KEY_REFUSALS", "check_config", "refuse_setup"]

ADAPTER = "the FSDP2 adapter (topo_integrations.fsdp)"

NATIVE = "fully_shard(..., mesh=island_mesh(groups)), the 2-D mesh, without topo-align"
"""Where a user who wants FSDP2's own cross-island reduction goes instead (native HSDP)."""


class TopoAlignFSDPError(ConfigError):
    """The FSDP2 adapter cannot run with these settings; the message names the setting and the fix."""


# key -> (refused when, why, instead); checked in this order. Every test reads the cfg only.
KEY_REFUSALS: dict[str, tuple[Callable[[TopoAlignConfig], bool], str, str]] = {
    "enabled": (
        lambda c: not c.enabled,
        "the model is sharded inside each island, so without the plugin nothing would reduce its gradients "
        "across islands",
        f"for FSDP2's own reduction shard with {NATIVE} and do not call apply(), or remove the key"),
    "mode": (
        lambda c: c.mode == Mode.FLAT,
        "the model is sharded inside each island, so the cross-island step must be the all-reduce of each "
        "shard over its rail, which is what 'hierarchical' with an fp32 wire does (native HSDP's reduction)",
        f"use mode 'hierarchical' (or 'selective'), or {NATIVE}"),
    "communication.bucket_size_mb": (
        lambda c: c.communication.bucket_size_mb != "auto",
        "FSDP2 reduces one bucket per fully_shard module (its reduce-scatter output)",
        "choose the buckets by the modules you fully_shard and remove the key"),
    "communication.overlap": (
        lambda c: not c.communication.overlap,
        "FSDP2 reduces each module's gradients from its post-backward hook, during backward",
        "remove the key"),
    "local.dtype": (
        lambda c: c.mode == Mode.SELECTIVE,
        "LOCAL gradients travel in FSDP2's island reduce-scatter, in the mixed-precision policy's "
        "reduce_dtype",
        "choose that dtype with MixedPrecisionPolicy(reduce_dtype=...) and remove the key"),
    "importance.method": (
        lambda c: c.mode == Mode.SELECTIVE and c.importance.method == Method.HUTCHINSON,
        "differentiating the loss a second time would run FSDP2's post-backward reduce-scatters again",
        "use 'fisher' or 'magnitude'"),
}


def _value(cfg: TopoAlignConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_config(cfg: TopoAlignConfig) -> None:
    """Raise :class:`TopoAlignFSDPError` for the first key of :data:`KEY_REFUSALS` this config trips
    (a key the user set to a value other than its default)."""
    if not isinstance(cfg, TopoAlignConfig):
        raise TypeError(f"cfg must be a TopoAlignConfig, got {type(cfg).__name__}")
    defaults = TopoAlignConfig()
    explicit = {k for k in cfg.explicit_keys() if _value(cfg, k) != _value(defaults, k)}
    for key, (applies, why, instead) in KEY_REFUSALS.items():
        if key in explicit and applies(cfg):
            raise TopoAlignFSDPError(f"topo_align: {key} = {_value(cfg, key)!r} is not supported by {ADAPTER}: "
                                     f"{why}; {instead}")


def refuse_setup(what: str, why: str, instead: str) -> TopoAlignFSDPError:
    """An FSDP2 set-up the adapter cannot drive (not a ``topo_align`` key), in the same shape."""
    return TopoAlignFSDPError(f"topo_align: {what} is not supported by {ADAPTER}: {why}; {instead}")
