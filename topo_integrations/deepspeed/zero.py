"""Seams in DeepSpeed's ZeRO optimizers (research/deepspeed.md 1.3-1.5, deepspeed-selective.md 2).

* ZeRO-1/2 `hierarchical`: :class:`HierarchicalZeroMixin` overrides the two methods every stage-1/2
  gradient collective goes through, ``allreduce_bucket`` and ``gradient_reduction_w_predivide``,
  keeping DeepSpeed's divide / predivide / postscale / dtype semantics and replacing only the
  ``dist.all_reduce`` by the hierarchical one. A reduce-to-owner call (``rank`` given) is served by a
  full hierarchical all-reduce, a correct superset (only the owner's copy is used).
* ZeRO-1/2 `selective`: DeepSpeed's data-parallel group is the island (an mpu, see
  :mod:`.mpu`), so ZeRO reduces every gradient inside the island and keeps one optimizer-state shard
  per island member, exactly like HSDP. :class:`SelectiveZeroMixin` adds the cross-island step:
  SYNC slices of the averaged gradient partition are all-reduced over the rail before the step; the
  clip norm and the overflow flag are made global; every H steps the LOCAL slices of the fp32 master
  partition and of the optimizer moments are averaged over the rail and the island re-gathers its
  bit16 parameters (docs/deepspeed.md, "selective at ZeRO-1/2").
* ZeRO-3 `hierarchical`: :class:`HierarchicalStage3Mixin` wraps the name-mangled
  ``__avg_scatter_grads`` so that, while it runs, the ``reduce_scatter_coalesced`` it calls (the
  module global of ``deepspeed.runtime.zero.stage3``, replaced once by :func:`install_stage3_dispatch`)
  is served by :meth:`Wire.reduce_scatter_coalesced` for this optimizer's groups.
"""

from __future__ import annotations

import contextvars

import torch
import torch.distributed as tdist

__all__ = ["HierarchicalZeroMixin", "SelectiveZeroMixin", "HierarchicalStage3Mixin",
           "install_stage3_dispatch", "uninstall_stage3_dispatch", "covers_dp", "swap_class"]


def covers_dp(st, group) -> bool:
    """Whether ``group`` is the data-parallel group the adapter's groups were planned for."""
    cache = st.__dict__.setdefault("_covers", {})
    key = id(group)
    if key not in cache:
        ranks = tuple(tdist.get_process_group_ranks(group)) if group is not None else tuple(range(tdist.get_world_size()))
        cache[key] = tuple(sorted(ranks)) == tuple(sorted(st.groups.dp_ranks))
    return cache[key]


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 hierarchical
# ---------------------------------------------------------------------------------------------

class HierarchicalZeroMixin:
    """Stage 1/2 `hierarchical` (see module docstring)."""

    topo_align = None

    def allreduce_bucket(self, bucket, communication_data_type: torch.dtype, rank=None, log=None, divide=True,
                         process_group=None):
        st = self.topo_align
        group = self.dp_process_group if process_group is None else process_group
        if st is None or not covers_dp(st, group):
            return super().allreduce_bucket(bucket, communication_data_type, rank, log, divide, process_group)
        from deepspeed.runtime.zero import stage_1_and_2 as s12

        tensor = self.flatten(bucket)
        if s12.pg_correctness_test or self.sequence_parallel_size > 1:
            communication_data_type = torch.float32
        t = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        if divide and self.gradient_average:
            t.div_(tdist.get_world_size(group=group) / float(self.sequence_parallel_size))
        st.wire.hierarchical_sum_(t)
        if t is not tensor:
            tensor.copy_(t)
        return t

    def gradient_reduction_w_predivide(self, tensor, communication_data_type: torch.dtype):
        st = self.topo_align
        if st is None or tensor.numel() == 0 or not covers_dp(st, self.dp_process_group):
            return super().gradient_reduction_w_predivide(tensor, communication_data_type)
        dp = tdist.get_world_size(group=self.dp_process_group)
        t = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        if not self.gradient_average:
            st.wire.hierarchical_sum_(t)
        elif self.postscale_gradients:
            if self.gradient_predivide_factor != 1.0:
                t.mul_(1.0 / self.gradient_predivide_factor)
            st.wire.hierarchical_sum_(t)
            if self.gradient_predivide_factor != dp:
                t.mul_(self.gradient_predivide_factor / (dp / float(self.sequence_parallel_size)))
        else:
            t.div_(dp / float(self.sequence_parallel_size))
            st.wire.hierarchical_sum_(t)
        if t is not tensor:
            tensor.copy_(t)
        return t


# ---------------------------------------------------------------------------------------------
# ZeRO-3 hierarchical
# ---------------------------------------------------------------------------------------------

_ACTIVE_STAGE3 = contextvars.ContextVar("topo_align_stage3", default=None)
_ORIGINAL_RS = {}


def _stage3_reduce_scatter_coalesced(tensors, group=None):
    """Replacement of ``stage3.reduce_scatter_coalesced``: hierarchical for an optimizer of the
    adapter whose partition group is the planned DP group, DeepSpeed's own otherwise."""
    st = _ACTIVE_STAGE3.get()
    if st is not None and covers_dp(st, group):
        return st.wire.reduce_scatter_coalesced(list(tensors), tdist.get_world_size(group), tdist.get_rank(group))
    return _ORIGINAL_RS["fn"](tensors, group)


def install_stage3_dispatch() -> None:
    """Replace the module global once per process (idempotent; delegates when no adapter is active)."""
    from deepspeed.runtime.zero import stage3

    if stage3.reduce_scatter_coalesced is _stage3_reduce_scatter_coalesced:
        return
    _ORIGINAL_RS["fn"] = stage3.reduce_scatter_coalesced
    stage3.reduce_scatter_coalesced = _stage3_reduce_scatter_coalesced


def uninstall_stage3_dispatch() -> None:
    from deepspeed.runtime.zero import stage3

    if stage3.reduce_scatter_coalesced is _stage3_reduce_scatter_coalesced:
        stage3.reduce_scatter_coalesced = _ORIGINAL_RS.pop("fn")


class HierarchicalStage3Mixin:
    """Stage 3 `hierarchical` (see module docstring)."""

    topo_align = None

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
        token = _ACTIVE_STAGE3.set(self.topo_align)
        try:
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, communication_data_type)
        finally:
            _ACTIVE_STAGE3.reset(token)


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 selective (DeepSpeed's DP group = island)
# ---------------------------------------------------------------------------------------------

def _flat_offsets(opt, i: int):
    """(name, start, end) of each parameter of group ``i`` inside ``bit16_groups_flat[i]``."""
    flat = opt.bit16_groups_flat[i]
    base = flat.data_ptr()
    size = flat.element_size()
    out = []
    for p in opt.bit16_groups[i]:
        start = (p.data_ptr() - base) // size
        out.append((opt.topo_align_param_names[id(p)], start, start + p.numel()))
    return out


class SelectiveZeroMixin:
    """Stage 1/2 `selective` on an island-sized ZeRO data-parallel group (see module docstring)."""

    topo_align = None
    topo_align_param_names: dict = {}

    # -- slices of this rank's partition ----------------------------------------------------------

    def _topo_slices(self):
        """Per param group: (sync_ranges, local_ranges) in partition coordinates, cached per class version."""
        st = self.topo_align
        cached = getattr(self, "_topo_slice_cache", None)
        if cached is not None and cached[0] == st.class_version:
            return cached[1]
        out = []
        for i in range(len(self.bit16_groups)):
            pid = tdist.get_rank(group=self.real_dp_process_group[i])
            ps = int(self.partition_size[i])
            lo, hi = pid * ps, (pid + 1) * ps
            sync, local, per_param = [], [], []
            for name, a, b in _flat_offsets(self, i):
                a2, b2 = max(a, lo), min(b, hi)
                if a2 < b2:
                    (sync if st.sync[name] else local).append((a2 - lo, b2 - lo))
                    per_param.append((name, a2 - lo, b2 - lo))
            # Alignment padding at the end of the flat buffer belongs to no parameter: left alone.
            out.append((sync, local, per_param))
        self._topo_slice_cache = (st.class_version, out)
        return out

    @staticmethod
    def _gather(flat: torch.Tensor, ranges) -> torch.Tensor:
        if not ranges:
            return flat.new_zeros(0)
        return torch.cat([flat[a:b] for a, b in ranges])

    @staticmethod
    def _scatter(flat: torch.Tensor, ranges, buf: torch.Tensor) -> None:
        off = 0
        for a, b in ranges:
            flat[a:b].copy_(buf[off:off + b - a])
            off += b - a

    # -- 1. SYNC gradients across islands, before DeepSpeed's step --------------------------------

    def _topo_sync_gradients(self) -> None:
        """Phases: 1. flatten this rank's island-averaged gradient partition; 2. gather its SYNC
        slices and all-reduce them over the rail (the same partition of every island), / islands;
        3. write back. With DP = island this completes the hierarchical RS/AR/AG for SYNC."""
        st = self.topo_align
        for i, (sync, _local, per_param) in enumerate(self._topo_slices()):
            ag = self.averaged_gradients.get(i) if isinstance(self.averaged_gradients, dict) else self.averaged_gradients[i]
            if ag is None:
                flat = None
            elif hasattr(ag, "flat_partition"):
                flat = ag.flat_partition
            else:
                flat = torch.cat([g.reshape(-1) for g in ag])
            # Every rank issues the collective, even with nothing to send, so collectives stay paired.
            buf = self._gather(flat, sync) if flat is not None else torch.zeros(
                sum(b - a for a, b in sync), dtype=self.single_partition_of_fp32_groups[i].dtype)
            if buf.numel():  # rail partners hold the same partition id, hence the same slices
                st.wire.inter_sum_(buf, cls="sync")
                buf.div_(st.groups.inter_size)
            if flat is None:
                continue
            self._scatter(flat, sync, buf)
            if st.cfg.importance.method == "fisher":
                # Importance from this rank's slice of each tensor; the refresh sums the slices
                # over the island (the same 1/island-size factor for every tensor: ranking unchanged).
                for name, a, b in per_param:
                    st.observe(name, float(flat[a:b].float().pow(2).sum()))
            if not hasattr(ag, "flat_partition"):
                off = 0
                for g in ag:
                    n = g.numel()
                    g.view(-1).copy_(flat[off:off + n])
                    off += n

    def step(self, closure=None):
        self._topo_sync_gradients()
        return super().step(closure)

    # -- 2. one clip norm for everyone ------------------------------------------------------------

    def scaled_global_norm(self, norm_type=2):
        """DeepSpeed's island norm -> sqrt(mean over islands of norm^2) (fp64 rail all-reduce);
        inf/nan stays inf (the sentinel DeepSpeed checks)."""
        norm = super().scaled_global_norm(norm_type)
        st = self.topo_align
        t = torch.as_tensor(norm, dtype=torch.float64).reshape(1).clone()
        bad = (~torch.isfinite(t)) | (t < 0)
        v = torch.where(bad, torch.full_like(t, float("inf")), t * t)
        st.wire.agree_(v, "sum", group="inter")
        out = torch.sqrt(v / st.groups.inter_size)
        st.last_clip_norm = float(out)
        if isinstance(norm, torch.Tensor):
            return out.to(norm.dtype).reshape(norm.shape)
        return float(out)

    # -- 3. one overflow decision for everyone ----------------------------------------------------

    def has_overflow(self, partition_gradients=True):
        flag = bool(super().has_overflow(partition_gradients))
        st = self.topo_align
        st.last_local_overflow = flag  # this island's own verdict, kept for tests and logs
        t = torch.tensor([1.0 if flag else 0.0])
        st.wire.agree_(t, "max", group="inter")
        st.last_overflow = bool(t.item() > 0)
        return st.last_overflow

    # -- 4. reconciliation ------------------------------------------------------------------------

    @torch.no_grad()
    def topo_reconcile(self) -> None:
        """Average the LOCAL slices of the fp32 master partition and of every optimizer-state tensor
        of the partition's shape over the rail, then re-gather the island's bit16 parameters.

        Phases: 1. per param group, gather LOCAL slices of master + moments into one fp32 buffer;
        2. one rail all-reduce of it, / islands; 3. scatter back; 4. ``update_lp_params`` (fp32 ->
        bit16 copy and all-gather inside the island). Averaging only the bit16 parameters would be
        undone by the next step, which copies the masters over them (research/deepspeed-selective.md).
        """
        st = self.topo_align
        for i, (_sync, local, _per_param) in enumerate(self._topo_slices()):
            master = self.single_partition_of_fp32_groups[i]
            tensors = [master.data.view(-1)]
            state = self.optimizer.state.get(master, {})
            for k in sorted(state):
                v = state[k]
                if torch.is_tensor(v) and v.numel() == master.numel() and v.is_floating_point():
                    tensors.append(v.view(-1))
            parts = [self._gather(t, local).float() for t in tensors]
            buf = torch.cat(parts) if parts else torch.zeros(0)
            st.wire.reconcile_mean_(buf, within_island_equal=False)
            off = 0
            for t, p in zip(tensors, parts):
                self._scatter(t, local, buf[off:off + p.numel()].to(t.dtype))
                off += p.numel()
        self.update_lp_params()


def swap_class(obj, mixin, prefix: str = "TopoAlign"):
    """Give ``obj`` a subclass of its class with ``mixin`` first in the MRO (research/deepspeed.md 1.5 (b))."""
    cls = type(obj)
    if issubclass(cls, mixin):
        return obj
    obj.__class__ = type(prefix + cls.__name__, (mixin, cls), {"__module__": __name__})
    return obj

