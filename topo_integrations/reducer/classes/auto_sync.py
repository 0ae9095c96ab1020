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

    Keys that act only through a LOCAL class (``LOCAL_CLASS_KEYS``), set by the user, make `auto`
    keep a LOCAL class (bf16 / 0.15, logged). Raises :class:`ConfigError` when the user set them
    beside an explicit ``sync.top_fraction`` 1 in `selective` with a second tier: they would be
    accepted and ignored. Every rank plans the same group
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
    selective = cfg.mode == Mode.SELECTIVE
    # keys that act only through a LOCAL class, set by the user: `auto` keeps one for them (issue 38).
    # `method: auto` times the first steps with every tensor SYNC, then a LOCAL-class key set means a
    # LOCAL class (reducer/adaptive/method.py): nothing to refuse, nothing to resolve here.
    method_auto = cfg.method == "auto"
    local_keys = sorted(k for k in cfg.explicit_keys() if k.startswith(LOCAL_CLASS_KEYS))
    got = dict(zip(("dtype", "top_fraction"),
                   resolve_sync(s.dtype, s.top_fraction, n_groups, local_keys=bool(local_keys) and not method_auto)))
    if selective and n_groups >= 2 and got["top_fraction"] >= 1.0 and local_keys and not method_auto:
        _refuse_local_keys(local_keys)
    if auto:
        cfg = _with(cfg, "sync", got)
        if selective:
            said = ", ".join(f"sync.{k} auto -> {got[k]}" for k in auto)
            if local_keys and not method_auto and n_groups >= MANY_GROUPS and "top_fraction" in auto:
                notes.insert(0, f"{said} at {n_groups} groups: {', '.join(local_keys)} set, so a LOCAL class "
                                "is kept for it to act on (without LOCAL-class keys, from "
                                f"{MANY_GROUPS} groups on every tensor is SYNC on the int8 wire)")
            else:
                notes.insert(0, f"{said} at {n_groups} groups (from {MANY_GROUPS} on, every tensor is SYNC on the "
                                "int8 wire: docs/convergence.md, \"Many islands\")"
                                + ("; method auto chooses after timing the first steps" if method_auto else ""))
    return cfg, ("topo_align: " + "; ".join(notes)) if notes else None


def _refuse_local_keys(unused: list[str]) -> None:
    """Refuse the LOCAL-class keys the user set beside an explicit ``sync.top_fraction`` 1 (see
    ``resolved_config``): every tensor is SYNC, so they would be accepted and ignored."""
    it = "it" if len(unused) == 1 else "them"
    raise ConfigError(
        f"topo_align: {', '.join(unused)} set, but every tensor is SYNC (sync.top_fraction = 1.0), so nothing is "
        f"LOCAL for {it} to act on; set sync.top_fraction below 1 (or leave it auto: auto keeps a LOCAL class "
        f"when LOCAL-class keys are set) or remove {it}")
