"""Seams in DeepSpeed's ZeRO optimizers (docs/deepspeed.md).

Every collective and every decision goes through the shared Engine (``self.topo_align.engine``);
these mixins only map DeepSpeed's buffers onto it.

* ZeRO-1/2 `hierarchical`: :class:`HierarchicalZeroMixin` overrides the two methods every stage-1/2
  gradient collective goes through, ``allreduce_bucket`` and ``gradient_reduction_w_predivide``,
  keeping DeepSpeed's divide / predivide / postscale / dtype semantics and replacing only the
  ``dist.all_reduce`` by a SYNC bucket of the engine's dispatcher. A reduce-to-owner call (``rank`` given) is served by
  a full hierarchical all-reduce, a correct superset (only the owner's copy is used).
* ZeRO-1/2 `selective`: DeepSpeed's data-parallel group is the island (an mpu, see :mod:`.mpu`), so
  ZeRO reduces every gradient inside the island and keeps one optimizer-state shard per island
  member, exactly like HSDP. :class:`SelectiveZeroMixin` adds the cross-island step: SYNC slices of
  the averaged gradient partition go over the rail (RAIL buckets of the dispatcher), issued from
  ``reduce_ipg_grads`` as DeepSpeed's island buckets finish during backward and waited for before
  the step (rail.py); the clip norm
  and the overflow flag are made global; the reconcile source (:class:`PartitionSource`) hands the
  engine the LOCAL slices of the fp32 master partition and of the optimizer moments, and
  ``update_lp_params`` re-gathers the island's bit16 parameters after they changed.
* ZeRO-3 `hierarchical`: :class:`HierarchicalStage3Mixin` wraps the name-mangled
  ``__avg_scatter_grads``; only while it runs (and only in the calling thread) the module global
  ``stage3.reduce_scatter_coalesced`` it calls is served by :func:`reduce_scatter_coalesced`. The
  global is restored when the call returns, so another DeepSpeed engine of the process never sees it.
"""

from __future__ import annotations

import contextvars
import math

import torch
import torch.distributed as tdist

from ..reducer.classes.classes import SYNC
from ..reducer.reconcile.reconcile import ReconcileItem, is_second_moment
from ..reducer.schedule.dispatch import Collective, CommBucket, Reduction
from .rail import SyncRail, flat_offsets

__all__ = ["HierarchicalZeroMixin", "SelectiveZeroMixin", "HierarchicalStage3Mixin", "PartitionSource",
           "reduce_scatter_coalesced", "swap_class"]


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 hierarchical
# ---------------------------------------------------------------------------------------------

def _hsum(st, t: torch.Tensor) -> None:
    e = st.engine
    e.wait(e.reduce(CommBucket(st.key("bucket"), t, reduction=Reduction.SUM), SYNC))


class HierarchicalZeroMixin:
    """Stage 1/2 `hierarchical` (see module docstring)."""

    topo_align = None

    def allreduce_bucket(self, bucket, communication_data_type: torch.dtype, rank=None, log=None, divide=True,
                         process_group=None):
        st = self.topo_align
        group = self.dp_process_group if process_group is None else process_group
        if st is None or not st.covers_dp(group):
            return super().allreduce_bucket(bucket, communication_data_type, rank, log, divide, process_group)
        from deepspeed.runtime.zero import stage_1_and_2 as s12

        tensor = self.flatten(bucket)
        if s12.pg_correctness_test or self.sequence_parallel_size > 1:
            communication_data_type = torch.float32
        t = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        if divide and self.gradient_average:
            t.div_(tdist.get_world_size(group=group) / float(self.sequence_parallel_size))
        _hsum(st, t)
        if t is not tensor:
            tensor.copy_(t)
        return t

    def gradient_reduction_w_predivide(self, tensor, communication_data_type: torch.dtype):
        st = self.topo_align
        if st is None or tensor.numel() == 0 or not st.covers_dp(self.dp_process_group):
            return super().gradient_reduction_w_predivide(tensor, communication_data_type)
        dp = tdist.get_world_size(group=self.dp_process_group)
        t = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        if not self.gradient_average:
            _hsum(st, t)
        elif self.postscale_gradients:
            if self.gradient_predivide_factor != 1.0:
                t.mul_(1.0 / self.gradient_predivide_factor)
            _hsum(st, t)
            if self.gradient_predivide_factor != dp:
                t.mul_(self.gradient_predivide_factor / (dp / float(self.sequence_parallel_size)))
        else:
            t.div_(dp / float(self.sequence_parallel_size))
            _hsum(st, t)
        if t is not tensor:
            tensor.copy_(t)
        return t


# ---------------------------------------------------------------------------------------------
# ZeRO-3 hierarchical
# ---------------------------------------------------------------------------------------------

_ACTIVE_STAGE3 = contextvars.ContextVar("topo_align_stage3", default=None)
"""(adapter, DeepSpeed's reduce_scatter_coalesced) while a topo_align stage-3 optimizer's
``__avg_scatter_grads`` runs in this thread; None elsewhere."""


def reduce_scatter_coalesced(tensors, group=None):
    """ZeRO-3's ``reduce_scatter_coalesced`` contract, hierarchically, for the active adapter.

    Contract (DeepSpeed ``runtime/comm/coalesced_collectives.py``): each tensor is cut into ``world``
    chunks of ``ceil(numel/world)``; DP rank j gets, for every tensor, the sum over all ranks of
    chunk j divided by ``world``. Returned: my chunk of each tensor (unpadded).

    Phases:
      1. build a buffer of ``world`` slots (slot j = chunk j of every tensor, padded), pre-divided by
         ``world``, ordered rail by rail: island member s's part holds the slots of the ranks on its
         rail, in rail order;
      2-3. one SCATTER bucket of the dispatcher: island reduce-scatter (member s gets its rail's
         slots summed over the island), then rail reduce-scatter of those slots (wire
         ``communication.inter_dtype`` with error feedback): each rank gets its own slot.
    The slow tier carries 1/k of what a flat reduce-scatter would.
    """
    active = _ACTIVE_STAGE3.get()
    if active is None or not active[0].covers_dp(group):
        original = active[1] if active is not None else None
        if original is None:
            from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced as original
        return original(tensors, group)
    st = active[0]
    e, g = st.engine, st.groups
    tensors = list(tensors)
    world, my_rank = tdist.get_world_size(group), tdist.get_rank(group)
    chunk = [math.ceil(t.numel() / world) for t in tensors]
    slot = sum(chunk)
    dtype = tensors[0].dtype
    dp_pos = {r: i for i, r in enumerate(g.dp_ranks)}
    rails = {}
    for rail in g.plan.inter_groups:
        members = sorted(g.dp_ranks[p] for p in rail)
        for m in members:
            rails[m] = members
    order = [dp_pos[m] for s in sorted(g.intra_ranks) for m in rails[s]]
    slots = []
    for j in order:
        parts = []
        for t, c in zip(tensors, chunk):
            piece = t.reshape(-1)[j * c:(j + 1) * c]
            parts.append(piece.to(dtype))
            if piece.numel() < c:
                parts.append(piece.new_zeros(c - piece.numel()))
        slots.append(torch.cat(parts) if parts else tensors[0].new_zeros(0))
    buf = torch.cat(slots).div_(world)
    out = buf.new_empty(slot)
    e.wait(e.reduce(CommBucket(st.key("rs"), buf, collective=Collective.SCATTER, out=out), SYNC))
    res, off = [], 0
    for t, c in zip(tensors, chunk):
        n_mine = max(0, min(c, t.numel() - my_rank * c))
        res.append(out.narrow(0, off, n_mine))
        off += c
    return res


class HierarchicalStage3Mixin:
    """Stage 3 `hierarchical` (see module docstring)."""

    topo_align = None

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
        from deepspeed.runtime.zero import stage3

        original = stage3.reduce_scatter_coalesced
        token = _ACTIVE_STAGE3.set((self.topo_align, original))
        stage3.reduce_scatter_coalesced = reduce_scatter_coalesced
        try:
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, communication_data_type)
        finally:
            stage3.reduce_scatter_coalesced = original
            _ACTIVE_STAGE3.reset(token)


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 selective (DeepSpeed's DP group = island)
# ---------------------------------------------------------------------------------------------

class PartitionSource:
    """What ZeRO-1/2 `selective` reconciles: this rank's LOCAL slices of the fp32 master partition
    (``param=`` set: drift is measured on them) and of every optimizer-state tensor of the
    partition's shape, as ``shard=True`` items (the rail partners hold the same partition);
    ``written()`` copies fp32 to bit16 and all-gathers inside the island (``update_lp_params``).
    Averaging only the bit16 parameters would be undone by the next step, which copies the masters
    over them (docs/deepspeed.md)."""

    def __init__(self, opt):
        self.opt = opt

    def items(self, local: list[str]) -> list[ReconcileItem]:
        opt, want = self.opt, set(local)
        out = []
        held = set()
        for i, (_sync, _local, per_param) in enumerate(opt._topo_slices()):
            master = opt.single_partition_of_fp32_groups[i]
            state = opt.optimizer.state.get(master, {})
            moments = [(k, state[k]) for k in sorted(state)
                       if torch.is_tensor(state[k]) and state[k].is_floating_point()
                       and state[k].numel() == master.numel()]
            for name, a, b in per_param:
                if name not in want:
                    continue
                held.add(name)
                out.append(ReconcileItem(f"{i}:{name}:{a}:master", master.data.view(-1)[a:b], shard=True, param=name))
                for k, v in moments:
                    out.append(ReconcileItem(f"{i}:{name}:{a}:{k}", v.view(-1)[a:b], shard=True,
                                             nonneg=is_second_moment(k), state=True))
        # The drift of a tensor is agreed over all ranks with the same names everywhere
        # (reducer/classes/drift.py): a LOCAL tensor outside this rank's partition contributes an empty slice.
        dev = opt.topo_align.engine.device
        out += [ReconcileItem(f"absent:{n}", torch.zeros(0, device=dev), shard=True, param=n)
                for n in local if n not in held]
        return out

    def written(self) -> None:
        self.opt.update_lp_params()


class SelectiveZeroMixin:
    """Stage 1/2 `selective` on an island-sized ZeRO data-parallel group (see module docstring)."""

    topo_align = None
    topo_align_param_names: dict = {}

    # -- slices of this rank's partition ----------------------------------------------------------

    def topo_reconfigured(self, _engine=None) -> None:
        """The engine's reconfigure listener: classes changed, the slices are recomputed on next use."""
        self._topo_slice_cache = None

    def _topo_slices(self):
        """Per param group: (sync_ranges, local_ranges, per_param) in partition coordinates."""
        cached = getattr(self, "_topo_slice_cache", None)
        if cached is not None:
            return cached
        e = self.topo_align.engine
        out = []
        for i in range(len(self.bit16_groups)):
            pid = tdist.get_rank(group=self.real_dp_process_group[i])
            ps = int(self.partition_size[i])
            lo, hi = pid * ps, (pid + 1) * ps
            sync, local, per_param = [], [], []
            for name, a, b in flat_offsets(self, i):
                a2, b2 = max(a, lo), min(b, hi)
                if a2 < b2:
                    (sync if e.is_sync(name) else local).append((a2 - lo, b2 - lo))
                    per_param.append((name, a2 - lo, b2 - lo))
            # Alignment padding at the end of the flat buffer belongs to no parameter: left alone.
            out.append((sync, local, per_param))
        self._topo_slice_cache = out
        return out

    def topo_reconcile_source(self) -> PartitionSource:
        return PartitionSource(self)

    # -- 1. SYNC gradients across islands: issued as DeepSpeed's buckets finish, waited for in step --

    @property
    def topo_rail(self) -> SyncRail:
        rail = self.__dict__.get("_topo_rail")
        if rail is None:
            rail = self._topo_rail = SyncRail(self)
        return rail

    def reduce_ipg_grads(self, comm_dtype=None):
        """DeepSpeed's island reduction of the filled bucket(s); then the rail gets the SYNC slices
        of the reduced parameters (rail.py: captured at the accumulation boundary, submitted in plan
        order), so the cross-island hop overlaps the rest of backward."""
        dtypes = list(self.ipg_buckets) if comm_dtype is None else [comm_dtype]
        params = [self.bit16_groups[g][k] for dt in dtypes if dt in self.ipg_buckets
                  for g, k, _pid in self.ipg_buckets[dt].params]
        out = super().reduce_ipg_grads(comm_dtype)
        if params:
            if self.overlap_comm and self.reduction_stream is not None:
                # DeepSpeed reduced on its reduction stream: capture (and mark the chunk ready) there,
                # after the reduction, not on the stream running backward (a no-op on the CPU).
                from deepspeed.accelerator import get_accelerator

                with get_accelerator().stream(self.reduction_stream):
                    self.topo_rail.bucket_reduced(params)
            else:
                self.topo_rail.bucket_reduced(params)
        return out

    def _topo_sync_gradients(self) -> None:
        """Phases: 1. flatten this rank's island-averaged gradient partition per group; 2. the rail
        (rail.py) submits the SYNC chunks not yet submitted during backward, waits for every chunk
        (all-reduce over the rail: the same partition of every island; wire ``sync.dtype``, error
        feedback; / islands) and writes them back; 3. write back into DeepSpeed's partition lists.
        With DP = island this completes the hierarchical RS/AR/AG for SYNC."""
        e = self.topo_align.engine
        flats, lists = [], []
        for i in range(len(self.bit16_groups)):
            ags = self.averaged_gradients
            ag = ags.get(i) if isinstance(ags, dict) else ags[i]
            if ag is None:
                flat = None
            elif hasattr(ag, "flat_partition"):
                flat = ag.flat_partition
            else:
                flat = torch.cat([g.reshape(-1) for g in ag])
            flats.append(flat)
            lists.append(ag)
        self.topo_rail.finish(flats)
        names, sq = [], []
        for i, (_sync, _local, per_param) in enumerate(self._topo_slices()):
            flat, ag = flats[i], lists[i]
            if flat is None:
                continue
            if e.tracks_fisher:
                # Importance from this rank's slice of each tensor; the refresh sums the slices over
                # the ranks (the same 1/island-size factor for every tensor: ranking unchanged).
                for name, a, b in per_param:
                    names.append(name)
                    sq.append(flat[a:b].float().pow(2).sum())
            if not hasattr(ag, "flat_partition"):
                off = 0
                for g in ag:
                    n = g.numel()
                    g.view(-1).copy_(flat[off:off + n])
                    off += n
        if names:
            e.observe(names, torch.stack(sq))

    def step(self, closure=None):
        self._topo_sync_gradients()
        e = self.topo_align.engine
        e.sync_done()
        e.all_submitted()  # every gradient collective issued: held reconciliation may go
        return super().step(closure)

    # -- 2. one clip norm for everyone ------------------------------------------------------------

    def scaled_global_norm(self, norm_type=2):
        """DeepSpeed's island norm -> sqrt(mean over islands of norm^2) (fp64 rail all-reduce on the
        communication device); inf/nan stays inf (the sentinel DeepSpeed checks)."""
        norm = super().scaled_global_norm(norm_type)
        st = self.topo_align
        e = st.engine
        t = (norm.detach().double().reshape(1).to(e.device) if torch.is_tensor(norm)
             else e.wire.tensor([float(norm)]))
        bad = (~torch.isfinite(t)) | (t < 0)
        v = torch.where(bad, torch.full_like(t, float("inf")), t * t)
        out = e.global_grad_norm_sq(v, over="inter").sqrt()
        st.last_clip_norm = out  # read on the host only when logged (DeepSpeedTopo.last_clip_norm)
        if torch.is_tensor(norm):
            return out.to(device=norm.device, dtype=norm.dtype).reshape(norm.shape)
        return float(out.item())  # a DeepSpeed that hands a host float (older releases) gets one back

    # -- 3. one overflow decision for everyone ----------------------------------------------------

    def has_overflow(self, partition_gradients=True):
        flag = bool(super().has_overflow(partition_gradients))
        st = self.topo_align
        st.last_local_overflow = flag  # this island's own verdict, kept for tests and logs
        st.last_overflow = st.engine.agree_overflow(flag, over="inter")
        return st.last_overflow


def swap_class(obj, mixin, prefix: str = "TopoAlign"):
    """Give ``obj`` a subclass of its class with ``mixin`` first in the MRO (docs/deepspeed.md)."""
    cls = type(obj)
    if issubclass(cls, mixin):
        return obj
    obj.__class__ = type(prefix + cls.__name__, (mixin, cls), {"__module__": __name__})
    return obj
