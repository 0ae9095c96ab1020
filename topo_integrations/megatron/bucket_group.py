"""`TopoBucketGroup`: a Megatron bucket group whose gradient collectives go through an `Engine`.

Megatron keeps its contiguous gradient buffers, ``param.main_grad`` views, backward hooks and
first-batch logic; only the two methods that issue the gradient collectives are replaced
(``start_grad_sync`` / ``finish_grad_sync``, the contract of megatron-core 0.16's
``_ParamAndGradBucketGroup``, docs/megatron.md). Each bucket is handed to the engine's dispatcher
(topo_integrations/reducer/schedule/dispatch.py) as one `CommBucket` per class, with a key that is stable per
bucket and class; wire dtypes, error feedback, levels, order and timing are the dispatcher's.

Element ranges per class come from ``buffer.param_index_map`` (buffer-absolute offsets in the
padded layout, which the distributed optimizer's shards use too; ``bucket.param_to_index`` ignores
that padding and must not be used).

When the dispatcher's held work may go is decided per engine by `StepRelease`, from the sequence of
bucket-group submissions: LOCAL buckets right after the step's last bucket group with SYNC work,
reconciliation chunks right after its last bucket group. With ``--overlap-grad-reduce`` both points
fall inside backward (Megatron submits from its grad-ready hooks), so island reductions overlap it.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import param_and_grad_buffer as _pgb

from ..reducer.classes.classes import LOCAL, SYNC
from ..reducer.schedule.dispatch import Collective, CommBucket, Reduction
from ..reducer.schedule.ranges import Ranges, merge_spans
from ..reducer.schedule.ranges import clip as clip_ranges

__all__ = ["TopoBucketGroup", "StepRelease", "Ranges", "class_ranges", "clip_ranges"]

# Looked up, not imported by name: a megatron-core without the private class still imports this
# module, and `TopoAlignDDP`'s version gate (compat.check_core, run before anything is built) refuses
# it with a message naming the seam, the installed version and the supported range.
_BucketGroupBase = getattr(_pgb, "_ParamAndGradBucketGroup", object)


def class_ranges(spans: list[tuple[int, int, str]]) -> dict[str, Ranges]:
    """Bucket-relative ``(start, end, class)`` spans -> ranges per class, consecutive parameters of
    one class merged (the run also covers the distributed optimizer's alignment padding between
    them, whose gradients are zero)."""
    return merge_spans(spans, (SYNC, LOCAL))


class StepRelease:
    """The release points of one engine's step, as positions in the sequence of its bucket groups'
    submissions (`TopoBucketGroup.start_grad_sync`).

    Megatron submits a bucket group once per step, in the last microbatch only: from its grad-ready
    hooks during backward with ``--overlap-grad-reduce`` (in the order the groups fill, i.e. reverse
    layer order, the same on every rank), otherwise in ``finish_grad_sync`` (in bucket-group order).

    1. The step opens at its first submission; the groups with SYNC work are fixed then (classes
       change only between steps).
    2. Right after the submission that leaves no group with SYNC work unsubmitted:
       ``engine.sync_done()`` -- the LOCAL buckets held so far go, later ones as submitted.
    3. Right after the submission of the last group: ``engine.all_submitted()`` -- held
       reconciliation chunks go; the step closes.

    Counting submissions, not watching one fixed group, keeps the point right where a group with SYNC
    work fills late (importance-chosen SYNC tensors may sit in any bucket; a tied embedding's group
    waits for its second gradient) and where no group has SYNC work (the point is the first
    submission). It depends on the order of submissions only, never on timing, so it is the same on
    every rank. One per engine (`TopoAlignDDP` attaches it): a virtual-pipeline chunk and a separate
    expert engine keep their own, so each releases in its own program order.
    """

    @classmethod
    def attach(cls, engine, bucket_groups: list) -> "StepRelease":
        """The release points of ``engine``, whose collectives ``bucket_groups`` (all of them) issue."""
        rel = cls(engine, bucket_groups)
        for bg in bucket_groups:
            bg.topo_release = rel
        return rel

    def __init__(self, engine, bucket_groups: list):
        self.engine = engine
        self.groups = list(bucket_groups)
        self._unsubmitted: set[int] | None = None
        """Groups not yet submitted in the open step (None: no step open)."""
        self._sync_left: set[int] = set()
        self._sync_said = False

    def submitted(self, bucket_group) -> None:
        """``bucket_group`` handed this step's buckets to the engine (phases 1-3 above)."""
        if self._unsubmitted is None:  # 1.
            self._unsubmitted = {id(g) for g in self.groups}
            self._sync_left = {id(g) for g in self.groups if g.topo_has_sync()}
            self._sync_said = False
        self._unsubmitted.discard(id(bucket_group))
        self._sync_left.discard(id(bucket_group))
        if not self._sync_left and not self._sync_said:  # 2.
            self._sync_said = True
            self.engine.sync_done()
        if not self._unsubmitted:  # 3.
            self._unsubmitted = None
            self.engine.all_submitted()


class TopoBucketGroup(_BucketGroupBase):
    """A Megatron bucket group whose gradient collectives follow the topology.

    Instances are Megatron's own bucket groups with their class swapped (`TopoAlignDDP`);
    `topo_setup` adds the plugin's state. Megatron's hooks call ``register_grad_ready`` (inherited),
    which calls `start_grad_sync` once every gradient of the group has arrived in the last
    microbatch.
    """

    # -- set-up ------------------------------------------------------------------------------------

    def topo_setup(self, engine, tag: str, names: dict[torch.nn.Parameter, str], index_map: dict) -> None:
        """``tag``: stable prefix of this group's residual keys; ``names``: parameter -> engine name;
        ``index_map``: bucket -> its buffer's ``param_index_map`` (streams are the dispatcher's)."""
        self.topo_engine = engine
        self.topo_tag = tag
        self.topo_names = names
        self.topo_index_map = index_map
        self.topo_dispatched = False
        self.topo_distopt = bool(self.ddp_config.use_distributed_optimizer)
        self.topo_ranges: list[dict[str, Ranges]] = []
        self.topo_apply_classes()

    def topo_apply_classes(self) -> None:
        """Bucket-relative SYNC / LOCAL ranges for the engine's current classes (the engine's
        reconfigure listener calls this after a class refresh, a promotion or a checkpoint load)."""
        classes = self.topo_engine.classes
        self.topo_ranges = []
        for bucket in self.buckets:
            index_map = self.topo_index_map[bucket]
            spans = [(index_map[p][0] - bucket.offset, index_map[p][1] - bucket.offset, classes[self.topo_names[p]])
                     for p in bucket.params_list]
            self.topo_ranges.append(class_ranges(spans))

    # -- Megatron's contract -----------------------------------------------------------------------

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        """Reduce every bucket of the group (phases per mode in `_reduce_whole` / `_reduce_shard`).

        Keeps Megatron's contract: pre-scaling by ``gradient_scaling_factor``, one dispatch per
        iteration (a second call in the first batch is a no-op), plain DDP reduces the whole
        bucket, the distributed optimizer at least this rank's shard, ``force_all_reduce`` the whole
        bucket in either case.
        """
        if self.topo_dispatched:
            if self.is_first_batch:
                return
            raise AssertionError("Should not have multiple communication calls outstanding at once")
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                             check_for_large=self.ddp_config.check_for_large_grads)
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        e = self.topo_engine
        if e.tracks_fisher:
            # This rank's (unreduced) gradients: the engine agrees the scores over the DP group at refresh.
            params = [p for b in self.buckets for p in b.params_list]
            e.observe([self.topo_names[p] for p in params],
                      torch.stack([p.main_grad.detach().float().pow(2).sum() for p in params]))
        self.topo_futures = []
        for i, bucket in enumerate(self.buckets):
            if self.topo_distopt and not force_all_reduce:
                self._reduce_shard(i, bucket)
            else:
                self._reduce_whole(i, bucket)
        self.topo_dispatched = True
        self.grad_reduce_handle = None
        self.topo_release.submitted(self)  # may release held LOCAL / reconciliation work (StepRelease)

    def topo_has_sync(self) -> bool:
        """Whether this group's submission carries SYNC work: every bucket outside `selective` and
        under the distributed optimizer (the shard's rail hop is a SYNC item even with no SYNC
        range), else a bucket with a SYNC range."""
        if not self.topo_engine.selective or self.topo_distopt:
            return True
        return any(r[SYNC] for r in self.topo_ranges)

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """Complete this iteration's reduction (dispatching it now when the hooks did not)."""
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce or (self.is_first_batch and not self.topo_dispatched):
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if not self.topo_dispatched:
            raise AssertionError(
                f"Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available)")
        e = self.topo_engine
        try:
            for fut in self.topo_futures:
                e.wait(fut)
        finally:
            self.topo_futures = []
            self.topo_dispatched = False

    # -- reductions --------------------------------------------------------------------------------

    def _average(self) -> bool:
        return bool(self.ddp_config.average_in_collective)

    def _key(self, i: int, what: str) -> str:
        return f"{self.topo_tag}/{i}/{what}"

    def _submit(self, key: str, flat: torch.Tensor, cls: str, **kw) -> None:
        self.topo_futures.append(self.topo_engine.reduce(CommBucket(self._key(*key), flat, **kw), cls))

    def _reduce_whole(self, i: int, bucket) -> None:
        """The whole bucket (plain DDP, or ``force_all_reduce`` under the distributed optimizer): its
        SYNC ranges (every range outside `selective`) over all ranks, its LOCAL ranges inside the
        island; Megatron pre-scaled by 1/(L*K) unless ``average_in_collective`` (then MEAN)."""
        e = self.topo_engine
        red = Reduction.MEAN if self._average() else Reduction.SUM
        if not e.selective:
            self._submit((i, "all"), bucket.grad_data, SYNC, reduction=red)
            return
        for cls, what in ((SYNC, "sync"), (LOCAL, "local")):
            if self.topo_ranges[i][cls]:
                self._submit((i, what), bucket.grad_data, cls, ranges=self.topo_ranges[i][cls], reduction=red)

    def _reduce_shard(self, i: int, bucket) -> None:
        """Distributed optimizer: island reduce-scatter into my shard (Megatron's
        ``shard_buffer(...)[instance rank]``), then the rail hop of (the SYNC ranges of) the shard."""
        e = self.topo_engine
        g = e.groups
        if self.cached_grad_buffer_shard_list[i] is None:
            self.cached_grad_buffer_shard_list[i] = _pgb.shard_buffer(bucket.grad_data, g.intra_size)
        shard = self.cached_grad_buffer_shard_list[i][g.intra_rank]
        red = Reduction.MEAN if self._average() else Reduction.SUM
        self._submit((i, "shard-sync" if e.selective else "shard"), bucket.grad_data, SYNC,
                     ranges=self.topo_ranges[i][SYNC] if e.selective else None, reduction=red,
                     collective=Collective.SHARD, out=shard)
