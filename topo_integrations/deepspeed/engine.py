"""Seams in ``DeepSpeedEngine`` (ZeRO-0 reduction, step schedule, checkpoints, monitor).

The engine returned by ``deepspeed.initialize`` gets a subclass of its own class with
:class:`TopoAlignEngineMixin` first in the MRO (``engine.__class__`` swap after construction: the
reduction, the step and the checkpoint calls all happen later, docs/deepspeed.md). So a
``DeepSpeedHybridEngine`` or any other engine class keeps its own behaviour. Every decision is the
shared Engine's (``engine.topo_align.engine``, adapter.py); the seams map DeepSpeed's buffers onto it.

* ZeRO-0 `hierarchical`: ``allreduce_bucket`` keeps DeepSpeed's scaling semantics and replaces only
  the ``dist.all_reduce`` of each dtype bucket by a SYNC bucket of the engine's dispatcher.
* ZeRO-0 `selective`: ``buffered_allreduce_fallback`` routes SYNC gradients hierarchically and LOCAL
  gradients inside the island (dispatcher buckets, SYNC first); ``clip_fp32_gradients`` clips with one
  global norm.
* All stages: ``step`` hands every optimizer step to ``Engine.after_step`` (reconciliation, possibly
  asynchronous, class refresh, drift promotion, adaptive levels) and reports statistics to
  DeepSpeed's monitor; ``save_checkpoint`` reconciles (blocking) first and writes the adapter state
  per rank; ``load_checkpoint`` restores it.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as tdist

from ..reducer.classes.classes import LOCAL, SYNC
from ..reducer.classes.importance import Importance
from ..reducer.engine.clip import clip_by_norm_
from ..reducer.schedule.dispatch import CommBucket, Reduction

__all__ = ["TopoAlignEngineMixin", "STATE_FILE"]

log = logging.getLogger("topo_align")

STATE_FILE = "topo_align_rank{rank:05d}.pt"


class TopoAlignEngineMixin:
    topo_align = None

    # -- ZeRO-0 hierarchical ----------------------------------------------------------------------

    def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        st = self.topo_align
        if st is None or not st.engine_reduces or not st.covers_dp(dp_group):
            return super().allreduce_bucket(bucket, dp_group, dp_world_size)
        tensor = self.flatten(bucket)
        t = tensor if self.communication_data_type == tensor.dtype else tensor.to(self.communication_data_type)
        if dp_world_size is None:
            dp_world_size = tdist.get_world_size(group=dp_group)
        e = st.engine

        def hsum():
            e.wait(e.reduce(CommBucket(st.key("bucket"), t, reduction=Reduction.SUM), SYNC))

        if not self.gradient_average:
            hsum()
        elif self.postscale_gradients():
            if self.gradient_predivide_factor() != 1.0:
                t.mul_(1.0 / self.gradient_predivide_factor())
            hsum()
            if self.gradient_predivide_factor() != dp_world_size:
                t.mul_(self.gradient_predivide_factor() / dp_world_size)
        else:
            t.mul_(1.0 / dp_world_size)
            hsum()
        if t is not tensor:
            tensor.copy_(t)
        return tensor

    # -- ZeRO-0 selective -------------------------------------------------------------------------

    def buffered_allreduce_fallback(self, grads=None, elements_per_buffer=500000000):
        """SYNC: hierarchical mean over all ranks (wire ``sync.dtype`` across islands); LOCAL: mean
        inside the island (wire ``local.dtype``, error feedback), released after the SYNC ones. One flat
        buffer per class and dtype, in registration order, so every rank issues the same collectives
        in the same order."""
        st = self.topo_align
        if st is None or not st.selective or grads is not None or self.has_moe_layers:
            return super().buffered_allreduce_fallback(grads, elements_per_buffer)
        e = st.engine
        sync, local = {}, {}
        for name, p in st.params.items():
            if p.numel() == 0:
                continue
            if p.grad is None:
                # As DeepSpeed does: every rank must reduce the same sizes.
                p.grad = torch.zeros_like(p)
            (sync if e.is_sync(name) else local).setdefault(p.grad.dtype, []).append((name, p.grad))
        # 1. SYNC buckets (one per dtype) go first; 2. LOCAL ones follow (held until sync_done);
        # 3. wait for all and write back.
        work = []
        for cls, by_dtype in ((SYNC, sync), (LOCAL, local)):
            for dtype in sorted(by_dtype, key=str):
                items = by_dtype[dtype]
                flat = torch.cat([g.reshape(-1) for _, g in items])
                work.append((items, flat, e.reduce(CommBucket(f"{cls.lower()}/{dtype}", flat), cls)))
            if cls == SYNC:
                e.sync_done()
        e.all_submitted()
        for items, flat, fut in work:
            e.wait(fut)
            self._topo_unflatten(items, flat)
        if e.tracks_fisher:
            names = [n for items in list(sync.values()) + list(local.values()) for n, _ in items]
            e.observe(names, Importance.grad_sq_sums([st.params[n] for n in names]))

    @staticmethod
    def _topo_unflatten(items, flat):
        off = 0
        for _name, g in items:
            n = g.numel()
            g.view(-1).copy_(flat[off:off + n])
            off += n

    def clip_fp32_gradients(self):
        """One clip factor on every rank: norm^2 = mean over ranks of the local norm^2
        (= |g_SYNC|^2 + mean over islands of |g_LOCAL|^2); one fp64 all-reduce over the DP group
        on the communication device (Engine.global_grad_norm_sq). The norm stays on the device (the
        factor too: reducer/engine/clip.py), as in DeepSpeed's own clip; ``_global_grad_norm`` is
        that 0-dim tensor, as DeepSpeed's ZeRO optimizers report it."""
        st = self.topo_align
        if st is None or not st.selective:
            return super().clip_fp32_gradients()
        e = st.engine
        params = [p for p in self.module.parameters() if p.grad is not None]
        sq = e.wire.tensor([0.0])
        if params:
            sq += torch.stack([p.grad.detach().double().pow(2).sum() for p in params]).sum().to(sq.device)
        norm = e.global_grad_norm_sq(sq).sqrt().reshape(())
        st.last_clip_norm = norm  # read on the host only when logged (DeepSpeedTopo.last_clip_norm)
        self._global_grad_norm = norm
        clip_by_norm_([p.grad.detach() for p in params], norm, self.gradient_clipping())
        return norm

    # -- the step schedule ------------------------------------------------------------------------

    def _topo_source(self):
        st = self.topo_align
        if st.island_dp:
            return self.optimizer.topo_reconcile_source()
        if st.selective:
            return st.param_source(self.optimizer)
        return None

    def step(self, lr_kwargs=None):
        boundary = self.is_gradient_accumulation_boundary()
        out = super().step(lr_kwargs)
        st = self.topo_align
        if st is not None and boundary:
            st.after_step(self._topo_source(), self.optimizer)
            if self.monitor.enabled and st.steps % st.cfg.monitor.log_interval == 0:
                self.monitor.write_events(st.monitor_events(self.global_samples))
        return out

    @torch.no_grad()
    def topo_reconcile(self) -> None:
        """Make every replica identical now (all ranks call it; blocking): applies a pending
        asynchronous correction, then averages the LOCAL tensors (Engine.reconcile). Use before
        evaluation; ``save_checkpoint`` calls it."""
        st = self.topo_align
        if st is not None and st.selective:
            st.engine.reconcile(self._topo_source(), blocking=True)

    def topo_set_loss_closure(self, fn) -> None:
        """The loss closure ``importance.method = "hutchinson"`` differentiates at each class refresh
        (default: the model's own output on the last recorded micro-batch)."""
        self.topo_align.set_user_closure(fn)

    def topo_align_stats(self) -> dict:
        """The engine's statistics (bytes/calls/seconds per tier and class: last step and total),
        classes, counters, plus the ZeRO stage and the plan."""
        return self.topo_align.stats()

    def destroy(self):
        st = self.topo_align
        if st is not None:
            st.close()
        return super().destroy()

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Reconcile (selective), save DeepSpeed's checkpoint, then this rank's adapter state.

        At ZeRO-1/2 selective every island holds the same (reconciled) shards under the same file
        names, so only island 0 writes DeepSpeed's files; every island reads them back on load.
        """
        st = self.topo_align
        if st is None:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        self.topo_reconcile()
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        flags = (self.save_non_zero_checkpoint, self.save_zero_checkpoint)
        if st.selective and st.stage in (1, 2) and st.groups.group_index != 0:
            self.save_non_zero_checkpoint = self.save_zero_checkpoint = False
        try:
            ok = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        finally:
            self.save_non_zero_checkpoint, self.save_zero_checkpoint = flags
        path = os.path.join(save_dir, tag, STATE_FILE.format(rank=tdist.get_rank()))
        torch.save(st.state_dict(), path)
        tdist.barrier()
        return ok

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        st = self.topo_align
        out = super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, custom_load_fn)
        if st is None or out[0] is None or load_module_only:
            return out
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as fh:
                tag = fh.read().strip()
        path = os.path.join(load_dir, str(tag), STATE_FILE.format(rank=tdist.get_rank()))
        if os.path.exists(path):
            st.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        else:
            log.warning("topo_align: %s not found; the adapter state (counters, classes, residuals) starts "
                        "fresh", path)
        return out
