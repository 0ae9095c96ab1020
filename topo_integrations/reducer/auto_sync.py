"""`sync.dtype` / `sync.top_fraction` = ``"auto"`` taken at the engine's group count.

``config.resolve_sync`` decides the values (bf16 and 0.15 below ``MANY_GROUPS`` groups, int8 and 1
from there on: docs/convergence.md, "Many islands"); this module applies them to a config once, when
an engine is built, and words the log line that says what `auto` became.
"""

from __future__ import annotations

from ..config import MANY_GROUPS, TopoAlignConfig, resolve_sync

__all__ = ["resolved_config"]


def resolved_config(cfg: TopoAlignConfig, n_groups: int) -> tuple[TopoAlignConfig, str | None]:
    """``cfg`` with its `auto` SYNC keys taken at ``n_groups`` groups, and the log line saying what
    they became (None when nothing was `auto` or the mode is not `selective`).

    The resolved values do not count as set by the user (``explicit_keys``), so no adapter refuses
    them. When `auto` makes every tensor SYNC, `local.*` keys the user set have nothing to act on:
    the line names them rather than dropping them silently.
    """
    s = cfg.sync
    auto = [k for k in ("dtype", "top_fraction") if getattr(s, k) == "auto"]
    if not auto:
        return cfg, None
    got = dict(zip(("dtype", "top_fraction"), resolve_sync(s.dtype, s.top_fraction, n_groups)))
    sync = s.model_copy(update=got)
    sync.__pydantic_fields_set__ = set(s.model_fields_set)
    out = cfg.model_copy(update={"sync": sync})
    out.__pydantic_fields_set__ = set(cfg.model_fields_set)
    if cfg.mode != "selective":
        return out, None
    note = (f"topo_align: {', '.join(f'sync.{k} auto -> {got[k]}' for k in auto)} at {n_groups} groups (from "
            f"{MANY_GROUPS} on, every tensor is SYNC on the int8 wire: docs/convergence.md, \"Many islands\")")
    unused = sorted(k for k in cfg.explicit_keys() if k.startswith("local."))
    if got["top_fraction"] >= 1.0 and unused:
        note += (f"; nothing is LOCAL, so the local.* keys set ({', '.join(unused)}) act on nothing: set "
                 "sync.top_fraction below 1 to keep a LOCAL class")
    return out, note
