"""Seams in ``DeepSpeedEngine`` (ZeRO-0 reduction, step schedule, checkpoints, monitor).

The engine returned by ``deepspeed.initialize`` gets a subclass of its own class with
:class:`TopoAlignEngineMixin` first in the MRO (``engine.__class__`` swap after construction: the
reduction, the step and the checkpoint calls all happen later, research/deepspeed.md 1.5 (b)). So a
``DeepSpeedHybridEngine`` or any other engine class keeps its own behaviour.

* ZeRO-0 `hierarchical`: ``allreduce_bucket`` keeps DeepSpeed's scaling semantics and replaces only
  the ``dist.all_reduce`` of each dtype bucket by the hierarchical one.
* ZeRO-0 `selective`: ``buffered_allreduce_fallback`` routes SYNC gradients hierarchically and LOCAL
  gradients inside the island; ``clip_fp32_gradients`` clips with one global norm.
* All stages: ``step`` counts optimizer steps, reconciles LOCAL replicas every
  ``local.reconcile_interval`` steps, refreshes classes, and reports statistics to DeepSpeed's
  monitor; ``save_checkpoint`` reconciles first and writes the adapter state per rank;
  ``load_checkpoint`` restores it.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as tdist

from .zero import covers_dp

__all__ = ["TopoAlignEngineMixin", "STATE_FILE"]

log = logging.getLogger("topo_align")

STATE_FILE = "topo_align_rank{rank:05d}.pt"


class TopoAlignEngineMixin:
    topo_align = None

    # -- ZeRO-0 hierarchical ----------------------------------------------------------------------

    def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        st = self.topo_align
        if st is None or not st.engine_reduces or not covers_dp(st, dp_group):
            return super().allreduce_bucket(bucket, dp_group, dp_world_size)
        tensor = self.flatten(bucket)
        t = tensor if self.communication_data_type == tensor.dtype else tensor.to(self.communication_data_type)
        if dp_world_size is None:
            dp_world_size = tdist.get_world_size(group=dp_group)
        if not self.gradient_average:
            st.wire.hierarchical_sum_(t)
        elif self.postscale_gradients():
            if self.gradient_predivide_factor() != 1.0:
                t.mul_(1.0 / self.gradient_predivide_factor())
            st.wire.hierarchical_sum_(t)
            if self.gradient_predivide_factor() != dp_world_size:
                t.mul_(self.gradient_predivide_factor() / dp_world_size)
        else:
            t.mul_(1.0 / dp_world_size)
            st.wire.hierarchical_sum_(t)
        if t is not tensor:
            tensor.copy_(t)
        return tensor

    # -- ZeRO-0 selective -------------------------------------------------------------------------

    def buffered_allreduce_fallback(self, grads=None, elements_per_buffer=500000000):
        """SYNC: hierarchical mean over all ranks (wire ``sync.dtype`` across islands); LOCAL: mean
        inside the island (wire ``local.dtype``, error feedback). One flat buffer per class and
        dtype, in registration order, so every rank issues the same collectives in the same order."""
        st = self.topo_align
        if st is None or not st.selective or grads is not None or self.has_moe_layers:
            return super().buffered_allreduce_fallback(grads, elements_per_buffer)
        sync, local = {}, {}
        for name, p in self.module.named_parameters():
            if not p.requires_grad or p.numel() == 0:
                continue
            if p.grad is None:
                # As DeepSpeed does: every rank must reduce the same sizes.
                p.grad = torch.zeros_like(p)
            (sync if st.sync[name] else local).setdefault(p.grad.dtype, []).append((name, p.grad))
        world, k = st.groups.dp_size, st.groups.intra_size
        for dtype in sorted(sync, key=str):
            items = sync[dtype]
            flat = torch.cat([g.reshape(-1) for _, g in items])
            st.wire.hierarchical_sum_(flat, cls="sync").div_(world)
            self._topo_unflatten(items, flat)
        for dtype in sorted(local, key=str):
            items = local[dtype]
            flat = torch.cat([g.reshape(-1) for _, g in items])
            st.wire.intra_sum_(flat, wire_dtype=st.local_dtype, cls="local").div_(k)
            self._topo_unflatten(items, flat)

    def _topo_unflatten(self, items, flat):
        st = self.topo_align
        off = 0
        for name, g in items:
            n = g.numel()
            piece = flat[off:off + n]
            g.view(-1).copy_(piece)
            st.observe(name, float(piece.float().pow(2).sum()))
            off += n

    def clip_fp32_gradients(self):
        """One clip factor on every rank: norm^2 = mean over ranks of the local norm^2
        (= |g_SYNC|^2 + mean over islands of |g_LOCAL|^2); one fp64 all-reduce over the DP group."""
        st = self.topo_align
        if st is None or not st.selective:
            return super().clip_fp32_gradients()
        params = [p for p in self.module.parameters() if p.grad is not None]
        sq = torch.tensor([sum(float(p.grad.detach().float().pow(2).sum()) for p in params)], dtype=torch.float64)
        st.wire.agree_(sq, "sum")
        norm = float(torch.sqrt(sq / st.groups.dp_size))
        st.last_clip_norm = norm
        self._global_grad_norm = norm
        coef = min(1.0, self.gradient_clipping() / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.detach().mul_(coef)
        return torch.tensor(norm)

    # -- the step schedule ------------------------------------------------------------------------

    def step(self, lr_kwargs=None):
        boundary = self.is_gradient_accumulation_boundary()
        out = super().step(lr_kwargs)
        st = self.topo_align
        if st is not None and boundary:
            self._topo_after_step()
        return out

    def _topo_after_step(self) -> None:
        st = self.topo_align
        st.steps += 1
        st.wire.begin_step()
        if st.selective and st.steps - st.last_reconcile >= st.cfg.local.reconcile_interval:
            self.topo_reconcile()
        step_stats = st.wire.stats.end_step()
        if self.monitor.enabled and st.steps % st.cfg.monitor.log_interval == 0:
            self._topo_write_monitor(step_stats)

    @torch.no_grad()
    def topo_reconcile(self) -> None:
        """Make every replica identical (all ranks call it; blocking).

        ZeRO-0: LOCAL parameters and their optimizer-state tensors (e.g. Adam exp_avg, exp_avg_sq)
        are averaged across islands in one flat buffer per dtype (Wire.reconcile_mean_: 1/k per
        island member over the rail, then an island all-gather). ZeRO-1/2: the optimizer averages
        its LOCAL master and moment slices (SelectiveZeroMixin.topo_reconcile).
        Then classes are refreshed when due (only here, when replicas agree).
        """
        st = self.topo_align
        if not st.selective:
            return
        if st.stage == 0:
            by_dtype: dict = {}
            state = getattr(self.optimizer, "state", {})
            for name, p in self.module.named_parameters():
                if not p.requires_grad or st.sync[name]:
                    continue
                by_dtype.setdefault(p.dtype, []).append(p.data)
                s = state.get(p, {})
                for key in sorted(s):
                    v = s[key]
                    if torch.is_tensor(v) and v.shape == p.shape and v.is_floating_point():
                        by_dtype.setdefault(v.dtype, []).append(v)
            for dtype in sorted(by_dtype, key=str):
                ts = by_dtype[dtype]
                flat = torch.cat([t.reshape(-1) for t in ts])
                st.wire.reconcile_mean_(flat)
                off = 0
                for t in ts:
                    t.view(-1).copy_(flat[off:off + t.numel()])
                    off += t.numel()
        else:
            self.optimizer.topo_reconcile()
        st.last_reconcile = st.steps
        st.reconciles += 1
        if st.refresh_due():
            st.refresh_classes(self.module)

    def _topo_write_monitor(self, step_stats: dict) -> None:
        st = self.topo_align
        x = self.global_samples
        events = [(f"TopoAlign/{k}", float(v), x) for k, v in sorted(step_stats.items())]
        events.append(("TopoAlign/sync_fraction", float(st.sync_fraction()), x))
        events.append(("TopoAlign/reconciles", float(st.reconciles), x))
        if st.last_clip_norm is not None:
            events.append(("TopoAlign/clip_norm", float(st.last_clip_norm), x))
        self.monitor.write_events(events)

    def topo_align_stats(self) -> dict:
        st = self.topo_align
        snap = st.wire.stats.snapshot()
        snap.update(mode=st.mode, stage=st.stage, steps=st.steps, reconciles=st.reconciles,
                    sync_fraction=st.sync_fraction(), plan_reason=st.groups.plan.reason)
        return snap

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Reconcile (selective), save DeepSpeed's checkpoint, then this rank's adapter state.

        At ZeRO-1/2 selective every island holds the same (reconciled) shards under the same file
        names, so only island 0 writes DeepSpeed's files; every island reads them back on load.
        """
        st = self.topo_align
        if st is None:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if st.selective:
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
