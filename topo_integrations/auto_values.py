"""What each `auto` key of the ``topo_align`` block becomes at the engine's group count.

Plain functions of the group count every rank shares (so every rank takes the same values): the
engine applies them once when it is built (reducer/classes/auto_sync.py), `topo-align simulate` and the
cost-model scripts price the same values.
"""

from __future__ import annotations

__all__ = ["MANY_GROUPS", "SYNC_AUTO", "resolve_sync", "LOCAL_CLASS_KEYS", "keeps_local_class",
           "local_class_defaults", "BUCKET_MB_MIN",
           "BUCKET_MB_PER_GROUP", "resolve_bucket_mb", "METHOD_KEYS", "keys_without_effect"]

# `auto` sync.dtype / top_fraction below (False) / from (True) MANY_GROUPS groups (convergence.md "Many islands"):
# from 2 groups on, i.e. wherever `selective` has a second tier; the bf16 / 0.15 row is what an
# engine without one records (its mode is then flat and no value acts)
MANY_GROUPS = 2
SYNC_AUTO: dict[bool, tuple[str, float]] = {False: ("bf16", 0.15), True: ("int8", 1.0)}


def resolve_sync(dtype: str, top_fraction: float | str, n_groups: int, *,
                 local_keys: bool = False) -> tuple[str, float]:
    """``(sync.dtype, sync.top_fraction)`` with each ``"auto"`` taken at ``n_groups`` groups.

    ``local_keys``: the user set a key that acts only through a LOCAL class (``LOCAL_CLASS_KEYS``);
    `auto` then keeps one (the LOCAL-class values, bf16 / 0.15) at every group count, instead of
    making every tensor SYNC and leaving the user's key nothing to act on."""
    d, f = SYNC_AUTO[n_groups >= MANY_GROUPS and not local_keys]
    return (d if dtype == "auto" else dtype), float(f if top_fraction == "auto" else top_fraction)


# Keys that act only through a LOCAL class: how tensors are ranked into it (importance.*, the
# always-SYNC rules) and how it is reduced and reconciled (local.*). Where every tensor is SYNC they
# have nothing to act on. Set by the user, they make `auto` keep a LOCAL class (resolve_sync's
# local_keys); with an explicit sync.top_fraction 1 the engine refuses them (reducer/classes/auto_sync.py).
# A launcher's own defaults for them apply only where a LOCAL class can exist (keeps_local_class).
LOCAL_CLASS_KEYS = ("local.", "importance.", "sync.last_n_layers", "sync.always_sync", "sync.layer_pattern")


def keeps_local_class(top_fraction: float | str) -> bool:
    """Whether ``sync.top_fraction`` leaves room for a LOCAL class at any group count that has a
    second tier: a number below 1 (``auto`` is 1 from ``MANY_GROUPS`` groups on)."""
    return top_fraction != "auto" and float(top_fraction) < 1.0


def local_class_defaults(defaults: dict, top_fraction: float | str) -> dict:
    """A launcher's own defaults (dotted keys) without the LOCAL-class ones where
    ``sync.top_fraction`` leaves no LOCAL class: set there, the engine would refuse them."""
    if keeps_local_class(top_fraction):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if not k.startswith(LOCAL_CLASS_KEYS)}


# `auto` communication.bucket_size_mb: DDP's 25 MiB, or BUCKET_MB_PER_GROUP per group on the rail if more
BUCKET_MB_MIN, BUCKET_MB_PER_GROUP = 25.0, 4.0


def resolve_bucket_mb(bucket_size_mb: float | str, n_groups: int) -> float:
    """``communication.bucket_size_mb`` in MiB with ``"auto"`` taken at ``n_groups`` groups."""
    if bucket_size_mb != "auto":
        return float(bucket_size_mb)
    return min(65536.0, max(BUCKET_MB_MIN, BUCKET_MB_PER_GROUP * n_groups))


# `method: auto` chooses these keys at run time (sim/choose.py, docs/costmodel.md section 6); set beside
# it they would be overridden, so the block is refused (an `auto` value is no setting).
METHOD_KEYS = ("sync.dtype", "sync.top_fraction", "local.reconcile_interval")


def keys_without_effect(cfg, selective) -> str | None:
    """Why a validated ``topo_align`` block (a TopoAlignConfig) sets a key that would not act, or None:
    ``communication.inter_dtype`` in `selective` (``selective``: config's ``Mode.SELECTIVE``; SYNC
    crosses on ``sync.dtype``), and beside ``method: auto`` another mode or a key of ``METHOD_KEYS``."""
    comm = cfg.communication
    if cfg.mode == selective and "inter_dtype" in comm.model_fields_set and comm.inter_dtype != "fp32":
        return (f"communication.inter_dtype = {comm.inter_dtype!r} has no effect in mode 'selective' (the SYNC "
                "hop across groups uses sync.dtype, LOCAL gradients stay inside the group); set sync.dtype "
                "instead, or use mode 'hierarchical'")
    if cfg.method != "auto":
        return None
    if cfg.mode != selective:
        return (f"method = 'auto' chooses among settings of mode 'selective' (its exact candidate is every tensor "
                f"SYNC on an fp32 wire, which equals 'hierarchical'); mode = {cfg.mode!r} is set too: remove it, "
                "or set method 'fixed' to keep it")
    def value(key: str):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    got = [k for k in METHOD_KEYS if k in cfg.explicit_keys() and value(k) != "auto"]
    if not got:
        return None
    it = "it" if len(got) == 1 else "them"
    return (f"method = 'auto' chooses sync.dtype, sync.top_fraction and local.reconcile_interval itself "
            f"(docs/costmodel.md, section 6); {', '.join(f'{k} = {value(k)!r}' for k in got)} set too: remove "
            f"{it}, or set method 'fixed' to keep {it}")
