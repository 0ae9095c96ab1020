"""Every key of the ``topo_align`` block x every adapter: accepted, or refused at start naming the key
and the adapter (issue 23, "no key accepted and then ignored").

The keys come from the pydantic model (`TopoAlignConfig.model_fields`, walked), so a new key fails
`test_every_schema_key_has_a_non_default_value_here` until it is given a value and a verdict here.
Each key gets a non-default value (in mode `selective`, the mode most keys apply to; `hierarchical`
where the key belongs to it or the adapter refuses `selective`), then goes through what each adapter
checks before it builds anything:

* the config itself (`TopoAlignConfig`: a check across sections refuses `communication.inter_dtype`
  in `selective`, for every adapter and the Megatron flag alike);
* DeepSpeed ZeRO 0-3: `deepspeed.support.check_supported` (the DeepSpeed config + block);
* Megatron DDP / distributed optimizer: `megatron.refusals.check_megatron_settings` + `check_config`
  with the settings Megatron decided (`MegatronSide`);
* FSDP2: `fsdp.refusals.check_config` (the keys FSDP2 owns; its set-up refusals are checked on 4 gloo
  ranks in tests/test_fsdp.py);
* `GroupedReducer`: the config only; `topology.middle_level` that the topology cannot give is refused
  while the groups are planned (shared by every adapter), checked on 4 gloo ranks below, with the
  one key that used to do nothing there (`monitor.log_interval`: a log line every N steps).

REFUSED lists every (adapter, key) cell that must be refused, with the words the error must hold; every
other cell must be accepted. Which effect an accepted key has, per adapter, is each adapter's key
table (docs/megatron.md and docs/deepspeed.md, "Keys"; docs/reducer.md).

Observable effect: every key accepted by `GroupedReducer` is set alone on 4 gloo ranks (8 training
steps of a small layered model) and what the run exposes -- plan, classes, wire dtypes, buckets, bytes
per tier and traffic, the final parameters, reconciliations, refreshes, the adaptive record, timeouts,
log lines -- must differ from the same run without it (`test_every_accepted_key_changes_what_the_run_does`).
Everything but the bucket layout and the framework-side checks is the engine's, which the DeepSpeed and
Megatron adapters build from the same block, so an engine-level effect holds for them too; their own
seams are checked by their tests (tests/test_megatron_ddp.py, tests/test_deepspeed_*.py).
"""

from __future__ import annotations

import logging
import os

import pytest
from pydantic import BaseModel

from topo_integrations.auto_values import METHOD_KEYS
from topo_integrations.config import ConfigError, TopoAlignConfig

ADAPTERS = ("GroupedReducer", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Megatron DDP", "Megatron distopt", "FSDP2")

# A valid value other than the default, per key (companion keys where the value needs them).
NONDEFAULT: dict[str, tuple[object, dict]] = {
    "enabled": (False, {}),
    "mode": ("hierarchical", {}),
    "topology.source": ("file", {"topology.file": "topo.json"}),
    "topology.file": ("topo.json", {"topology.source": "file"}),
    "topology.group_by": ("leaf", {}),
    "topology.min_tier_ratio": (2.0, {}),
    "topology.middle_level": (True, {}),
    "topology.probe": (True, {}),
    "sync.last_n_layers": (2, {}),
    "sync.always_sync": (["head"], {}),
    "sync.top_fraction": (0.3, {}),
    "sync.dtype": ("fp32", {}),
    "sync.layer_pattern": (r"layers\.(\d+)\.", {}),
    "local.dtype": ("fp16", {}),
    "local.reconcile_interval": (8, {}),
    "local.async_reconcile": (False, {}),
    "local.reconcile_dtype": ("fp32", {}),
    "local.moments_interval": (2, {}),
    "local.moments_dtype": ("fp32", {}),
    "local.outer_momentum": (0.5, {}),
    "local.outer_lr": (0.7, {}),
    "local.promote_drift_fraction": (0.3, {}),
    "local.stream_fragments": (2, {}),
    "local.promote_window": (2, {}),
    "local.demote": (True, {}),
    "importance.method": ("magnitude", {}),
    "importance.ema_decay": (0.9, {}),
    "importance.refresh_interval": (50, {}),
    "communication.inter_dtype": ("bf16", {}),
    "communication.error_feedback": (False, {}),
    "communication.bucket_size_mb": (5.0, {}),
    "communication.overlap": (False, {}),
    "fallback.timeout_s": (60.0, {}),
    "fallback.on_flat_topology": ("error", {}),
    "adaptive.enabled": (True, {}),
    "adaptive.check_interval": (10, {}),
    "adaptive.slowdown_factor": (2.0, {}),
    "adaptive.window": (5, {}),
    "monitor.log_interval": (3, {}),
    "monitor.check_collectives": (True, {}),
    "method": ("auto", {}),
}

MEGATRON = ("Megatron DDP", "Megatron distopt")
DEEPSPEED = ("ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3")
SELECTIVE_ONLY = ("sync.", "local.", "importance.")

REFUSED: dict[tuple[str, str], tuple[str, ...]] = {
    **{(a, "communication.inter_dtype"): ("communication.inter_dtype = 'bf16'", "mode 'selective'")
       for a in ADAPTERS},
    **{(a, "communication.bucket_size_mb"): ("communication.bucket_size_mb = 5.0", "adapter")
       for a in (*DEEPSPEED, *MEGATRON)},
    **{(a, "communication.overlap"): ("communication.overlap = False", "adapter") for a in (*DEEPSPEED, *MEGATRON)},
    ("Megatron distopt", "local.dtype"): ("local.dtype = 'fp16'", "the Megatron adapter"),
    ("ZeRO-1", "local.dtype"): ("local.dtype = 'fp16'", "DeepSpeed adapter"),
    ("ZeRO-2", "local.dtype"): ("local.dtype = 'fp16'", "DeepSpeed adapter"),
    ("ZeRO-3", "topology.middle_level"): ("topology.middle_level = True", "DeepSpeed adapter", "ZeRO stage 3"),
    # FSDP2 owns its buckets and when it reduces; LOCAL gradients ride its island reduce-scatter; with the
    # model sharded per island, turning the plugin off would leave the islands unreduced (fsdp/refusals.py)
    **{("FSDP2", k): (f"{k} = {NONDEFAULT[k][0]!r}", "FSDP2 adapter")
       for k in ("enabled", "communication.bucket_size_mb", "communication.overlap", "local.dtype")},
    # `method: auto` chooses among settings of `selective`: at ZeRO-3, checked in `hierarchical`, the
    # config refuses it first
    ("ZeRO-3", "method"): ("method = 'auto'", "mode 'selective'"),
    # ZeRO-3 refuses the mode the selective keys belong to (they are checked in `selective` there).
    **{("ZeRO-3", k): ("topo_align.mode = 'selective' with zero_optimization.stage = 3",)
       for k in NONDEFAULT if k.startswith(SELECTIVE_ONLY)},
}


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _leaf_keys(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _mode(adapter: str, key: str) -> str:
    if key == "communication.inter_dtype":
        return "selective"  # the cell under test: refused there (it works in hierarchical, checked below)
    if adapter == "ZeRO-3" and not key.startswith(SELECTIVE_ONLY):
        return "hierarchical"  # ZeRO-3 refuses selective: check the key where it can apply
    return "selective"


def _start(adapter: str, key: str) -> None:
    """What ``adapter`` checks at start for ``key`` set to its non-default value."""
    value, companions = NONDEFAULT[key]
    overrides = {"mode": _mode(adapter, key), **companions, key: value}
    cfg = TopoAlignConfig().with_overrides(overrides)
    if adapter.startswith("ZeRO-"):
        from topo_integrations.deepspeed.support import check_supported

        check_supported({"zero_optimization": {"stage": int(adapter[-1])}, "train_batch_size": 8}, cfg)
    elif adapter in MEGATRON:
        from topo_integrations.megatron.refusals import MegatronSide, check_config, check_megatron_settings

        side = MegatronSide(use_distributed_optimizer=adapter.endswith("distopt"), overlap_grad_reduce=True)
        check_megatron_settings(cfg, side)
        check_config(cfg, side)
    elif adapter == "FSDP2":
        from topo_integrations.fsdp.refusals import check_config as check_fsdp

        check_fsdp(cfg)


def test_every_schema_key_has_a_non_default_value_here():
    keys = _leaf_keys(TopoAlignConfig)
    assert sorted(NONDEFAULT) == sorted(keys), "give every new key a value and a verdict in this file"
    defaults = TopoAlignConfig()
    for key in keys:
        obj = defaults
        for part in key.split("."):
            obj = getattr(obj, part)
        assert NONDEFAULT[key][0] != obj, key


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_every_key_is_accepted_or_refused_at_start_naming_it(adapter):
    accepted, refused = [], []
    for key in NONDEFAULT:
        want = REFUSED.get((adapter, key))
        try:
            _start(adapter, key)
        except (ConfigError, ValueError) as exc:
            msg = str(exc)
            assert want is not None, f"{adapter}: {key} refused unexpectedly: {msg}"
            assert all(w in msg for w in want), f"{adapter}: {key}: {msg!r} lacks {want}"
            refused.append(key)
        else:
            assert want is None, f"{adapter}: {key} set to {NONDEFAULT[key][0]!r} was accepted; expected a refusal"
            accepted.append(key)
    assert len(accepted) + len(refused) == len(NONDEFAULT)


def test_inter_dtype_is_accepted_where_it_applies():
    for adapter in ("GroupedReducer", "ZeRO-0", "ZeRO-3", *MEGATRON):
        cfg = TopoAlignConfig().with_overrides({"mode": "hierarchical", "communication.inter_dtype": "bf16"})
        assert cfg.communication.inter_dtype == "bf16", adapter


# -- on 4 gloo ranks: the planned-topology refusal and GroupedReducer's log line ----------------------

def _rank_main(rank: int, world: int) -> dict:
    import torch

    from topo_integrations.torch import GroupedReducer

    os.environ["TOPO_ALIGN_HOSTNAME"] = f"node{rank // 2}"  # 2 virtual nodes x 2 ranks
    out: dict = {}
    try:
        GroupedReducer(torch.nn.Linear(4, 4), TopoAlignConfig().with_overrides({"topology.middle_level": True}))
    except ValueError as exc:
        out["middle_level"] = str(exc)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("topo_align").addHandler(Keep())
    logging.getLogger("topo_align").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    red = GroupedReducer(model, TopoAlignConfig().with_overrides({"mode": "hierarchical", "monitor.log_interval": 2}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        red.finish_grad_sync()
        opt.step()
        opt.zero_grad()
        red.after_optimizer_step(opt)
    out["log"] = [r for r in records if "GroupedReducer step" in r]
    red.close()
    out["effects"] = _effects(rank, records)
    return out


# Values that show within 8 steps where NONDEFAULT's would not (e.g. a refresh interval of 50).
EFFECT_VALUE = {"importance.refresh_interval": 4, "local.reconcile_interval": 4, "adaptive.check_interval": 2,
                "monitor.log_interval": 3,
                "topology.min_tier_ratio": 20.0,             # above the default tiers' ratio: one flat tier
                "sync.layer_pattern": r"layers\.([0-3])\.",  # only layers 0-3 count: "last N" moves
                "communication.bucket_size_mb": 0.001}       # several buckets for this small model
# Run with these in baseline and variant alike, so the key's effect can show (e.g. ema_decay needs a refresh).
EFFECT_COMPANIONS = {"importance.ema_decay": {"importance.refresh_interval": 2, "local.async_reconcile": False},
                     "importance.method": {"importance.refresh_interval": 2, "local.async_reconcile": False},
                     # moments at every reconciliation: the first one of a layout is exact, the next on the wire
                     "local.moments_dtype": {"local.moments_interval": 1},
                     # a budget of about one layer, filled by the first promotion: a later one must displace
                     "local.demote": {"local.promote_drift_fraction": 0.13},
                     "adaptive.slowdown_factor": {"adaptive.enabled": True},
                     "adaptive.window": {"adaptive.enabled": True},
                     "adaptive.check_interval": {"adaptive.enabled": True},
                     # a flat topology, where the fallback policy decides
                     "fallback.on_flat_topology": {"topology.min_tier_ratio": 20.0}}
NOT_ON_THIS_WORLD = {"topology.middle_level": "refused on this topology (no leaves), checked above",
                     "communication.inter_dtype": "refused in selective for every adapter (the config)"}


def _signature(red, records: list[str]) -> dict:
    import torch

    e = red.engine
    st = red.stats()
    ctrl = e.adaptive
    return {
        "mode": str(red.mode), "plan": red.plan.reason, "classes": sorted(e.classes.items()),
        "wire": (str(e.sync_dtype), str(e.local_dtype), str(e.reconciler.dtype), e.wire.error_feedback),
        "reconcile": (e.reconciler.interval, e.reconciler.reconciles, e.policy.last_refresh), "buckets": st["buckets"],
        "bytes": st["total"]["bytes"], "timeout": red.groups.timeout_s, "threaded": e.dispatcher.threaded,
        "check": e.dispatcher.trace is not None,
        "fisher": float(e.importance.ema.sum()),
        "adaptive": None if ctrl is None else (len(ctrl.checks), ctrl.policy.cfg.window,
                                               ctrl.policy.cfg.slowdown_factor),
        "params": torch.cat([p.detach().reshape(-1) for p in red._params.values()]).sum().item(),
        "log": len([r for r in records if "GroupedReducer step" in r]),
        "from_hooks": st["launched_from_hooks"],
        "method": None if e.method is None else (e.method.method, e.method.interval),
    }


def _effects(rank: int, records: list[str]) -> dict:
    """For every key GroupedReducer accepts: what setting it changes in the run (key -> changed fields)."""
    # The suite turns the collective check on for every rank (tests/conftest.py); off here, so that
    # monitor.check_collectives itself has something to change.
    os.environ.pop("TOPO_ALIGN_CHECK_COLLECTIVES", None)
    import json

    import torch
    import torch.nn as nn

    from topo_integrations.torch import GroupedReducer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    # the same 2 x 2 layout as the host names, from a file
    topo_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "topologies",
                             "virtual-2x2.json")

    from topo_integrations.testing import released_groups

    def run(overrides: dict) -> dict:
        # each run's groups go away with it: idle gloo groups cost CPU (testing.released_groups)
        with released_groups():
            return _one(overrides)

    def _one(overrides: dict) -> dict:
        torch.manual_seed(0)
        model = Net()
        records.clear()
        try:
            red = GroupedReducer(model, TopoAlignConfig().with_overrides(overrides))
        except ValueError as exc:  # refused at start on this topology (e.g. fallback.on_flat_topology)
            return {"error": str(exc)}
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(8):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).pow(2).mean().backward()
            red.finish_grad_sync()
            opt.step()
            opt.zero_grad()
            red.after_optimizer_step(opt)
        sig = _signature(red, records)
        red.close()
        return sig

    base: dict = {}
    out = {}
    for key, (value, companions) in NONDEFAULT.items():
        if key in NOT_ON_THIS_WORLD or REFUSED.get(("GroupedReducer", key)):
            continue
        value = EFFECT_VALUE.get(key, value)
        companions = {**companions, **EFFECT_COMPANIONS.get(key, {})}
        if key in ("topology.source", "topology.file"):
            companions = {**companions, "topology.source": "file", "topology.file": topo_file}
            value = companions[key]
        # a LOCAL class to act on: `auto` makes every tensor SYNC at 2 groups, where the engine refuses
        # the LOCAL-class keys (reducer/classes/auto_sync.py, tests/test_config.py)
        common = {"mode": _mode("GroupedReducer", key), "local.reconcile_interval": 2,
                  "sync.top_fraction": 0.15, "sync.dtype": "bf16",
                  **{k: v for k, v in companions.items() if k not in ("topology.source", "topology.file")}}
        if key == "method":  # `auto` sets these itself (refused beside it); it chooses after 4 timed steps
            common = {k: v for k, v in common.items() if k not in METHOD_KEYS}
        ref_key = json.dumps(common, sort_keys=True, default=str)
        if ref_key not in base:
            base[ref_key] = run(common)
        got = run({**common, **companions, key: value})
        diff = sorted(k for k in set(got) | set(base[ref_key]) if got.get(k) != base[ref_key].get(k))
        out[key] = diff
    return out


@pytest.fixture(scope="module")
def world():
    from topo_integrations.testing import run_world

    return run_world(4, _rank_main, timeout=240)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_middle_level_without_leaves_is_refused_and_grouped_reducer_logs_every_n_steps(world):
    results = world
    for rank, res in enumerate(results):
        assert res["middle_level"] == (
            "topology.middle_level = true cannot be honoured with topology.source = 'auto' (middle_level needs "
            "group_by 'island', several leaves and a hierarchical plan); give a topology with "
            "leaf switches (e.g. source 'file' or 'slurm') or remove the key"), rank
        # DP position 0 logs at steps 2 and 4 (monitor.log_interval = 2); the others do not log
        assert len(res["log"]) == (2 if rank == 0 else 0), (rank, res["log"])
    assert results[0]["log"][0].startswith("topo_align: GroupedReducer step 2: hierarchical, SYNC 100.0% of elements")


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_every_accepted_key_changes_what_the_run_does(world):
    effects = world[0]["effects"]
    accepted = [k for k in NONDEFAULT if k not in NOT_ON_THIS_WORLD and not REFUSED.get(("GroupedReducer", k))]
    assert sorted(effects) == sorted(accepted)
    silent = [k for k, diff in effects.items() if not diff]
    assert not silent, f"accepted by GroupedReducer but nothing observable changed: {silent}"
