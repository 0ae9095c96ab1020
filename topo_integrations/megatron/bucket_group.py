"""`TopoBucketGroup`: a Megatron bucket group whose gradient collectives go through an `Engine`.

Megatron keeps its contiguous gradient buffers, ``param.main_grad`` views, backward hooks and
first-batch logic; only the two methods that issue the gradient collectives are replaced
(``start_grad_sync`` / ``finish_grad_sync``, the contract of megatron-core 0.16's
``_ParamAndGradBucketGroup``, docs/megatron.md). Every collective is a call on the engine's wire
(topo_integrations/reducer/wire.py) with a residual key that is stable per bucket and class, so
error feedback, device checks and statistics are the engine's; LOCAL-class collectives are issued
through ``engine.run(LOCAL, ...)`` (the LOCAL worker's FIFO, which also runs the asynchronous
reconciliation; ordering rule in topo_integrations/reducer/engine.py).

Element ranges per class come from ``buffer.param_index_map`` (buffer-absolute offsets in the
padded layout, which the distributed optimizer's shards use too; ``bucket.param_to_index`` ignores
that padding and must not be used).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer

from ..reducer.classes import LOCAL, SYNC

__all__ = ["TopoBucketGroup", "Ranges", "class_ranges", "clip_ranges"]

Ranges = list[tuple[int, int]]


def class_ranges(spans: list[tuple[int, int, str]]) -> dict[str, Ranges]:
    """Bucket-relative ``(start, end, class)`` spans -> ranges per class, consecutive parameters of
    one class merged (the run also covers the distributed optimizer's alignment padding between
    them, whose gradients are zero)."""
    runs: list[list] = []
    for s, e, cls in sorted(spans):
        if runs and runs[-1][2] == cls:
            runs[-1][1] = e
        else:
            runs.append([s, e, cls])
    return {c: [(s, e) for s, e, k in runs if k == c] for c in (SYNC, LOCAL)}


def clip_ranges(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """Ranges intersected with [lo, hi), made relative to lo."""
    out = []
    for s, e in ranges:
        s2, e2 = max(s, lo), min(e, hi)
        if s2 < e2:
            out.append((s2 - lo, e2 - lo))
    return out


def _take(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The elements of ``ranges`` as one contiguous copy."""
    if len(ranges) == 1:
        s, e = ranges[0]
        return t[s:e].clone()
    return torch.cat([t[s:e] for s, e in ranges])


def _put(t: torch.Tensor, ranges: Ranges, values: torch.Tensor) -> None:
    off = 0
    for s, e in ranges:
        t[s:e].copy_(values[off:off + e - s])
        off += e - s


class TopoBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose gradient collectives follow the topology.

    Instances are Megatron's own bucket groups with their class swapped (`TopoAlignDDP`);
    `topo_setup` adds the plugin's state. Megatron's hooks call ``register_grad_ready`` (inherited),
    which calls `start_grad_sync` once every gradient of the group has arrived in the last
    microbatch.
    """

    # -- set-up ------------------------------------------------------------------------------------

    def topo_setup(self, engine, tag: str, names: dict[torch.nn.Parameter, str], index_map: dict, stream) -> None:
        """``tag``: stable prefix of this group's residual keys; ``names``: parameter -> engine name;
        ``index_map``: bucket -> its buffer's ``param_index_map``; ``stream``: CUDA side stream or None."""
        self.topo_engine = engine
        self.topo_tag = tag
        self.topo_names = names
        self.topo_index_map = index_map
        self.topo_stream = stream
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
        if self.topo_stream is not None:
            self.topo_stream.wait_stream(torch.cuda.default_stream())
            ctx = torch.cuda.stream(self.topo_stream)
        else:
            ctx = nullcontext()
        with ctx:
            for i, bucket in enumerate(self.buckets):
                if self.topo_distopt and not force_all_reduce:
                    self._reduce_shard(i, bucket)
                else:
                    self._reduce_whole(i, bucket)
        self.topo_dispatched = True
        self.grad_reduce_handle = None

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """Complete this iteration's reduction (dispatching it now when the hooks did not)."""
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
            self.topo_dispatched = False
            return
        if self.is_first_batch and not self.topo_dispatched:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if not self.topo_dispatched:
            raise AssertionError(
                f"Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available)")
        if self.topo_stream is not None:
            torch.cuda.default_stream().wait_stream(self.topo_stream)
        self.topo_dispatched = False

    # -- reductions --------------------------------------------------------------------------------

    def _average(self) -> bool:
        return bool(self.ddp_config.average_in_collective)

    def _key(self, i: int, what: str) -> str:
        return f"{self.topo_tag}/{i}/{what}"

    def _reduce_whole(self, i: int, bucket) -> None:
        """The whole bucket (plain DDP, or ``force_all_reduce`` under the distributed optimizer).

        Phases: 1. SYNC ranges (every range in `hierarchical`): island reduce-scatter, rail
        all-reduce in the SYNC wire dtype, island all-gather (``wire.hierarchical_``); 2. LOCAL
        ranges: all-reduce inside the island in ``local.dtype`` (``wire.intra_`` on the LOCAL
        worker), rescaled to the group mean when Megatron pre-scaled by 1/(L*K).
        """
        e = self.topo_engine
        w, g = e.wire, e.groups
        grad, avg = bucket.grad_data, self._average()
        if not e.selective:
            w.hierarchical_(grad, key=self._key(i, "all"), wire=e.sync_dtype, cls="sync", average=avg)
            return
        ranges = self.topo_ranges[i]
        if ranges[SYNC]:
            vals = _take(grad, ranges[SYNC])
            w.hierarchical_(vals, key=self._key(i, "sync"), wire=e.sync_dtype, cls="sync", average=avg)
            _put(grad, ranges[SYNC], vals)
        if ranges[LOCAL]:
            vals = _take(grad, ranges[LOCAL])
            e.run(LOCAL, lambda: w.intra_(vals, key=self._key(i, "local"), wire=e.local_dtype, average=avg))
            if not avg and g.inter_size > 1:
                vals.mul_(g.inter_size)  # pre-scaled by 1/(L*K) for a global mean; a group mean needs 1/L
            _put(grad, ranges[LOCAL], vals)

    def _reduce_shard(self, i: int, bucket) -> None:
        """Distributed optimizer: island reduce-scatter, then the rail hop of (part of) my shard.

        Phases: 1. reduce-scatter SUM of the bucket inside my island (= Megatron's optimizer
        instance); my shard = Megatron's ``shard_buffer(...)[instance rank]``; 2. all-reduce over
        the rail of the whole shard (`hierarchical`) or of its SYNC ranges (`selective`) in the
        SYNC wire dtype (``wire.rail_``); 3. (`selective`) LOCAL elements are rescaled to the group mean.
        """
        e = self.topo_engine
        w, g = e.wire, e.groups
        L, K = g.intra_size, g.inter_size
        if self.cached_grad_buffer_shard_list[i] is None:
            self.cached_grad_buffer_shard_list[i] = shard_buffer(bucket.grad_data, L)
        shard = self.cached_grad_buffer_shard_list[i][g.intra_rank]
        avg = self._average()
        w.reduce_scatter_intra_(shard, bucket.grad_data, cls="sync")
        if avg and L > 1:
            shard.div_(L)
        if not e.selective:
            w.rail_(shard, key=self._key(i, "shard"), wire=e.sync_dtype, cls="sync", average=avg)
            return
        n = shard.numel()
        lo = g.intra_rank * n
        sync_r = clip_ranges(self.topo_ranges[i][SYNC], lo, lo + n)
        vals = _take(shard, sync_r) if sync_r else None
        if vals is not None:
            w.rail_(vals, key=self._key(i, "shard-sync"), wire=e.sync_dtype, cls="sync", average=avg)
        if not avg and K > 1:
            shard.mul_(K)  # LOCAL (and padding) elements: pre-scaled by 1/(L*K), a group mean needs 1/L
        if vals is not None:
            _put(shard, sync_r, vals)
