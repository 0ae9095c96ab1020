"""Collectives on flat 1-D tensors over explicit groups (a `ReducerGroups`).

Every function reduces IN PLACE and returns the tensor (or a handle with ``wait()`` when
``async_op``). ``average=True`` divides by the number of contributors (mean), as DDP, DeepSpeed and
Megatron do. Failures (a peer died, the group's timeout expired) become :class:`CollectiveError`
naming the operation, the group and its global ranks.

``record(tier, nbytes, seconds)``, when given, is called once per collective with the tier
(``"dp"``, ``"intra"``, ``"inter"``), the payload bytes this rank hands to the collective (the
tensor it reduces or gathers; see docs/reducer.md for the conversion to ring wire bytes) and the
wall time of the call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ..watch.bounded import bounded
from ..watch.errors import CollectiveError
from .compression import hop_residual_numel, is_lossy, is_narrow, padded_numel
from .compression import wire_dtype as _as_dtype
from .lossy_wire import lossy_all_reduce, lossy_reduce_scatter

if TYPE_CHECKING:  # groups.py imports this module (bounded)
    from ..plan.groups import ReducerGroups

__all__ = ["CollectiveError", "flat_all_reduce", "hierarchical_all_reduce", "intra_all_reduce",
           "reconcile_average", "reduce_scatter", "agree_scalar", "padded_numel", "run", "hop", "check_device",
           "rail_all_reduce", "rail_numel", "residual_numel", "hop_residual_numel", "rail_reduce_scatter", "bounded"]

Record = Callable[[str, int, float], None] | None


# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor in favour of
# all_gather_single and reduce_scatter_single (same semantics).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, *, group) -> None:
    """Member i's ``inp`` lands in chunk i of ``out`` (``all_gather_single``, or its older name)."""
    _all_gather(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, *, group) -> None:
    """Reduce-scatter SUM of ``inp`` into ``out`` (member i gets chunk i) over ``group``.

    Gloo's reduce-scatter puts the bytes of a full all-reduce on the wire (2(n-1)/n of ``inp`` per
    rank, measured in docs/benchmarks.md), twice what a ring reduce-scatter needs, which would make
    the hierarchical schedule cross the slow tier with more bytes than the flat one; and any native
    reduce-scatter of a 16-bit input rounds its partial sums at every hop. So on gloo, and for a
    16-bit input on every backend:
      1. all-to-all: chunk j of my input goes to member j ((n-1)/n of ``inp`` per rank, the ring's
         reduce-scatter volume);
      2. sum the n received chunks locally, in member order (the same order on every rank), in fp32
         for a 16-bit input (rounded once, into ``out``'s dtype).
    NCCL keeps its native reduce-scatter for fp32 and fp64 inputs.
    """
    narrow = is_narrow(inp.dtype)
    if dist.get_backend(group) != "gloo" and not narrow:
        _reduce_scatter_native(out, inp, group=group)
        return
    n = dist.get_world_size(group)
    recv = torch.empty_like(inp)
    dist.all_to_all_single(recv, inp, group=group)
    if narrow:
        out.view(-1).copy_(recv.view(n, -1).float().sum(dim=0))
    else:
        torch.sum(recv.view(n, -1), dim=0, out=out.view(-1))


def run(op: str, tier: str, group, groups: ReducerGroups, nbytes: int, record: Record, fn, *,
        like: torch.Tensor | None = None):
    """Issue one collective ``fn()``: on gloo it returns when complete, on NCCL once enqueued.

    The schedule's watch (``groups.watch``, completion.py) holds it from its issue until its data
    has arrived and bounds that by ``fallback.timeout_s``. Failures (a peer died, the group's
    timeout expired) become :class:`CollectiveError` naming op, tier, group and ranks;
    ``record(tier, nbytes, seconds)`` books it. On the CPU the seconds are the wall time of the
    blocking call, i.e. until completion; on CUDA they are the device time between two events
    recorded around the call on the stream that ran it (resolved a step late, never waited: Stats).
    With ``monitor.check_collectives`` (``groups.trace``) the call's fingerprint (communicator, op,
    dtype of ``like``, elements) is traced first.
    """
    trace = getattr(groups, "trace", None)
    if trace is not None:
        ranks = groups.ranks_of(group) if hasattr(groups, "ranks_of") else ()
        trace.add(groups.describe(group), ranks, op, like.dtype if like is not None else "bytes",
                  like.numel() if like is not None else nbytes)
    dev = getattr(groups, "device", None)
    cuda = dev is not None and dev.type == "cuda"
    watch = getattr(groups, "watch", None)
    if cuda and record is not None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    me = groups.dp_ranks[groups.position]
    # The schedule's watch bounds it from here (completion.py): on NCCL the call returns at enqueue.
    flight = watch.begin(op, tier, groups.describe(group), me) if watch is not None else None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        if flight is not None:
            watch.drop(flight)
        waited = time.perf_counter() - t0
        timeout = f", timeout {groups.timeout_s:g}s" if groups.timeout_s else ""
        raise CollectiveError(
            f"topo_align: {op} on the {groups.describe(group)} failed after {waited:.1f}s{timeout} "
            f"(this is global rank {me}, {tier} tier): {type(exc).__name__}: {exc}"
        ) from exc
    if flight is not None:
        if cuda:  # landed when an event after it on this stream has completed (polled, never waited)
            landed = torch.cuda.Event()
            landed.record()
            watch.end(flight, landed.query)
        else:
            watch.end(flight)
    if record is not None:
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            record(tier, nbytes, (start, end))
        else:
            record(tier, nbytes, time.perf_counter() - t0)
    return out


def check_device(t: torch.Tensor, groups: ReducerGroups, what: str) -> None:
    """Every tensor handed to a collective lives on the communication device (``groups.device``):
    NCCL cannot reduce a host tensor, and a silent copy would hide the cost."""
    dev = getattr(groups, "device", None)
    if dev is not None and t.device != dev:
        raise ValueError(f"topo_align: {what} was given a tensor on {t.device}; the communication device of "
                         f"these groups is {dev} (make control tensors with Wire.tensor)")


def _group_size(group) -> int:
    return dist.get_world_size(group)


def flat_all_reduce(t: torch.Tensor, groups: ReducerGroups, *, average: bool = True,
                    record: Record = None) -> torch.Tensor:
    """One all-reduce over the whole data-parallel group (the fallback; what the frameworks do).

    Phases: 1. all-reduce SUM over ``groups.dp_group`` (a 16-bit ``t``: `hop`'s all-to-all, fp32 sum,
    all-gather); 2. divide by the group size when averaging.
    """
    _check(t, "flat_all_reduce", groups)
    n = groups.dp_size
    if n > 1 and is_narrow(t.dtype):
        hop(t.view(-1), t.dtype, None, groups.dp_group, "dp", groups, record, n)
    elif n > 1:
        run("all_reduce", "dp", groups.dp_group, groups, t.numel() * t.element_size(), record,
            lambda: dist.all_reduce(t, group=groups.dp_group), like=t)
    if average and n > 1:
        t.div_(n)
    return t


def residual_numel(numel: int, groups: ReducerGroups, wire: torch.dtype) -> int:
    """Elements of the error-feedback residual of a rail hop that sends ``numel`` elements in ``wire``."""
    n = groups.spine_rail_size if groups.three_level else groups.inter_size
    return hop_residual_numel(rail_numel(numel, groups), n, wire)


def hop(x: torch.Tensor, wire: torch.dtype, residual, group, tier, groups, record, n_contrib) -> torch.Tensor:
    """All-reduce SUM of ``x`` over ``group`` with wire dtype ``wire``; writes and returns ``x``.

    A 16- or 8-bit wire never sums in that dtype: lossy_wire.py's all-to-all, fp32 sum by the
    chunk's owner, all-gather of the sum rounded once (error feedback into ``residual``,
    `hop_residual_numel` elements). A wide wire: one native all-reduce (a 16-bit ``x`` is widened
    first, exactly).
    """
    if n_contrib <= 1:
        return x
    if is_narrow(wire):
        # this module's run and all-gather are handed in (lossy_wire.py sits below this module), read
        # here at each call so that a test's spy on run / _all_gather sees the lossy hops too
        x.copy_(lossy_all_reduce(x, wire, residual, group, tier, groups, record, n_contrib, run=run,
                                 gather=all_gather_flat).view_as(x))
        return x
    w = x if wire == x.dtype else x.to(wire)  # widening (bf16 -> fp32): exact, no feedback needed
    run("all_reduce", tier, group, groups, w.numel() * w.element_size(), record,
        lambda: dist.all_reduce(w, group=group), like=w)
    if w is not x:
        x.copy_(w)
    return x


def rail_numel(n: int, groups: ReducerGroups) -> int:
    """Elements of the slow-tier payload (and of its error-feedback residual) when this rank sends
    ``n`` elements across groups: ``n``, or ``ceil(n / M)`` after the leaf-rail reduce-scatter."""
    return -(-n // groups.leaf_rail_size) if groups.three_level else n


def rail_all_reduce(x: torch.Tensor, groups: ReducerGroups, *, wire: torch.dtype = torch.float32,
                    residual: torch.Tensor | None = None, low_priority: bool = False,
                    record: Record = None) -> torch.Tensor:
    """SUM of ``x`` over my rail (the same chunk of every island), in place; ``x`` flat, contiguous.

    Two levels (the plan's rails): one `hop` over the rail in ``wire`` (lossy: all-to-all, fp32 sum
    by the owner, all-gather; error feedback into ``residual``, `residual_numel` elements).
    Three levels (``topology.middle_level``, `ReducerGroups.three_level`):
      1. reduce-scatter SUM over my leaf rail (M members, fp32, fast leaf tier): chunk ``ceil(n/M)``;
      2. `hop` of the chunk over my spine rail in ``wire`` (residual: `hop_residual_numel` of the chunk);
      3. all-gather of the chunks over the leaf rail.
    The spine then carries 1/M of what one rail all-reduce would.
    """
    if not groups.three_level:
        inter = groups.inter_low if low_priority else groups.inter
        return hop(x, wire, residual, inter, "inter", groups, record, groups.inter_size)
    leaf = groups.leaf_rail_low if low_priority else groups.leaf_rail
    spine = groups.spine_rail_low if low_priority else groups.spine_rail
    M = groups.leaf_rail_size
    buf = _padded(x, M)
    sub = torch.empty(buf.numel() // M, dtype=buf.dtype, device=buf.device)
    run("reduce_scatter", "leaf", leaf, groups, buf.numel() * buf.element_size(), record,
        lambda: _reduce_scatter(sub, buf, group=leaf), like=buf)
    want = hop_residual_numel(sub.numel(), groups.spine_rail_size, wire)
    if residual is not None and residual.numel() != want:
        raise ValueError(f"topo_align: residual has {residual.numel()} elements; the spine chunk needs {want}")
    hop(sub, wire, residual, spine, "inter", groups, record, groups.spine_rail_size)
    run("all_gather", "leaf", leaf, groups, buf.numel() * buf.element_size(), record,
        lambda: _all_gather(buf, sub, group=leaf), like=buf)
    if buf.data_ptr() != x.data_ptr():
        x.reshape(-1).copy_(buf[: x.numel()])
    return x


def _check(t: torch.Tensor, what: str, groups: ReducerGroups | None = None) -> None:
    if groups is not None:
        check_device(t, groups, what)
    # A non-contiguous tensor would be reduced in a temporary copy and the result lost.
    if not t.is_contiguous():
        raise ValueError(f"topo_align: {what} needs a contiguous tensor (got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}); pass a flat buffer or .contiguous()")


def _padded(t: torch.Tensor, k: int) -> torch.Tensor:
    flat = t.reshape(-1)
    n = padded_numel(flat.numel(), k)
    if n == flat.numel():
        return flat
    buf = torch.zeros(n, dtype=t.dtype, device=t.device)
    buf[: flat.numel()].copy_(flat)
    return buf


def hierarchical_all_reduce(t: torch.Tensor, groups: ReducerGroups, *, inter_dtype: torch.dtype = torch.float32,
                            residual: torch.Tensor | None = None, average: bool = True,
                            low_priority: bool = False, record: Record = None) -> torch.Tensor:
    """All-reduce over the data-parallel group that crosses the slow tier with 1/L of the bytes.

    Phases:
      1. reduce-scatter SUM inside the intra group (``t`` padded to a multiple of L = intra size);
      2. all-reduce SUM of my shard over the inter group (the rail) in ``inter_dtype``; when that
         is 16- or 8-bit, all-to-all, fp32 sum by the owner, all-gather (`hop`), error feedback into
         ``residual`` (fp32, ``residual_numel`` of the shard); with ``topology.middle_level`` this
         is `rail_all_reduce`'s leaf reduce-scatter,
         spine all-reduce and leaf all-gather;
      3. divide the shard by L*K when averaging; all-gather the shards inside the intra group.
    Works for any float dtype; ``t`` must be contiguous.
    """
    _check(t, "hierarchical_all_reduce", groups)
    inter_dtype = _as_dtype(inter_dtype)
    L, K = groups.intra_size, groups.inter_size
    intra = groups.intra_low if low_priority else groups.intra
    buf = _padded(t, L)
    if L > 1:
        shard = torch.empty(buf.numel() // L, dtype=buf.dtype, device=buf.device)
        run("reduce_scatter", "intra", intra, groups, buf.numel() * buf.element_size(), record,
             lambda: _reduce_scatter(shard, buf, group=intra), like=buf)
    else:
        shard = buf
    want = residual_numel(shard.numel(), groups, inter_dtype)
    if residual is not None and residual.numel() != want:
        raise ValueError(f"topo_align: residual has {residual.numel()} elements; the rail payload needs {want}")
    rail_all_reduce(shard, groups, wire=inter_dtype, residual=residual, low_priority=low_priority, record=record)
    if average and L * K > 1:
        shard.div_(L * K)
    if L > 1:
        run("all_gather", "intra", intra, groups, buf.numel() * buf.element_size(), record,
             lambda: _all_gather(buf, shard, group=intra), like=buf)
    if buf.data_ptr() != t.data_ptr():
        t.reshape(-1).copy_(buf[: t.numel()])
    return t


def intra_all_reduce(t: torch.Tensor, groups: ReducerGroups, *, wire_dtype: torch.dtype = torch.float32,
                     residual: torch.Tensor | None = None, average: bool = True, low_priority: bool = True,
                     record: Record = None) -> torch.Tensor:
    """All-reduce inside my intra group only (the LOCAL class).

    Phases: 1. `hop` SUM over the group in ``wire_dtype`` (lossy: (FP16) MAX all-reduce of amax for
    a common scale, all-to-all, fp32 sum by the owner, all-gather; error feedback into ``residual``,
    `hop_residual_numel` elements); 2. divide by L when averaging.
    """
    _check(t, "intra_all_reduce", groups)
    wire = _as_dtype(wire_dtype)
    L = groups.intra_size
    group = groups.intra_low if low_priority else groups.intra
    flat = t.reshape(-1)
    hop(flat, wire, residual.reshape(-1) if residual is not None else None, group, "intra", groups, record, L)
    if average and L > 1:
        flat.div_(L)
    return t


def reconcile_average(t: torch.Tensor, groups: ReducerGroups, *, low_priority: bool = True,
                      wire: torch.dtype | None = None, residual: torch.Tensor | None = None,
                      record: Record = None) -> torch.Tensor:
    """Average across groups a tensor that is identical inside each group.

    Phases: 1. each rank takes its 1/L slice (``t`` padded to a multiple of L);
            2. all-reduce SUM of the slice over the inter group (`rail_all_reduce`; in ``wire``, with
               error feedback into ``residual`` when lossy), divide by K;
            3. all-gather the slices inside the intra group.
    The slow tier carries 1/L of ``t`` per rank.
    """
    _check(t, "reconcile_average", groups)
    L, K = groups.intra_size, groups.inter_size
    if K <= 1:
        return t
    intra = groups.intra_low if low_priority else groups.intra
    buf = _padded(t, L)
    m = buf.numel() // L
    chunk = buf[groups.intra_rank * m:(groups.intra_rank + 1) * m].clone()
    rail_all_reduce(chunk, groups, wire=wire or chunk.dtype, residual=residual, low_priority=low_priority,
                    record=record)
    chunk.div_(K)
    if L > 1:
        run("all_gather", "intra", intra, groups, buf.numel() * buf.element_size(), record,
             lambda: _all_gather(buf, chunk, group=intra), like=buf)
    else:
        buf.copy_(chunk)
    if buf.data_ptr() != t.data_ptr():
        t.reshape(-1).copy_(buf[: t.numel()])
    return t


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, groups: ReducerGroups, *, record: Record = None):
    """Reduce-scatter SUM of ``t`` inside my intra group into ``out`` (member i gets chunk i).

    Phases: one ``reduce_scatter_tensor`` over ``groups.intra``; a group of one copies.
    """
    _check(t, "reduce_scatter", groups)
    check_device(out, groups, "reduce_scatter")
    if groups.intra_size == 1:
        out.copy_(t.reshape(-1)[: out.numel()])
        return out
    run("reduce_scatter", "intra", groups.intra, groups, t.numel() * t.element_size(), record,
        lambda: _reduce_scatter(out, t, group=groups.intra), like=t)
    return out


def rail_reduce_scatter(out: torch.Tensor, x: torch.Tensor, groups: ReducerGroups, *,
                        wire: torch.dtype = torch.float32, residual: torch.Tensor | None = None,
                        record: Record = None) -> torch.Tensor:
    """Reduce-scatter SUM of ``x`` over my rail into ``out``: rail member i (by ascending global
    rank) gets chunk i (``x.numel() / K`` elements). ZeRO-3's cross-island step: the slow tier carries
    (K-1)/K of ``x`` instead of an all-reduce's 2(K-1)/K.

    Phases: 1. (FP16 wire) MAX all-reduce of amax over the rail for a common scale; 2. quantise
    (error feedback into ``residual``, shape ``x``); 3. all-to-all in ``wire`` and an fp32 sum of my
    chunk (lossy_wire.py), rounded at most once, into ``out``'s dtype. Always over the two-level
    rail (also with ``middle_level``).
    """
    _check(x, "rail_reduce_scatter", groups)
    check_device(out, groups, "rail_reduce_scatter")
    K, rail = groups.inter_size, groups.inter
    if K == 1:
        out.copy_(x.reshape(-1)[: out.numel()])
        return out
    if out.numel() * K != x.numel():
        raise ValueError(f"topo_align: rail_reduce_scatter of {x.numel()} elements over {K} ranks needs an "
                         f"output of {x.numel() // K}; got {out.numel()}")
    if wire == torch.int8:
        # Only `selective` sends SYNC on int8, and DeepSpeed's adapter refuses selective at ZeRO-3.
        raise ValueError("topo_align: rail_reduce_scatter has no int8 wire (ZeRO-3 runs 'hierarchical', whose "
                         "wire is communication.inter_dtype: fp32, bf16 or fp16)")
    if is_narrow(wire) and is_lossy(x.dtype, wire):
        return lossy_reduce_scatter(out, x, wire, residual, rail, groups, record, K, run=run)
    w = x if wire == x.dtype else x.to(wire)
    o = out if out.dtype == wire or is_narrow(wire) else torch.empty(out.numel(), dtype=wire, device=out.device)
    run("reduce_scatter", "inter", rail, groups, w.numel() * w.element_size(), record,
        lambda: _reduce_scatter(o, w, group=rail), like=w)
    if o is not out:
        out.copy_(o)
    return out


def agree_scalar(x: torch.Tensor, groups: ReducerGroups, op: str = "sum", *, over: str = "dp",
                 record: Record = None) -> torch.Tensor:
    """SUM or MAX of ``x`` over the whole data-parallel group (``over="dp"``) or over my rail
    (``over="inter"``, when the groups already agree inside); every rank gets the same value.

    Phases: one all-reduce over the group of a copy of ``x`` (``x`` is not modified).
    """
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"agree_scalar: op = {op!r}; expected 'sum' or 'max'")
    if over not in ("dp", "inter"):
        raise ValueError(f"agree_scalar: over = {over!r}; expected 'dp' or 'inter'")
    check_device(x, groups, f"agree_scalar({op})")
    y = x.detach().clone()
    group, size, tier = ((groups.dp_group, groups.dp_size, "dp") if over == "dp"
                         else (groups.inter, groups.inter_size, "inter"))
    if size > 1:
        run(f"all_reduce({op.upper()})", tier, group, groups, y.numel() * y.element_size(), record,
            lambda: dist.all_reduce(y, op=ops[op], group=group))
    return y
