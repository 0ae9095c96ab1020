"""The benchmarked systems, one class each (docs/benchmarks.md): the same GPT, AdamW schedule and
clipping on a plain PyTorch loop, PyTorch DDP (optionally its fp16 compression hook), post-local SGD,
torchft's DiLoCo and LocalSGD (optional), topo-align's GroupedReducer in each mode, DeepSpeed ZeRO
with and without topo-align, and megatron-core DDP with and without the distributed optimizer.
:func:`build` makes the one a spec names; the worker (worker.py) drives it. Frameworks are imported
only inside these classes.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from ..config import Mode
from .systems import LOCALSGD_PERIOD, TOPO_MODES, powersgd_payload, powersgd_rank, topo_block, torchft_period

__all__ = ["build", "lr_at_step"]


# ---------------------------------------------------------------------------------------- helpers

def lr_at_step(step: int, spec: dict) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``
    (train.common.lr_at) or, ``lr_schedule: constant``, ``lr`` from then on (equal budgets)."""
    from ..train.common import lr_at

    if spec.get("lr_schedule", "cosine") == "constant":
        return spec["lr"] * min(1.0, (step + 1) / max(1, spec["warmup_steps"]))

    return lr_at(step, argparse.Namespace(warmup_steps=spec["warmup_steps"], train_steps=spec["steps"],
                                          lr=spec["lr"], min_lr_ratio=spec["min_lr_ratio"]))


def _gpt(spec: dict):
    from ..train.model import GPT, GPTConfig

    torch.manual_seed(spec["seed"])
    return GPT(GPTConfig(num_layers=spec["layers"], hidden=spec["hidden"], heads=spec["heads"],
                         seq_length=spec["seq_length"]))


def _adamw(params, spec: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.95), weight_decay=spec["weight_decay"])


# ---------------------------------------------------------------------------------------- systems

class _Plain:
    """A GPT and AdamW driven by a plain PyTorch loop; subclasses add the exchange."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.model = _gpt(spec)
        self.params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.opt = _adamw(self.model.parameters(), spec)
        self.net = self.model

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def _clip(self) -> None:
        if self.spec["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec["clip"])

    def step(self, b: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.net(b["tokens"], b["labels"], b["loss_mask"])
        loss.backward()
        self._clip()
        self.opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self, b: dict) -> float:
        self.model.eval()
        out = float(self.model(b["tokens"], b["labels"], b["loss_mask"]))
        self.model.train()
        return out

    def drain(self) -> None:
        pass

    def before_eval(self) -> None:
        pass

    def info(self) -> dict:
        return {}


class _DDP(_Plain):
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


class _PostLocalSGD(_Plain):
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


class _TorchFT(_Plain):
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
               "replica_groups": self.groups, "torchft_version": _version("torchft")}
        if self.kind == "diloco":
            out["outer_optimizer"] = "SGD " + ", ".join(f"{k}={v}" for k, v in DILOCO_OUTER.items())
        return out


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "?"


def _reconcile_info(cfg) -> dict:
    """What the byte theory of a reconciliation needs (bench/systems.py), from the engine's effective
    config (``--topo-set`` included, `auto` resolved at the planned group count)."""
    loc = cfg.local
    return {"sync_dtype": cfg.sync.dtype, "reconcile_interval": loc.reconcile_interval,
            "reconcile_dtype": loc.reconcile_dtype,
            "moments_interval": loc.moments_interval, "moments_dtype": loc.moments_dtype,
            "outer_optimizer": loc.outer_momentum > 0 or loc.outer_lr != 1.0}


_block = topo_block
"""The ``topo_align`` block of a topo-align system (bench/systems.py ``topo_block``: the theory plans from it too)."""


class _Reducer(_Plain):
    """GroupedReducer (docs/reducer.md) on the plain loop: backward -> finish_grad_sync -> clip on the
    agreed norm -> step -> after_optimizer_step(optimizer)."""

    def __init__(self, spec: dict, mode: str):
        from ..config import TopoAlignConfig
        from ..torch import GroupedReducer

        super().__init__(spec)
        self.cfg = TopoAlignConfig.model_validate(_block(spec, mode, async_reconcile=spec["async_reconcile"]))
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
        st = self.reducer.stats()
        total = st["sync_elements"] + st["local_elements"]
        return {
            "mode": st["mode"], "method": st.get("method"),  # `method: auto`'s choice (topo-auto)
            "fallback_reason": st.get("fallback_reason"),
            "sync_fraction": st["sync_elements"] / max(1, total),
            **_reconcile_info(self.reducer.engine.cfg),
            "reconciles": (st["optimizer_steps"] // self.reducer.engine.cfg.local.reconcile_interval
                           if st["mode"] == Mode.SELECTIVE else 0),
            "reducer_bytes_total": st["total"]["bytes"],
            "reducer_steps": st["steps"],
        }


class _DeepSpeed(_Plain):
    def __init__(self, spec: dict, stage: int, topo_mode: str | None = None):
        import deepspeed

        super().__init__(spec)
        world = dist.get_world_size()
        cfg = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
               "train_batch_size": spec["micro_batch"] * world, "gradient_clipping": spec["clip"],
               "steps_per_print": 10**9, "wall_clock_breakdown": False, "zero_optimization": {"stage": stage}}
        if stage > 0:
            cfg["zero_allow_untested_optimizer"] = True  # the client AdamW (no fused_adam JIT on CPU)
        if topo_mode is None:
            self.engine, self.opt, _, _ = deepspeed.initialize(model=self.model, optimizer=self.opt, config=cfg)
        else:
            from .. import deepspeed as tds

            cfg["topo_align"] = _block(spec, topo_mode, async_reconcile=spec["async_reconcile"])
            self.engine, self.opt, _, _ = tds.initialize(model=self.model, optimizer=self.opt, config=cfg)
            self.reconcile_info = _reconcile_info(self.engine.topo_align.engine.cfg)
        self.topo_mode = topo_mode

    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def step(self, b: dict) -> float:
        loss = self.engine(b["tokens"], b["labels"], b["loss_mask"])
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self, b: dict) -> float:
        self.engine.eval()
        out = float(self.engine(b["tokens"], b["labels"], b["loss_mask"]))
        self.engine.train()
        return out

    def before_eval(self) -> None:
        if self.topo_mode is not None and hasattr(self.engine, "topo_reconcile"):
            self.engine.topo_reconcile()

    def info(self) -> dict:
        if self.topo_mode is None or not hasattr(self.engine, "topo_align_stats"):
            return {}
        st = self.engine.topo_align_stats()
        keep = {k: st[k] for k in ("mode", "stage", "steps", "reconciles", "sync_fraction", "plan_reason") if k in st}
        keep.update(self.reconcile_info)
        keep["adapter_stats"] = {k: v for k, v in st.items() if k not in keep and _jsonable(v)}
        return keep


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


_PADDED_VOCAB = 264  # the byte tokenizer's 258 ids padded to a multiple of 8 (as pretrain_megatron)


class _Megatron:
    """megatron-core GPTModel (local spec, same shape), stock DistributedDataParallel, Megatron's
    optimizer and forward_backward_func, on CPU through topo-align's compatibility layer."""

    def __init__(self, spec: dict, distopt: bool):
        from ..megatron import cpu_compat

        cpu_compat.apply()
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        self.spec = spec
        instances = spec["nodes"] if distopt else 1
        ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
        model_parallel_cuda_manual_seed(spec["seed"])
        torch.manual_seed(spec["seed"])
        tcfg = TransformerConfig(
            num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
            ffn_hidden_size=4 * spec["hidden"], hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, init_method_std=0.02, gradient_accumulation_fusion=False,
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, apply_rope_fusion=False)
        self.model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=_PADDED_VOCAB, max_sequence_length=spec["seq_length"],
                              position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False)
        self.params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                use_distributed_optimizer=distopt,
                                                num_distributed_optimizer_instances=instances)
        self.ddp = DistributedDataParallel(tcfg, ddp_cfg, self.model)
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = self.ddp.no_sync
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=spec["lr"], weight_decay=spec["weight_decay"], adam_beta1=0.9, adam_beta2=0.95,
            clip_grad=spec["clip"], use_distributed_optimizer=distopt), [self.ddp])
        self.fb = get_forward_backward_func()
        seq = spec["seq_length"]
        self.mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        self.pos = torch.arange(seq).unsqueeze(0)
        self.instances = instances

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    @staticmethod
    def _masked(loss_mask, output):
        m = loss_mask.reshape(-1).float()
        loss = (output.float().reshape(-1) * m).sum() / m.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}

    def step(self, b: dict) -> float:
        from functools import partial

        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

        def forward_step(data_iterator, model):
            x = next(data_iterator)
            out = model(x["tokens"], self.pos.expand_as(x["tokens"]), self.mask, labels=x["labels"])
            return out, partial(self._masked, x["loss_mask"])

        res = self.fb(forward_step_func=forward_step, data_iterator=iter([b]), model=[self.ddp],
                      num_microbatches=1, seq_length=self.spec["seq_length"],
                      micro_batch_size=self.spec["micro_batch"], forward_only=False)
        self.opt.step()
        return float(res[0]["lm loss"])

    @torch.no_grad()
    def eval_loss(self, b: dict) -> float:
        self.ddp.eval()
        out = self.ddp(b["tokens"], self.pos.expand_as(b["tokens"]), self.mask, labels=b["labels"])
        self.ddp.train()
        return float(self._masked(b["loss_mask"], out)[0])

    def drain(self) -> None:
        pass

    def before_eval(self) -> None:
        pass

    def info(self) -> dict:
        return {"distributed_optimizer_instances": self.instances, "cpu_compat": True}


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
    if key in ("ds-zero0", "ds-zero2"):
        return _DeepSpeed(spec, 0 if key == "ds-zero0" else 2)
    if key in ("ds-topo-hier", "ds-topo-selective"):
        return _DeepSpeed(spec, 0, "hierarchical" if key == "ds-topo-hier" else "selective")
    if key == "ds-topo-selective-z1":
        return _DeepSpeed(spec, 1, "selective")
    if key in ("megatron-ddp", "megatron-distopt"):
        return _Megatron(spec, distopt=key == "megatron-distopt")
    raise ValueError(f"system {key!r}: unknown")

