"""The benchmarked systems that run inside a framework's sharding or engine (bench/trainers.py
``build``): PyTorch FSDP2 (native HSDP, or the FSDP2 adapter), DeepSpeed ZeRO with and without
topo-align, megatron-core DDP with and without the distributed optimizer. Frameworks are imported
only inside these classes."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from .base import Plain, adamw, block, engine_info, reconcile_info

__all__ = ["FSDP2", "DeepSpeed", "Megatron"]


class FSDP2(Plain):
    """PyTorch FSDP2 (``fully_shard`` per GPT block and at the root). ``topo_mode`` None: native HSDP on
    the 2-D mesh (replicate = topology groups, shard = a group's ranks), FSDP2's own reduce-scatter and
    cross-group all-reduce in fp32. Else the model is sharded on the group row only and the FSDP2
    adapter (topo_integrations.fsdp, docs/fsdp.md) takes the cross-group step of every shard."""

    def __init__(self, spec: dict, topo_mode: str | None = None):
        from torch.distributed.fsdp import fully_shard

        from ..config import TopoAlignConfig
        from ..fsdp import apply, island_groups, island_mesh

        super().__init__(spec)
        # The groups come from the same block as the topo-align systems' (the byte theory plans from it).
        self.cfg = TopoAlignConfig.model_validate(block(spec, topo_mode or "hierarchical",
                                                         async_reconcile=spec["async_reconcile"]))
        groups = island_groups(self.cfg)
        mesh = island_mesh(groups, "cpu")
        on = mesh["shard"] if topo_mode else mesh
        for layer in self.model.layers:
            fully_shard(layer, mesh=on)
        fully_shard(self.model, mesh=on, reshard_after_forward=False)
        self.opt = adamw(self.model.parameters(), spec)  # over the sharded (DTensor) parameters
        self.ta = apply(self.model, groups, self.cfg) if topo_mode else None

    def _clip(self) -> None:
        if self.spec["clip"] <= 0:
            return
        if self.ta is not None:
            self.ta.clip_grad_norm_(self.spec["clip"])  # `selective`: the norm every island agrees on
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec["clip"])

    def step(self, b: dict) -> float:
        out = super().step(b)
        if self.ta is not None:
            self.ta.after_optimizer_step(self.opt)
        return out

    def drain(self) -> None:
        if self.ta is not None:
            self.ta.engine.drain()

    def before_eval(self) -> None:
        if self.ta is not None:
            self.ta.reconcile(self.opt)

    def info(self) -> dict:
        if self.ta is None:
            return {"fsdp2": "hsdp"}
        return {"fsdp2": "topo-align", **engine_info(self.ta.stats(), self.ta.engine.cfg)}


class DeepSpeed(Plain):
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

            cfg["topo_align"] = block(spec, topo_mode, async_reconcile=spec["async_reconcile"])
            self.engine, self.opt, _, _ = tds.initialize(model=self.model, optimizer=self.opt, config=cfg)
            self.reconcile_info = reconcile_info(self.engine.topo_align.engine.cfg)
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


class Megatron:
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
