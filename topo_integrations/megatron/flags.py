"""The ``--topo-align*`` command-line flags (docs/megatron.md, "Flags"), mapped onto a `TopoAlignConfig`.

    --topo-align                      turn the plugin on (without it the run is stock Megatron)
    --topo-align-config FILE          JSON file holding the "topo_align" block (or a DeepSpeed config with one)
    --topo-align-mode MODE            flat | hierarchical | selective        -> mode
    --topo-align-topology FILE        JSON topology file                     -> topology.source="file", topology.file
    --topo-align-sync-last-n-layers N                                        -> sync.last_n_layers
    --topo-align-top-fraction F       0 <= F <= 1                            -> sync.top_fraction
    --topo-align-reconcile-interval H H >= 1                                 -> local.reconcile_interval
    --topo-align-async-reconcile / --no-topo-align-async-reconcile           -> local.async_reconcile
    --topo-align-inter-dtype DTYPE    fp32 | bf16 | fp16                     -> communication.inter_dtype
    --topo-align-local-dtype DTYPE    fp32 | bf16 | fp16                     -> local.dtype
    --topo-align-importance METHOD    fisher | hutchinson | magnitude        -> importance.method
    --topo-align-method METHOD        fixed | auto                           -> method

Flags override the file; fields neither sets keep the schema's defaults. A bad value is rejected at
parse time with argparse's one-line ``error:`` message (exit status 2), naming the flag, the value
and what is accepted. After parsing, the resolved config is stored on the namespace as
``args.topo_align_resolved`` (None when the plugin is off), which is where `TopoAlignDDP` and
Megatron-LM's ``get_model`` pick it up. A ``--num-distributed-optimizer-instances`` the user did not
give is recorded as unset (``args.topo_align_unset_layout``, layout.py) so the plugin can derive it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..config import DTYPES, MODES, ConfigError, TopoAlignConfig
from .layout import mark_derivable, resolve_unset

__all__ = ["add_topo_align_args", "config_from_args", "FLAG_FIELDS", "RESOLVED_ATTR", "TopoAlignFlagError"]

RESOLVED_ATTR = "topo_align_resolved"
"""Namespace attribute holding the resolved `TopoAlignConfig` (or None)."""

IMPORTANCE_METHODS = ("fisher", "hutchinson", "magnitude")
METHODS = ("fixed", "auto")

# argparse dest -> dotted config field (the topology flag sets two fields, handled apart).
FLAG_FIELDS: dict[str, str] = {
    "topo_align_mode": "mode",
    "topo_align_sync_last_n_layers": "sync.last_n_layers",
    "topo_align_top_fraction": "sync.top_fraction",
    "topo_align_reconcile_interval": "local.reconcile_interval",
    "topo_align_async_reconcile": "local.async_reconcile",
    "topo_align_inter_dtype": "communication.inter_dtype",
    "topo_align_local_dtype": "local.dtype",
    "topo_align_importance": "importance.method",
    "topo_align_method": "method",
}
_ALL_DESTS = ("topo_align", "topo_align_config", "topo_align_topology", *FLAG_FIELDS)


class TopoAlignFlagError(ConfigError):
    """The --topo-align* flags (or the file they name) cannot be turned into a config."""


def _choice(accepted: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in accepted:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected one of {', '.join(accepted)}")
        return text

    parse.__name__ = "choice"
    return parse


def _int_at_least(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer in [{lo}, {hi}]") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"got {value}; expected an integer in [{lo}, {hi}]")
        return value

    parse.__name__ = "integer"
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number in [0, 1]") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number in [0, 1]")
    return value


def _path(text: str) -> str:
    if not text or not text.strip():
        raise argparse.ArgumentTypeError("got an empty path; expected a file name")
    return text


def add_topo_align_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the --topo-align* flags to ``parser`` and return it (usable as ``extra_args_provider``).

    Also makes ``parser.parse_args``/``parse_known_args`` resolve the flags (and the config file)
    into ``args.topo_align_resolved``; a file or combination that does not validate ends in
    ``parser.error`` (one line, exit status 2). Adding the flags twice is a no-op.
    """
    if any(getattr(a, "dest", None) == "topo_align" for a in parser._actions):
        return parser
    g = parser.add_argument_group("topo-align", "topology-aware gradient reduction (topo_integrations)")
    g.add_argument("--topo-align", action="store_true", default=False,
                   help="Reduce gradients with topo-align (TopoAlignDDP). Without it the run is stock Megatron.")
    g.add_argument("--topo-align-config", type=_path, default=None, metavar="FILE",
                   help='JSON file holding the "topo_align" block; the flags below override it.')
    g.add_argument("--topo-align-mode", type=_choice(MODES), default=None, metavar="MODE",
                   help=f"Reduction mode: {', '.join(MODES)}.")
    g.add_argument("--topo-align-topology", type=_path, default=None, metavar="FILE",
                   help="JSON topology file (sets topology.source to 'file').")
    g.add_argument("--topo-align-sync-last-n-layers", type=_int_at_least(0, 100_000), default=None, metavar="N",
                   help="selective: the last N transformer layers are reduced globally every step.")
    g.add_argument("--topo-align-top-fraction", type=_fraction, default=None, metavar="F",
                   help="selective: fraction of gradient elements (most important tensors) that is SYNC.")
    g.add_argument("--topo-align-reconcile-interval", type=_int_at_least(1, 1_000_000), default=None, metavar="H",
                   help="selective: average LOCAL parameters across groups every H optimizer steps.")
    g.add_argument("--topo-align-async-reconcile", action=argparse.BooleanOptionalAction, default=None,
                   help="selective: overlap reconciliation with the next steps (--no-... turns it off).")
    g.add_argument("--topo-align-inter-dtype", type=_choice(DTYPES), default=None, metavar="DTYPE",
                   help=f"hierarchical: wire dtype across groups (slow tier): {', '.join(DTYPES)} "
                        "(selective sends SYNC across groups in sync.dtype; another value is refused).")
    g.add_argument("--topo-align-local-dtype", type=_choice(DTYPES), default=None, metavar="DTYPE",
                   help=f"selective: wire dtype of LOCAL gradients inside a group: {', '.join(DTYPES)}.")
    g.add_argument("--topo-align-importance", type=_choice(IMPORTANCE_METHODS), default=None, metavar="METHOD",
                   help=f"selective: importance score: {', '.join(IMPORTANCE_METHODS)}.")
    g.add_argument("--topo-align-method", type=_choice(METHODS), default=None, metavar="METHOD",
                   help="fixed: the mode and keys as set; auto: chosen from the measured slow tier, the gradient "
                        "and the timed compute (docs/costmodel.md, section 6).")
    mark_derivable(parser)  # Megatron-LM's --num-distributed-optimizer-instances, when already added
    _resolve_after_parsing(parser)
    return parser


def config_from_args(args: Any) -> TopoAlignConfig | None:
    """The `TopoAlignConfig` the flags in ``args`` describe; None when ``--topo-align`` is absent.

    Raises :class:`TopoAlignFlagError` (one line naming the flag or field, the value and what is
    accepted) for a bad file, a value the schema refuses, or topo-align flags without --topo-align.
    """
    if not getattr(args, "topo_align", False):
        given = [d for d in _ALL_DESTS[1:] if getattr(args, d, None) is not None]
        if given:
            flags = ", ".join("--" + d.replace("_", "-") for d in given)
            raise TopoAlignFlagError(f"{flags} given without --topo-align; add --topo-align to turn the plugin on")
        return None
    path = getattr(args, "topo_align_config", None)
    try:
        base = TopoAlignConfig.from_file(path) if path else TopoAlignConfig()
    except ConfigError as exc:
        raise TopoAlignFlagError(f"--topo-align-config: {exc}") from None
    overrides: dict[str, Any] = {"enabled": True}
    for dest, field in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[field] = value
    topo_file = getattr(args, "topo_align_topology", None)
    if topo_file is not None:
        overrides["topology.source"] = "file"
        overrides["topology.file"] = topo_file
    try:
        return base.with_overrides(overrides)
    except ConfigError as exc:
        named = [f"--{d.replace('_', '-')}" for d, f in FLAG_FIELDS.items()
                 if getattr(args, d, None) is not None and f"{f} =" in str(exc)]
        by = f" (set by {', '.join(named)})" if named else ""
        raise TopoAlignFlagError(f"--topo-align flags: {exc}{by}") from None


def _resolve_after_parsing(parser: argparse.ArgumentParser) -> None:
    """Wrap this parser's parse_known_args so every parse also resolves the config.

    argparse has no post-parse hook; ``parse_args`` goes through ``parse_known_args``, so wrapping
    the latter (on this instance only) covers both, and Megatron-LM's ``ignore_unknown_args`` path.
    """
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = original(args, namespace)
        resolve_unset(ns)  # layout.py: sentinels back to Megatron's defaults, the unset flags recorded
        try:
            setattr(ns, RESOLVED_ATTR, config_from_args(ns))
        except ConfigError as exc:
            parser.error(str(exc))
        return ns, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
