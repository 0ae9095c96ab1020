"""A tiny real megatron-core GPT training loop for tests, CPU runs and examples.

Builds a ``GPTModel`` (local layer spec, CPU initialisation), wraps it in stock
``DistributedDataParallel`` or `TopoAlignDDP`, makes a Megatron optimizer, and runs iterations
through ``get_forward_backward_func`` (``no_sync`` for all microbatches but the last,
``finalize_model_grads`` at the end), exactly as Megatron-LM's ``train_step`` does.

The data is a learnable toy language: each sequence is ``x_{t+1} = (a * x_t + b) mod V`` for a
per-sequence start token, so the loss falls quickly. A batch is a pure function of
(rank, step, microbatch), so a resumed run sees the same data as an uninterrupted one.

Call `cpu_compat.apply()` first when there is no GPU.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from .cpu_compat import cuda_available

__all__ = ["TinyGPT", "init_parallel", "build_gpt", "wrap_ddp", "make_optimizer", "run_iteration", "batch_for",
           "ReleaseProbe", "released_ddps"]


@dataclass
class TinyGPT:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 2
    seed: int = 1234
    extra: dict = field(default_factory=dict)
    """Extra TransformerConfig fields (e.g. ``num_moe_experts``)."""
    expert_like: tuple[str, ...] = ()
    """Parameters whose name contains one of these get ``allreduce = False``: megatron-core's DDP and
    optimizer then treat them as expert parameters (own buffers, expert data-parallel group,
    separate optimizer), which exercises the expert path without expert parallelism."""


_initialized_with: list = []  # the settings megatron-core's parallel state was last built with


def init_parallel(num_distributed_optimizer_instances: int = 1, **kw) -> None:
    """(Re)initialise megatron-core's model-parallel state with TP = PP = 1.

    A no-op when it is already initialised with the same settings: every initialisation creates
    dozens of process groups (never freed by megatron-core), the slowest part of a CPU test.
    Models built earlier keep the groups they captured, so several settings can coexist.
    """
    from megatron.core import parallel_state as ps

    key = (num_distributed_optimizer_instances, tuple(sorted(kw.items())))
    if ps.model_parallel_is_initialized():
        if _initialized_with and _initialized_with[-1] == key:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=num_distributed_optimizer_instances,
                                 create_gloo_process_groups=False, **kw)
    _initialized_with[:] = [key]


def build_gpt(spec: TinyGPT):
    """A GPTModel with deterministic initial weights (same on every rank for the same seed)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
    torch.manual_seed(spec.seed)
    cfg = TransformerConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                            num_attention_heads=spec.num_attention_heads, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, **spec.extra)
    moe = bool(spec.extra.get("num_moe_experts"))
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.extra.get("num_moe_experts"), moe_grouped_gemm=False) \
        if moe else get_gpt_layer_local_spec()
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
                     max_sequence_length=spec.seq_length)
    for name, p in model.named_parameters():
        if any(k in name for k in spec.expert_like):
            p.allreduce = False
    if cfg.fp16 or cfg.bf16:
        # As Megatron-LM's get_model: 16-bit weights, inputs cast on the way in, fp32 loss out.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    if cuda_available():
        model.cuda(torch.cuda.current_device())  # as Megatron-LM's get_model (scripts/gpu_check.py runs this)
    return model, cfg


def wrap_ddp(model, cfg, *, topo=None, use_distributed_optimizer=False, overlap_grad_reduce=True,
             num_distributed_optimizer_instances=1, bucket_size=20000, cls=None, **ddp_kw):
    """Stock DDP (``topo`` None and ``cls`` None) or `TopoAlignDDP` with config ``topo``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from .ddp import TopoAlignDDP

    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size, num_distributed_optimizer_instances=num_distributed_optimizer_instances, **ddp_kw)
    if cls is None:
        cls = TopoAlignDDP if topo is not None else DistributedDataParallel
    ddp = cls(cfg, ddp_cfg, model, topo_align=topo) if cls is TopoAlignDDP else cls(cfg, ddp_cfg, model)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp


def _ddps() -> list:
    from megatron.core.distributed import DistributedDataParallel

    return [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]


@contextlib.contextmanager
def released_ddps():
    """On leaving the block, every megatron-core DDP built inside it lets go of its model: the
    plugin's engines closed (`TopoAlignDDP.topo_close`) and the DDP's grad-accumulator hooks dropped.

    Why: megatron-core's DDP holds each parameter's grad accumulator (an autograd node, C++), whose
    hook holds the DDP. The collector cannot see through the C++ node, so a dropped DDP lives on with
    its model, its engines and their process groups (three gloo threads each); a test world building
    dozens of them grew to hundreds of idle gloo threads a rank. Use with
    `topo_integrations.testing.released_groups` outside this block (it destroys the groups and collects).
    Issues no collective."""
    before = {id(o) for o in _ddps()}
    try:
        yield
    finally:
        for ddp in _ddps():
            if id(ddp) in before:
                continue
            if hasattr(ddp, "topo_close"):
                ddp.topo_close()
            ddp.grad_accs.clear()


def make_optimizer(ddp, *, lr=1e-2, clip_grad=0.0, **kw):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from .ddp import prepare_optimizer

    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=clip_grad,
                        use_distributed_optimizer=ddp.ddp_config.use_distributed_optimizer, **kw), [ddp],
        use_gloo_process_groups=False)
    return prepare_optimizer(opt, [ddp])


def batch_for(spec: TinyGPT, rank: int, step: int, mb: int) -> torch.Tensor:
    """Tokens [micro_batch_size, seq_length + 1] of the toy language, a function of (rank, step, mb)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * step + mb)
    start = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, 1), generator=g)
    toks = [start]
    for _ in range(spec.seq_length):
        toks.append((toks[-1] * 5 + 3) % spec.vocab_size)
    return torch.cat(toks, dim=1)


def run_iteration(ddp, spec: TinyGPT, rank: int, step: int, optimizer=None, before_step=None) -> dict[str, Any]:
    """One training iteration: zero buffers, forward/backward over the microbatches, optional step.

    ``before_step(ddp)``, when given, runs after the gradients are reduced and before the step.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    device = next(ddp.module.parameters()).device  # CPU, or the GPU build_gpt put the model on
    batches = iter([batch_for(spec, rank, step, mb).to(device) for mb in range(spec.num_microbatches)])
    pos = torch.arange(spec.seq_length, device=device).unsqueeze(0).expand(spec.micro_batch_size, spec.seq_length)

    def forward_step(data_iterator, model):
        toks = next(data_iterator)
        out = model(toks[:, :-1], pos, None, labels=toks[:, 1:])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=[ddp],
                                      num_microbatches=spec.num_microbatches, seq_length=spec.seq_length,
                                      micro_batch_size=spec.micro_batch_size, forward_only=False)
    loss = float(sum(r["loss"] for r in res) / len(res))
    out: dict[str, Any] = {"loss": loss}
    if before_step is not None:
        before_step(ddp)
    if optimizer is not None:
        ok, norm, _ = optimizer.step()
        out.update(ok=bool(ok), grad_norm=None if norm is None else float(norm))
    return out


class ReleaseProbe:
    """When each gradient collective of a `TopoAlignDDP` was submitted, released and issued,
    relative to the moment Megatron's ``finish_grad_sync`` began (the end of backward).

    Wraps the process schedule's ``item`` and ``release`` (reducer/schedule/schedule.py) and the DDP's
    ``finish_grad_sync`` on these instances only. Call `start` before an iteration and `step` after
    it: per class, how many items were released (handed to the issuing thread, a position in the
    program) and started (a time) before backward ended, and the tail from the end of backward to
    the completion of the step's last gradient collective.
    """

    def __init__(self, ddp):
        import time

        self._clock = time.perf_counter
        self._items: list = []
        self._released: dict[int, float] = {}
        self.t_finish: float | None = None
        for sched in {id(e.dispatcher.sched): e.dispatcher.sched for e in ddp.topo_engines}.values():
            self._wrap(sched)
        finish = ddp.finish_grad_sync

        def timed_finish(*a, **k):
            if self.t_finish is None:
                self.t_finish = self._clock()
            return finish(*a, **k)

        ddp.finish_grad_sync = timed_finish

    def _wrap(self, sched) -> None:
        item, release = sched.item, sched.release

        def recorded_item(*a, **k):
            it = item(*a, **k)
            self._items.append(it)
            return it

        def recorded_release(items):
            now = self._clock()
            for it in items:
                self._released.setdefault(id(it), now)
            return release(items)

        sched.item, sched.release = recorded_item, recorded_release

    def start(self) -> None:
        self._items, self._released, self.t_finish = [], {}, None

    def step(self) -> dict[str, Any]:
        """This iteration's figures (plain values; times in seconds from the end of backward)."""
        grads = [it for it in self._items if it.traffic in ("sync", "local")]
        t0 = self.t_finish if self.t_finish is not None else self._clock()
        out: dict[str, Any] = {}
        for cls in ("sync", "local"):
            mine = [it for it in grads if it.traffic == cls]
            out[cls] = len(mine)
            out[f"{cls}_released_before"] = sum(self._released.get(id(it), t0) < t0 for it in mine)
            out[f"{cls}_started_before"] = sum(it.started is not None and it.started < t0 for it in mine)
        # The priority rule: no LOCAL item leaves before the step's last SYNC item was submitted.
        last_sync = max((it.submitted for it in grads if it.traffic == "sync"), default=None)
        out["local_after_last_sync"] = all(last_sync is None or self._released.get(id(it), last_sync) >= last_sync
                                           for it in grads if it.traffic == "local")
        # Released while later buckets were still to come: inside backward, not at its end.
        last_submit = max((it.submitted for it in grads), default=None)
        out["local_released_before_last_bucket"] = sum(
            self._released.get(id(it), t0) < last_submit for it in grads if it.traffic == "local")
        done = [it.finished for it in grads if it.finished is not None]
        out["tail_s"] = max(done) - t0 if done else None
        return out
