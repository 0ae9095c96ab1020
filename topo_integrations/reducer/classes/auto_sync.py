"""The `auto` keys (`sync.dtype`, `sync.top_fraction`, `communication.bucket_size_mb`) taken at the
engine's group count.

``config.resolve_sync`` / ``config.resolve_bucket_mb`` decide the values (topo_integrations/
auto_values.py: bf16 and 0.15 below ``MANY_GROUPS`` groups, int8 and 1 from there on, docs/
convergence.md "Many islands"; 25 MiB buckets, 4 MiB per group on longer rails, docs/costmodel.md
section 5); this module applies them to a config once, when an engine is built, and words the log
line that says what `auto` became.
"""

from __future__ import annotations

from ...config import LOCAL_CLASS_KEYS, MANY_GROUPS, ConfigError, Mode, TopoAlignConfig, resolve_bucket_mb, resolve_sync

__all__ = ["resolved_config", "with_keys"]


def _with(cfg, section: str, got: dict):
    """``cfg`` with ``got`` in ``section``; the user's set-keys record kept (resolved values are not
    the user's: ``explicit_keys`` must not report them, or an adapter would refuse them)."""
    old = getattr(cfg, section)
    new = old.model_copy(update=got)
    new.__pydantic_fields_set__ = set(old.model_fields_set)
    out = cfg.model_copy(update={section: new})
    out.__pydantic_fields_set__ = set(cfg.model_fields_set)
    return out


def with_keys(cfg: TopoAlignConfig, dotted: dict) -> TopoAlignConfig:
    """``cfg`` with the dotted keys' values (``{"sync.dtype": "int8"}``), the user's set-keys record
    kept (`method: auto` sets them: reducer/adaptive/method.py)."""
    by: dict[str, dict] = {}
    for key, value in dotted.items():
        section, name = key.split(".")
        by.setdefault(section, {})[name] = value
    for section, got in by.items():
        cfg = _with(cfg, section, got)
    return cfg


def resolved_config(cfg: TopoAlignConfig, n_groups: int) -> tuple[TopoAlignConfig, str | None]:
    """``cfg`` with its `auto` keys taken at ``n_groups`` groups, and the log line saying what they
    became (None when nothing `auto` changed from its small-job value, or for the SYNC keys, when
    the mode is not `selective`).

    Raises :class:`ConfigError` when every tensor is SYNC (``sync.top_fraction`` 1, set or `auto`)
    in `selective` with a second tier and the user set keys that act only through a LOCAL class
    (``LOCAL_CLASS_KEYS``): they would be accepted and ignored. Every rank plans the same group
    count, so every rank refuses alike (no rank left waiting in a collective).
    """
    notes = []
    if cfg.communication.bucket_size_mb == "auto":
        mb = resolve_bucket_mb("auto", n_groups)
        cfg = _with(cfg, "communication", {"bucket_size_mb": mb})
        if mb != resolve_bucket_mb("auto", 1):
            notes.append(f"communication.bucket_size_mb auto -> {mb:g} MiB at {n_groups} groups (4 MiB per "
                         "group: fewer ring latencies per byte on a long rail, docs/costmodel.md section 5)")
    s = cfg.sync
    auto = [k for k in ("dtype", "top_fraction") if getattr(s, k) == "auto"]
    got = dict(zip(("dtype", "top_fraction"), resolve_sync(s.dtype, s.top_fraction, n_groups)))
    selective = cfg.mode == Mode.SELECTIVE
    # `method: auto` times the first steps with every tensor SYNC, then a LOCAL-class key set means a
    # LOCAL class (reducer/adaptive/method.py): nothing to refuse.
    if selective and n_groups >= 2 and got["top_fraction"] >= 1.0 and cfg.method != "auto":
        _refuse_local_keys(cfg, n_groups, auto="top_fraction" in auto)
    if auto:
        cfg = _with(cfg, "sync", got)
        if selective:
            notes.insert(0, f"{', '.join(f'sync.{k} auto -> {got[k]}' for k in auto)} at {n_groups} groups "
                            f"(from {MANY_GROUPS} on, every tensor is SYNC on the int8 wire: docs/convergence.md, "
                            "\"Many islands\")" + ("; method auto chooses after timing the first steps"
                                                   if cfg.method == "auto" else ""))
    return cfg, ("topo_align: " + "; ".join(notes)) if notes else None


def _refuse_local_keys(cfg: TopoAlignConfig, n_groups: int, *, auto: bool) -> None:
    """Refuse the LOCAL-class keys the user set when no tensor is LOCAL (see ``resolved_config``)."""
    unused = sorted(k for k in cfg.explicit_keys() if k.startswith(LOCAL_CLASS_KEYS))
    if not unused:
        return
    why = f"sync.top_fraction auto -> 1.0 at {n_groups} groups" if auto else "sync.top_fraction = 1.0"
    it = "it" if len(unused) == 1 else "them"
    raise ConfigError(
        f"topo_align: {', '.join(unused)} set, but every tensor is SYNC ({why}), so nothing is LOCAL for {it} to "
        "act on; set sync.top_fraction below 1 to keep a LOCAL class (e.g. 0.15 with sync.dtype bf16: "
        f"docs/convergence.md, \"Many islands\") or remove {it}")
