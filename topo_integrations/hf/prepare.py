"""``Accelerator.prepare`` with topo-align on every path it can act on (docs/hf.md).

``patch()`` (called by ``install()``) wraps three of accelerate's functions, once per process:

* ``Accelerator.prepare``: decides the path (paths.py) when a model is among the arguments and,
  where topo-align cannot act, says so once per accelerator in a warning line naming the path and
  why. DeepSpeed: ``topo_integrations.deepspeed.install()`` (accelerate looks ``deepspeed.initialize``
  up at call time) and, when the DeepSpeed config has no block, the one ``install()`` got. After the
  stock ``prepare``: every ``DistributedDataParallel`` it made gets the DDP comm hook
  (``TopoAlignHookState``), every optimizer it prepared over an attached model an optimizer step
  post-hook that counts the step and reconciles (``after_optimizer_step``), and rank 0 logs the
  start line.
* ``fsdp2_prepare_model`` (FSDP2): accelerate's ``fully_shard`` calls shard on
  ``accelerator.torch_device_mesh[parallelism_config.fsdp_dim_names]``; for the call it sees the
  island mesh and its ``"shard"`` row, so every module is sharded inside its island, and
  ``topo_integrations.fsdp.apply`` then hooks the cross-island step.
* ``Accelerator.clip_grad_norm_``: in `selective` the norm every rank agrees on (LOCAL gradients
  differ between islands; torch's norm would clip each island differently).
* ``Accelerator.save_state``: reconciles first (identical replicas are saved); a save/load pre-hook
  writes and reads this rank's engine state in ``<dir>/topo_align/rank<N>.pt`` (DDP, FSDP2).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

from .attach import Attached, attached, live, register
from .console import say
from .paths import Decision, decide, ds_block

__all__ = ["patch", "unpatch", "patched", "set_config", "config", "decision_of", "inject_block"]

log = logging.getLogger("topo_align")

_ORIGINAL: dict[str, object] = {}
_CFG: dict[str, object] = {"cfg": None}
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Accelerator -> its Decision (and the lines already said), so each is said once."""


def set_config(cfg) -> None:
    _CFG["cfg"] = cfg


def config():
    return _CFG["cfg"]


def decision_of(accelerator) -> Decision | None:
    """What ``prepare()`` decided for ``accelerator`` (None before a model was prepared)."""
    rec = _DECISIONS.get(accelerator)
    return rec["decision"] if rec else None


def inject_block(accelerator, cfg) -> None:
    """The block ``install()`` got into a DeepSpeed config that has none (keys the user set; an
    ``auto`` value is left out: accelerate takes any "auto" for its own placeholder, and each such
    key's default is ``auto``)."""

    def drop_auto(d):
        return {k: drop_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}

    accelerator.state.deepspeed_plugin.deepspeed_config["topo_align"] = drop_auto(
        cfg.model_dump(mode="json", exclude_unset=True))


def _decide(accelerator, args) -> Decision | None:
    import torch.nn as nn

    rec = _DECISIONS.get(accelerator)
    if rec is not None:
        return rec["decision"]
    if not any(isinstance(a, nn.Module) for a in args):
        return None
    cfg = config()
    d = decide(accelerator, cfg)
    _DECISIONS[accelerator] = {"decision": d}
    if not d.act:
        say(f"topo-align: not active on Accelerate {d.path}: {d.why}", warning=True)
    return d


def _prepare(self, *args, device_placement=None):
    d = _decide(self, args)
    if d is not None and d.act and d.kind == "deepspeed":
        import topo_integrations.deepspeed as tds

        tds.install()
        if not ds_block(self):
            inject_block(self, config())
    result = _ORIGINAL["prepare"](self, *args, device_placement=device_placement)
    if d is not None and d.act:
        _after_prepare(self, d, result if isinstance(result, tuple) else (result,))
    return result


def _after_prepare(accelerator, d: Decision, result: tuple) -> None:
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    for model in result:
        if not isinstance(model, nn.Module) or attached(model) is not None:
            continue
        if d.kind == "ddp" and isinstance(model, DistributedDataParallel):
            _hook_ddp(model, d)
        elif d.kind == "deepspeed" and getattr(model, "topo_align", None) is not None:
            att = register(Attached("deepspeed", f"Accelerate {d.path}", model.topo_align, model))
            say(att.start_line())
    for opt in list(accelerator._optimizers):
        _hook_optimizer(opt)
    mine = _attached_of(accelerator)
    if any(att.saves_beside for att in mine) and not getattr(accelerator, "_topo_align_state_hooks", False):
        accelerator.register_save_state_pre_hook(lambda _m, _w, out_dir: [a.save(out_dir) for a in
                                                                          _attached_of(accelerator)])
        accelerator.register_load_state_pre_hook(lambda _m, in_dir: [a.load(in_dir) for a in
                                                                     _attached_of(accelerator)])
        accelerator._topo_align_state_hooks = True
    rec = _DECISIONS.get(accelerator, {})
    # `method: auto` may enter a LOCAL class after its timed steps: warn now, not after the switch
    if getattr(accelerator, "scaler", None) is not None and not rec.get("scaler_said") and any(
            a.engine.selective and (a.engine.sync_fraction() < 1 or a.engine.method is not None) for a in mine):
        rec["scaler_said"] = True
        say("topo-align: fp16 with a GradScaler and a LOCAL class (or method auto, which may choose one): each "
            "island finds its own overflows in its LOCAL gradients, so the islands may skip different steps; use "
            "bf16 (no scaler) with a LOCAL class", warning=True)


def _attached_of(accelerator) -> list[Attached]:
    out = []
    for m in accelerator._models:
        att = attached(m)
        if att is not None and att not in out:
            out.append(att)
    return out


def _hook_ddp(model, d: Decision) -> None:
    from ..torch import TopoAlignHookState, topo_align_hook

    state = TopoAlignHookState(model, config())
    model.register_comm_hook(state, topo_align_hook)
    att = register(Attached("ddp", f"Accelerate {d.path}", state, model))
    say(att.start_line())


def _hook_optimizer(opt) -> None:
    """An optimizer step post-hook on the torch optimizer inside accelerate's wrapper, for the
    attached model whose parameters it steps (DeepSpeed steps its own)."""
    inner = getattr(opt, "optimizer", opt)
    if getattr(inner, "_topo_align_hooked", False):
        return
    ids = {id(p) for g in inner.param_groups for p in g["params"]}
    for att in live():
        if att.path == "deepspeed" or att.optimizer is not None:
            continue
        if ids & {id(p) for p in att.model.parameters()}:
            att.optimizer = inner
            inner.register_step_post_hook(lambda o, _a, _k, att=att: att.after_optimizer_step(o))
            inner._topo_align_hooked = True
            return



def _fsdp2_prepare_model(accelerator, model):
    """accelerate's ``fsdp2_prepare_model`` sharding on the islands, then the FSDP2 adapter."""
    d = decision_of(accelerator)
    if d is None or not d.act or d.kind != "fsdp2":
        return _ORIGINAL["fsdp2_prepare_model"](accelerator, model)
    from .. import fsdp as topo_fsdp

    cfg = config()
    groups = topo_fsdp.island_groups(cfg)
    mesh = topo_fsdp.island_mesh(groups, accelerator.device.type)
    with _island_mesh(accelerator, mesh):
        model = _ORIGINAL["fsdp2_prepare_model"](accelerator, model)
    ta = topo_fsdp.apply(model, groups, cfg)
    att = register(Attached("fsdp2", f"Accelerate {d.path}", ta, model))
    say(att.start_line())
    return model


class _IslandDims:
    """What ``fsdp2_prepare_model`` reads of a ParallelismConfig: the mesh dimensions to shard on."""

    fsdp_dim_names = ("shard",)


@contextlib.contextmanager
def _island_mesh(accelerator, mesh):
    state = accelerator.state
    saved = (state.device_mesh, state.parallelism_config)
    state.device_mesh, state.parallelism_config = mesh, _IslandDims()
    try:
        yield
    finally:
        state.device_mesh, state.parallelism_config = saved


def _clip_grad_norm_(self, parameters, max_norm, norm_type=2):
    parameters = list(parameters)
    att = _owner(self, parameters)
    if att is None or att.path == "deepspeed" or not att.engine.selective:
        return _ORIGINAL["clip_grad_norm_"](self, parameters, max_norm, norm_type)
    if float(norm_type) != 2.0:
        raise ValueError(f"topo_align: clip_grad_norm_ with norm_type={norm_type} in `selective`: the norm every "
                         "rank agrees on is the 2-norm; clip with norm_type=2")
    self.unscale_gradients()
    return att.clip_grad_norm_(max_norm)


def _owner(accelerator, parameters) -> Attached | None:
    ids = {id(p) for p in parameters}
    for model in accelerator._models:
        att = attached(model)
        if att is not None and ids and ids <= {id(p) for p in att.model.parameters()}:
            return att
    return None


def _save_state(self, *args, **kwargs):
    for att in _attached_of(self):  # every rank calls save_state: identical replicas are saved
        att.reconcile()
    return _ORIGINAL["save_state"](self, *args, **kwargs)


_WRAPPED = {"prepare": _prepare, "clip_grad_norm_": _clip_grad_norm_, "save_state": _save_state}


def patch() -> None:
    """Wrap ``Accelerator.prepare``, ``clip_grad_norm_``, ``save_state`` and accelerate's
    ``fsdp2_prepare_model`` (idempotent)."""
    if _ORIGINAL:
        return
    import accelerate.accelerator as aa

    for name, fn in _WRAPPED.items():
        _ORIGINAL[name] = getattr(aa.Accelerator, name)
        setattr(aa.Accelerator, name, fn)
    _ORIGINAL["fsdp2_prepare_model"] = aa.fsdp2_prepare_model
    aa.fsdp2_prepare_model = _fsdp2_prepare_model


def unpatch() -> None:
    if not _ORIGINAL:
        return
    import accelerate.accelerator as aa

    for name in _WRAPPED:
        setattr(aa.Accelerator, name, _ORIGINAL[name])
    aa.fsdp2_prepare_model = _ORIGINAL["fsdp2_prepare_model"]
    _ORIGINAL.clear()


def patched() -> bool:
    return bool(_ORIGINAL)
