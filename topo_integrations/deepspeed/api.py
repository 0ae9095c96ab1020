"""``initialize`` (the signature of ``deepspeed.initialize``) and ``install`` (docs/design.md, contracts).

What ``initialize`` does, in order:
  1. find the DeepSpeed config (``config``, ``config_params`` or ``args.deepspeed_config``) and read
     its top-level ``"topo_align"`` block with :func:`.block.from_deepspeed_config`: a bad block
     raises ``ConfigError`` naming the field here, before DeepSpeed starts;
  2. no block, ``enabled: false`` or ``mode: flat``: call stock ``deepspeed.initialize`` unchanged;
  3. refuse unsupported combinations and ``topo_align`` keys the adapter cannot honour (:mod:`.support`)
     and unknown DeepSpeed versions (:mod:`.compat`);
  4. on the CPU accelerator, skip the ``deepspeed_shm_comm`` JIT build; initialise torch.distributed
     through ``deepspeed.init_distributed``;
  5. discover the topology and plan (rank 0 plans, the plan is broadcast), build the groups. A plan
     with one tier falls back to stock DeepSpeed (``fallback.on_flat_topology: flat``, logged) or
     raises (``error``);
  6. selective at ZeRO-1/2: broadcast the model over the world, scale ``train_batch_size`` to one
     island and pass an island ``mpu`` (DeepSpeed's data-parallel group = the island);
  7. stock ``deepspeed.initialize``, then swap the engine's and the ZeRO optimizer's classes for
     subclasses carrying the seams, and attach the adapter (:class:`.adapter.DeepSpeedTopo`, which
     owns the shared reducer Engine) as ``engine.topo_align``.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from typing import Any

from ..config import Mode, TopoAlignConfig
from .block import from_deepspeed_config
from .support import UnsupportedConfigError, check_supported, zero_stage

__all__ = ["initialize", "install", "uninstall", "installed", "read_block", "route_initialize"]

log = logging.getLogger("topo_align")

_ORIGINAL: dict[str, Any] = {}
_CHECKED: dict[str, str] = {}
_LOCAL = threading.local()
"""``depth`` > 0 while the adapter itself runs stock ``deepspeed.initialize`` (re-entry guard for
the source patch and for ``install()``)."""


def _call_stock(stock, kwargs):
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        return stock(**kwargs)
    finally:
        _LOCAL.depth -= 1


def route_initialize(call_args: dict):
    """Entry hook of the source patch (patches/deepspeed): DeepSpeed's own ``initialize`` calls it
    with its arguments first. Returns the adapter's result, or None to let DeepSpeed continue (no
    enabled block, or the adapter is already inside stock ``initialize``)."""
    if getattr(_LOCAL, "depth", 0) > 0:
        return None
    names = ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port",
             "mpu", "dist_init_required", "collate_fn", "config", "mesh_param", "config_params")
    kwargs = {k: call_args[k] for k in names if k in call_args}
    ds = _load(_resolve_config(kwargs.get("args"), kwargs.get("config"), kwargs.get("config_params")))
    if not isinstance(ds, dict) or "topo_align" not in ds:
        return None
    return initialize(**kwargs)


def _stock_initialize():
    import deepspeed

    return _ORIGINAL.get("initialize", deepspeed.initialize)


def _resolve_config(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return config


def _load(config) -> dict | None:
    """The config as a dict (DeepSpeed accepts a dict, a JSON/hjson path or base64 JSON)."""
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # hjson, base64, duplicate keys

    return load_ds_config(config)


def read_block(config) -> TopoAlignConfig | None:
    """The validated "topo_align" block of a DeepSpeed config (dict or path), None without one."""
    cfg = _load(config)
    return from_deepspeed_config(cfg) if isinstance(cfg, dict) else None


def initialize(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """``deepspeed.initialize`` honouring the config's top-level "topo_align" block (see module doc)."""
    stock = _stock_initialize()
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                  mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param, config_params=config_params)

    # 1-2. The block.
    raw = _resolve_config(args, config, config_params)
    ds = _load(raw)
    cfg = from_deepspeed_config(ds) if isinstance(ds, dict) else None
    if cfg is None or not cfg.enabled or cfg.mode == Mode.FLAT:
        if cfg is not None:
            log.info("topo_align: %s; DeepSpeed reduces gradients itself",
                     "enabled is false" if not cfg.enabled else "mode 'flat'")
        return _call_stock(stock, kwargs)

    # 3. What we drive.
    stage = zero_stage(ds)
    check_supported(ds, cfg, model=model, mpu=mpu)
    if "version" not in _CHECKED:
        from .compat import check_deepspeed

        _CHECKED["version"] = check_deepspeed()

    # 4. Processes.
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    from .compat import skip_shm_comm_build

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, dist_init_required=dist_init_required)

    # 5. Topology, plan, groups.
    from ..reducer.plan.discover import discover_plan
    from ..reducer.plan.groups import build_groups
    from ..reducer.wire.replicas import all_dp_layouts, broadcast_from_first

    dp_ranks_all = None
    if mpu is not None:
        dp_group = mpu.get_data_parallel_group()
        mine = sorted(tdist.get_process_group_ranks(dp_group))
        every = all_dp_layouts(dp_group, timeout_s=cfg.fallback.timeout_s)
        dp_ranks_all = [list(g) for g in sorted(tuple(sorted(g)) for g in every)]
        plan = discover_plan(cfg, dp_ranks=mine, dp_group=dp_group)
    else:
        plan = discover_plan(cfg)
    if not plan.hierarchical:
        if cfg.fallback.on_flat_topology == "error":
            raise UnsupportedConfigError(
                f"topo_align: the topology has one tier ({plan.reason}) and fallback.on_flat_topology is "
                "'error'; set it to 'flat' to run DeepSpeed's own reduction")
        if tdist.get_rank() == 0:
            log.warning("topo_align: falling back to DeepSpeed's own reduction: %s", plan.reason)
        return _call_stock(stock, kwargs)
    groups = build_groups(plan, dp_ranks_all=dp_ranks_all, timeout_s=cfg.fallback.timeout_s)
    if tdist.get_rank() == 0:
        log.info("topo_align: mode %s at ZeRO-%d: %s", cfg.mode, stage, plan.reason)

    # 6. Selective at ZeRO-1/2: DeepSpeed's DP group is the island.
    island_dp = cfg.mode == Mode.SELECTIVE and stage in (1, 2)
    if island_dp:
        from .mpu import IslandMPU

        broadcast_from_first(list(model.parameters()) + list(model.buffers()), groups)
        kwargs["mpu"] = IslandMPU(groups)
        ds = copy.deepcopy(ds)
        if "train_batch_size" in ds:
            tbs = ds["train_batch_size"]
            if not isinstance(tbs, int) or tbs % groups.inter_size:
                raise UnsupportedConfigError(
                    f"train_batch_size = {tbs!r} is not a multiple of the {groups.inter_size} islands; "
                    "selective at ZeRO-1/2 needs a global batch that splits evenly between islands")
            ds["train_batch_size"] = tbs // groups.inter_size
        kwargs.update(config=ds, config_params=None)
        if args is not None and getattr(args, "deepspeed_config", None) is not None:
            args = copy.copy(args)
            args.deepspeed_config = None
            kwargs["args"] = args
        if training_data is not None:
            kwargs["training_data"] = None  # rebuilt below with a world-sized sampler

    # 7. The engine and its seams.
    engine, opt, loader, sched = _call_stock(stock, kwargs)
    _attach(engine, cfg, groups, stage, island_dp, ds)
    if island_dp and training_data is not None:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(training_data, num_replicas=tdist.get_world_size(), rank=tdist.get_rank())
        loader = engine.deepspeed_io(training_data, data_sampler=sampler, collate_fn=collate_fn)
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, sched


def _attach(engine, cfg: TopoAlignConfig, groups, stage: int, island_dp: bool, ds: dict) -> None:
    import torch.distributed as tdist

    from .adapter import DeepSpeedTopo
    from .engine import TopoAlignEngineMixin
    from .support import ds_communication_dtype
    from .zero import HierarchicalStage3Mixin, HierarchicalZeroMixin, SelectiveZeroMixin, swap_class

    st = DeepSpeedTopo(cfg, groups, stage, engine.module, island_dp=island_dp)
    if island_dp and "local.dtype" not in cfg.explicit_keys() and tdist.get_rank() == 0:
        log.info("topo_align: selective at ZeRO-%d: DeepSpeed reduces LOCAL gradients inside the island in its "
                 "communication dtype (%s); local.dtype applies at ZeRO-0 only", stage, ds_communication_dtype(ds))
    swap_class(engine, TopoAlignEngineMixin)
    engine.topo_align = st
    opt = engine.optimizer
    if stage in (1, 2):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if isinstance(opt, BF16_Optimizer) and not island_dp:
            # bf16 + grad_accum_dtype fp32 at ZeRO-1: DeepSpeed reduces through the engine's
            # buffered all-reduce (docs/deepspeed.md), i.e. the ZeRO-0 seam.
            st.engine_reduces = True
        elif not isinstance(opt, DeepSpeedZeroOptimizer):
            raise UnsupportedConfigError(
                f"topo_align.mode = {cfg.mode!r} with zero_optimization.stage = {stage}: DeepSpeed built a "
                f"{type(opt).__name__}, not its ZeRO optimizer, which the adapter does not drive; "
                "use a torch optimizer or a DeepSpeed Adam/AdamW without offload")
        else:
            swap_class(opt, SelectiveZeroMixin if island_dp else HierarchicalZeroMixin)
            opt.topo_align = st
        if island_dp:
            opt.topo_align_param_names = {id(p): n for n, p in engine.module.named_parameters()}
            st.engine.on_reconfigure(opt.topo_reconfigured)
    elif stage == 3:
        swap_class(opt, HierarchicalStage3Mixin)
        opt.topo_align = st


def install() -> None:
    """Make plain ``deepspeed.initialize`` honour the "topo_align" block (idempotent).

    Scripts that bound ``from deepspeed import initialize`` before ``install()`` keep the stock
    function; call ``install()`` first (``python -m topo_integrations.deepspeed SCRIPT`` does).
    """
    import deepspeed

    if "initialize" in _ORIGINAL:
        return
    _ORIGINAL["initialize"] = deepspeed.initialize

    @functools.wraps(_ORIGINAL["initialize"])
    def patched(*a, **kw):
        if getattr(_LOCAL, "depth", 0) > 0:
            return _ORIGINAL["initialize"](*a, **kw)
        return initialize(*a, **kw)

    patched.__topo_align__ = True
    deepspeed.initialize = patched


def uninstall() -> None:
    import deepspeed

    if "initialize" in _ORIGINAL:
        deepspeed.initialize = _ORIGINAL.pop("initialize")


def installed() -> bool:
    return "initialize" in _ORIGINAL

