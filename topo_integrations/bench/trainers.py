"""The benchmarked systems, one class each (docs/benchmarks.md): the same GPT, AdamW schedule and
clipping (bench/base.py) on a plain PyTorch loop, PyTorch DDP (optionally its fp16 or PowerSGD hook),
post-local SGD, torchft's DiLoCo and LocalSGD (optional), topo-align's GroupedReducer in each mode;
FSDP2, DeepSpeed ZeRO and megatron-core, with and without topo-align, are in bench/sharded.py.
:func:`build` makes the one a spec names; the worker (worker.py) drives it. Frameworks are imported
only inside these classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Plain, block, engine_info, lr_at_step, version
from .sharded import FSDP2, DeepSpeed, Megatron
from .systems import LOCALSGD_PERIOD, TOPO_MODES, powersgd_payload, powersgd_rank, torchft_period

__all__ = ["build", "lr_at_step"]

_block = block
"""The ``topo_align`` block of a topo-align system (bench/systems.py ``topo_block``: the theory plans from it too)."""


class _DDP(Plain):
    """DDP, plain, with its fp16 hook, or with PowerSGD (``ddp-powersgd-rN``: rank N, error feedback and
    warm start, plain all-reduces for the warm-up's steps, then compressed): PowerSGD chains three
    all-reduces per bucket, matched by order on gloo, so all gradients go in one bucket."""

    def __init__(self, spec: dict, hook: str | None = None):
        super().__init__(spec)
        from torch.nn.parallel import DistributedDataParallel

        one = {"bucket_cap_mb": 1 << 20} if hook == "powersgd" else {}  # one bucket: larger than any model here
        self.net = DistributedDataParallel(self.model, **one)
        self.psgd = None
        if hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.net.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            self.psgd = ps.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank(spec["system"]),
                                         start_powerSGD_iter=max(2, spec["localsgd_warmup"]), use_error_feedback=True,
                                         warm_start=True, random_seed=spec["seed"])
            self.net.register_comm_hook(self.psgd, ps.powerSGD_hook)

    def info(self) -> dict:
        if self.psgd is None:
            return {}
        shapes = [tuple(p.shape) for p in self.model.parameters() if p.requires_grad]
        return {"powersgd_rank": self.psgd.matrix_approximation_rank, "powersgd_start": self.psgd.start_powerSGD_iter,
                "powersgd_payload": powersgd_payload(shapes, self.psgd.matrix_approximation_rank,
                                                     self.psgd.min_compression_rate)}


class _PostLocalSGD(Plain):
    """DDP with post_localSGD_hook (all-reduce inside the subgroup after ``localsgd_warmup`` global
    steps) and PostLocalSGDOptimizer(AdamW, HierarchicalModelAverager({H: world}))."""

    def __init__(self, spec: dict):
        from collections import OrderedDict

        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(spec)
        world = dist.get_world_size()
        groups = spec["groups"] or [[r] for r in range(world)]
        self.subgroup, _ = dist.new_subgroups_by_enumeration(groups)
        self.warmup = spec["localsgd_warmup"]
        self.H = spec.get("averaging_period") or spec["reconcile_interval"] or LOCALSGD_PERIOD
        self.net = DistributedDataParallel(self.model)
        self.state = PostLocalSGDState(process_group=None, subgroup=self.subgroup, start_localSGD_iter=self.warmup)
        self.net.register_comm_hook(self.state, post_localSGD_hook)
        averager = HierarchicalModelAverager(period_group_size_dict=OrderedDict([(self.H, world)]),
                                             warmup_steps=self.warmup)
        self.opt = PostLocalSGDOptimizer(optim=self.opt, averager=averager)
        self.steps = 0

    def step(self, b: dict) -> float:
        out = super().step(b)
        self.steps += 1
        return out

    def info(self) -> dict:
        avg = sum(1 for t in range(self.steps) if t >= self.warmup and t % self.H == 0)
        return {"localsgd_warmup": self.warmup, "averaging_period": self.H, "averages": avg,
                "subgroup_size": len((self.spec["groups"] or [[0]])[0])}


DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
"""DiLoCo's outer optimizer: SGD with Nesterov momentum, the DiLoCo paper's values (arXiv 2311.08105)
and those of torchft's own DiLoCo tests."""


def _local_ip() -> str:
    """This rank's address on the route to MASTER_ADDR (its emulated node's interface; 127.0.0.1
    on one machine): what the other nodes reach its torchft servers at."""
    import os
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))  # UDP: no packet is sent
        return s.getsockname()[0]


class _TorchFT(Plain):
    """torchft's own outer loop (someone else's implementation of local SGD / DiLoCo): one torchft
    replica group per topology group (a node), PyTorch DDP inside it every step, and every H steps
    torchft's ``DiLoCo`` (pseudo-gradient all-reduce across the groups + outer Nesterov SGD) or
    ``LocalSGD`` (parameter average) through its ``Manager`` and ``ProcessGroupGloo``. The
    lighthouse (quorum server) runs in rank 0's process, each group's TCPStore in its first rank's;
    every group joins every quorum (``min_replica_size`` = groups), weights start equal (same seed;
    ``init_sync=False``). No global warm-up: torchft has none."""

    def __init__(self, spec: dict):
        import datetime

        from torch.nn.parallel import DistributedDataParallel
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo, LocalSGD
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        super().__init__(spec)
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = spec["groups"] or [[r] for r in range(world)]
        self.subgroup, _ = dist.new_subgroups_by_enumeration(groups)
        gid = next(i for i, g in enumerate(groups) if rank in g)
        grank = groups[gid].index(rank)
        ip = _local_ip()
        self.lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=len(groups)) if rank == 0 else None
        self.store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False) if grank == 0 else None
        mine = {"ip": ip, "store_port": self.store.port if self.store else None,
                "lighthouse_port": int(self.lighthouse.address().rsplit(":", 1)[1]) if self.lighthouse else None}
        every = [None] * world
        dist.all_gather_object(every, mine)
        first = every[groups[gid][0]]
        timeout = datetime.timedelta(seconds=spec["timeout_s"])
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=len(groups), use_async_quorum=False, init_sync=False, rank=grank,
            world_size=len(groups[gid]), store_addr=first["ip"], store_port=first["store_port"],
            lighthouse_addr=f"http://{every[0]['ip']}:{every[0]['lighthouse_port']}", replica_id=f"node{gid}",
            hostname=ip, port=0, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        if len(groups[gid]) > 1:
            self.net = DistributedDataParallel(self.model, process_group=self.subgroup)
        self.H = torchft_period(spec["system"]) or spec["reconcile_interval"] or LOCALSGD_PERIOD
        self.kind = "diloco" if spec["system"].startswith("torchft-diloco") else "localsgd"
        if self.kind == "diloco":
            self.outer = torch.optim.SGD(self.model.parameters(), **DILOCO_OUTER)
            self.wrapper = DiLoCo(self.manager, [self.model], self.opt, self.outer, sync_every=self.H,
                                  pin_memory=False)
        else:
            self.wrapper = LocalSGD(self.manager, self.model, self.opt, sync_every=self.H)
        self.wrapper.__enter__()  # registers its optimizer hooks: opt.step() runs torchft's outer loop
        self.groups = len(groups)

    def info(self) -> dict:
        out = {"torchft": self.kind, "sync_every": self.H, "syncs": self.manager.current_step(),
               "replica_groups": self.groups, "torchft_version": version("torchft")}
        if self.kind == "diloco":
            out["outer_optimizer"] = "SGD " + ", ".join(f"{k}={v}" for k, v in DILOCO_OUTER.items())
        return out


class _Reducer(Plain):
    """GroupedReducer (docs/reducer.md) on the plain loop: backward -> finish_grad_sync -> clip on the
    agreed norm -> step -> after_optimizer_step(optimizer)."""

    def __init__(self, spec: dict, mode: str):
        from ..config import TopoAlignConfig
        from ..torch import GroupedReducer

        super().__init__(spec)
        self.cfg = TopoAlignConfig.model_validate(block(spec, mode, async_reconcile=spec["async_reconcile"]))
        self.reducer = GroupedReducer(self.model, self.cfg)

    def _clip(self) -> None:
        if self.spec["clip"] <= 0:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local_sq = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        norm = float(self.reducer.global_grad_norm_sq(local_sq)) ** 0.5
        scale = self.spec["clip"] / (norm + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)

    def step(self, b: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(b["tokens"], b["labels"], b["loss_mask"])
        loss.backward()
        self.reducer.finish_grad_sync()
        self._clip()
        self.opt.step()
        self.reducer.after_optimizer_step(self.opt)
        return float(loss.detach())

    def drain(self) -> None:
        # An asynchronous reconciliation started at the last step is still on the wire; its bytes
        # belong to this window (theory counts steps // H of them), so wait for it (not apply it).
        self.reducer.engine.drain()

    def before_eval(self) -> None:
        self.reducer.reconcile(self.opt)

    def info(self) -> dict:
        return engine_info(self.reducer.stats(), self.reducer.engine.cfg)  # `method`: auto's choice (topo-auto)


def build(spec: dict):
    key = spec["system"]
    if key == "ddp":
        return _DDP(spec)
    if key == "ddp-fp16":
        return _DDP(spec, hook="fp16")
    if key.startswith("ddp-powersgd-r"):
        return _DDP(spec, hook="powersgd")
    if torchft_period(key) is not None:  # torchft-diloco, torchft-localsgd and their -hN variants
        return _TorchFT(spec)
    if key == "post-local-sgd" or spec.get("averaging_period"):  # post-local-sgd-hN: averaging_period N
        return _PostLocalSGD(spec)
    if key in ("topo-flat", "topo-hier", "topo-selective", "topo-hier-bf16", "topo-auto"):
        return _Reducer(spec, TOPO_MODES[key])
    if key == "fsdp2-hsdp":
        return FSDP2(spec)
    if key in ("fsdp2-topo-hier", "fsdp2-topo-selective"):
        return FSDP2(spec, TOPO_MODES[key])
    if key in ("ds-zero0", "ds-zero2"):
        return DeepSpeed(spec, 0 if key == "ds-zero0" else 2)
    if key in ("ds-topo-hier", "ds-topo-selective"):
        return DeepSpeed(spec, 0, "hierarchical" if key == "ds-topo-hier" else "selective")
    if key == "ds-topo-selective-z1":
        return DeepSpeed(spec, 1, "selective")
    if key in ("megatron-ddp", "megatron-distopt"):
        return Megatron(spec, distopt=key == "megatron-distopt")
    raise ValueError(f"system {key!r}: unknown")

