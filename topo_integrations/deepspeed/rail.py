"""ZeRO-1/2 `selective`: the SYNC slices of the gradient partition over the rail, issued as DeepSpeed's
island buckets finish (during backward), waited for in the optimizer's ``step``.

With DeepSpeed's data-parallel group = the island (mpu.py), every rank owns one partition of the flat
gradient, and its rail partners (the same member of every other island) own the same partition. The
SYNC elements of that partition are all-reduced over the rail and divided by the number of islands
(zero.py, step 1). This module issues that all-reduce in chunks as soon as their gradients are final,
instead of all of it after backward:

* **A fixed plan** (:class:`RailPlan`): the SYNC slices of this rank's partition, in the order
  backward produces them (parameter groups and parameters in reverse), cut into chunks of at most
  DeepSpeed's ``reduce_bucket_size`` elements. It depends only on the layout and the classes, so the
  rail partners hold the same plan.
* **Capture at the bucket** (:meth:`SyncRail.bucket_reduced`, after DeepSpeed's ``reduce_ipg_grads``
  at the accumulation boundary): the island-averaged slice of each reduced SYNC parameter is copied
  out, as DeepSpeed will hold it in ``averaged_gradients`` (earlier micro-steps' sum + this one at
  ZeRO-2; the compact fp32 partition buffer as is).
* **Release in plan order**: chunk c is submitted (a SYNC RAIL bucket of the dispatcher) once all its
  slices are captured and chunks 0..c-1 were submitted. Submission is in program order from the
  thread running backward, so the released sequence is the plan's on every rank; only when it happens
  may differ (a parameter without a gradient on one rank is never captured: its chunk and the later
  ones go at :meth:`SyncRail.finish`, from ``averaged_gradients``).
* **Finish** (the optimizer's ``step``, before DeepSpeed's): the remaining chunks go, every chunk is
  waited for (bounded) and written into ``averaged_gradients``. With ``monitor.check_collectives``
  on, each early chunk's sent values are compared with ``averaged_gradients`` first (a DeepSpeed
  change that alters a gradient after its bucket was reduced fails loudly instead of silently).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from ..reducer.classes.classes import SYNC
from ..reducer.schedule.dispatch import Collective, CommBucket
from ..reducer.schedule.ranges import put, take

__all__ = ["RailPlan", "SyncRail", "RailMismatchError", "build_plan", "flat_offsets"]


class RailMismatchError(RuntimeError):
    """A SYNC gradient slice changed between its bucket's reduction and the optimizer step."""


@dataclass
class Piece:
    """One SYNC parameter's slice of this rank's partition of parameter group ``group``."""

    group: int
    name: str
    param: torch.Tensor
    part: tuple[int, int]
    """Element range in partition coordinates (``averaged_gradients[group]`` flattened)."""
    src: tuple[int, int]
    """The same elements in the parameter's own flat coordinates."""
    index: int
    """Position of the parameter in ``params_in_partition[group]`` (DeepSpeed's accumulation list)."""


@dataclass
class Chunk:
    key: str
    pieces: list[Piece]
    numel: int = 0


@dataclass
class RailPlan:
    chunks: list[Chunk]
    by_param: dict[int, list[tuple[int, Piece]]] = field(default_factory=dict)
    """id(param) -> (chunk index, piece) for every piece of that parameter."""


def flat_offsets(opt, i: int) -> list[tuple[str, int, int]]:
    """(name, start, end) of each parameter of group ``i`` inside ``bit16_groups_flat[i]``."""
    flat = opt.bit16_groups_flat[i]
    base = flat.data_ptr()
    size = flat.element_size()
    out = []
    for p in opt.bit16_groups[i]:
        start = (p.data_ptr() - base) // size
        out.append((opt.topo_align_param_names[id(p)], start, start + p.numel()))
    return out


def build_plan(opt, slices, chunk_numel: int) -> RailPlan:
    """The chunks of this rank's SYNC slices, in backward order (see the module docstring)."""
    e = opt.topo_align.engine
    pieces: list[Piece] = []
    for i in reversed(range(len(slices))):
        _sync, _local, per_param = slices[i]
        offsets = {name: start for name, start, _end in flat_offsets(opt, i)}
        pos = {id(p): k for k, p in enumerate(opt.params_in_partition[i])}
        params = {opt.topo_align_param_names[id(p)]: p for p in opt.bit16_groups[i]}
        lo = int(opt.partition_size[i]) * tdist.get_rank(group=opt.real_dp_process_group[i])
        for name, a, b in reversed(per_param):
            if not e.is_sync(name):
                continue
            p = params[name]
            start = offsets[name] - lo  # the parameter's first element, in partition coordinates
            pieces.append(Piece(i, name, p, (a, b), (a - start, b - start), pos[id(p)]))
    chunks: list[Chunk] = []
    for pc in pieces:
        n = pc.part[1] - pc.part[0]
        if not chunks or (chunks[-1].numel + n > chunk_numel and chunks[-1].pieces):
            chunks.append(Chunk(f"sync/rail/{len(chunks)}", []))
        chunks[-1].pieces.append(pc)
        chunks[-1].numel += n
    plan = RailPlan(chunks)
    for c, ch in enumerate(chunks):
        for pc in ch.pieces:
            plan.by_param.setdefault(id(pc.param), []).append((c, pc))
    return plan


class SyncRail:
    """One per ZeRO-1/2 `selective` optimizer (see the module docstring)."""

    def __init__(self, opt):
        self.opt = opt
        self.overlap = True
        """False: every chunk goes at :meth:`finish` (the serial path before issue 30; for measurements)."""
        self._plan: RailPlan | None = None
        self._plan_of = None
        self._captured: dict[int, dict[int, torch.Tensor]] = {}
        """chunk -> piece position -> the captured slice (this step)."""
        self._futs: list = []
        self._sent: list = []
        self._t_submit: list[float] = []
        self.figures: list[dict] = []
        """Per optimizer step: ``chunks``, ``early`` (submitted before ``finish``), ``t_first_submit``,
        ``t_finish`` (``step`` entered), ``t_sync_end`` (last chunk done), all ``time.perf_counter``."""

    # ------------------------------------------------------------------ plan

    def plan(self) -> RailPlan:
        slices = self.opt._topo_slices()
        if self._plan is None or self._plan_of is not slices:
            self._plan = build_plan(self.opt, slices, max(1, int(self.opt.reduce_bucket_size)))
            self._plan_of = slices
        return self._plan

    # ------------------------------------------------------------------ during backward

    def bucket_reduced(self, params: list[torch.Tensor]) -> None:
        """DeepSpeed finished the island reduction of ``params`` (one call per ``reduce_ipg_grads``):
        at the accumulation boundary, capture their SYNC slices and submit the chunks now complete."""
        opt = self.opt
        if not self.overlap or not opt.is_gradient_accumulation_boundary():
            return
        plan = self.plan()
        for p in params:
            for c, pc in plan.by_param.get(id(p), ()):
                v = self._value(pc)
                if v is not None:
                    self._captured.setdefault(c, {})[id(pc)] = v
        self._release(plan, upto=len(plan.chunks), flats=None)

    def _value(self, pc: Piece) -> torch.Tensor | None:
        """The slice as DeepSpeed's ``averaged_gradients`` will hold it after the epilogue, or None
        when it cannot be known now (then the chunk goes at finish)."""
        opt, i = self.opt, pc.group
        if opt._use_compact_grad_partition_buffer(i):
            # fp32 partition buffer: the bucket's reduction was added into it in place.
            ag = opt.averaged_gradients.get(i)
            flat = getattr(ag, "flat_partition", None)
            return None if flat is None else flat[pc.part[0]:pc.part[1]].clone()
        g = opt.get_param_gradient_attribute(pc.param)
        if g is None:
            return None
        s, e = pc.src
        cur = g.reshape(-1)[s:e]
        acc = opt.all_grad_tensors.get(i) if isinstance(opt.all_grad_tensors, dict) else None
        if acc is None:
            return cur.clone()
        # ZeRO-2 with accumulation: the epilogue will add this micro-step to the earlier ones
        # (``accumulated_grad.add_(new_avg_grad)``); the same elementwise add, on a copy.
        return acc[pc.index].reshape(-1)[s:e].clone().add_(cur)

    # ------------------------------------------------------------------ release

    def _release(self, plan: RailPlan, *, upto: int, flats) -> None:
        """Submit chunks in plan order while they are complete (captured, or ``flats`` given: read
        from ``averaged_gradients``)."""
        e = self.opt.topo_align.engine
        while len(self._futs) < upto:
            c = len(self._futs)
            ch = plan.chunks[c]
            got = self._captured.get(c, {})
            if len(got) == len(ch.pieces):
                buf = torch.cat([got[id(pc)].reshape(-1) for pc in ch.pieces])
                early = True
            elif flats is not None:
                buf = self._from_flats(ch, flats)
                early = False
            else:
                return
            self._sent.append((buf.clone() if early and self._checking() else None, early))
            self._t_submit.append(time.perf_counter())
            # Rail partners hold the same partition, hence the same plan and the same chunk sizes.
            self._futs.append(e.reduce(CommBucket(ch.key, buf, collective=Collective.RAIL), SYNC))

    def _from_flats(self, ch: Chunk, flats) -> torch.Tensor:
        parts = []
        for pc in ch.pieces:
            flat = flats[pc.group]
            if flat is None:  # no gradient partition: send zeros, keep the collectives paired
                dtype = self.opt.single_partition_of_fp32_groups[pc.group].dtype
                dev = self.opt.topo_align.engine.device
                parts.append(torch.zeros(pc.part[1] - pc.part[0], dtype=dtype, device=dev))
            else:
                parts.append(take(flat, [pc.part]))
        return torch.cat(parts)

    def _checking(self) -> bool:
        return self.opt.topo_align.engine.dispatcher.trace is not None

    # ------------------------------------------------------------------ step

    def finish(self, flats: list) -> None:
        """Phases: 1. submit the chunks not yet submitted, from ``flats`` (this rank's
        island-averaged partition per group, DeepSpeed's ``averaged_gradients`` flattened);
        2. wait for every chunk in plan order (bounded) and write it into ``flats`` (already / islands).
        With the check on, an early chunk's sent values must equal ``flats`` (RailMismatchError)."""
        t_finish = time.perf_counter()
        e = self.opt.topo_align.engine
        plan = self.plan()
        n_early = len(self._futs)
        if self._checking():
            for c in range(n_early):
                sent, early = self._sent[c]
                if early and sent is not None:
                    want = self._from_flats(plan.chunks[c], flats)
                    if not torch.equal(sent.to(want.dtype), want):
                        names = [p.name for p in plan.chunks[c].pieces]
                        raise RailMismatchError(
                            f"topo_align: SYNC rail chunk {plan.chunks[c].key} ({names}) "
                            "changed between its bucket's island reduction and the optimizer step; the DeepSpeed "
                            "version's gradient accumulation differs from what deepspeed/rail.py expects")
        self._release(plan, upto=len(plan.chunks), flats=flats)
        for ch, fut in zip(plan.chunks, self._futs):
            buf = e.wait(fut)
            for pc, off in zip(ch.pieces, _offsets(ch)):
                flat = flats[pc.group]
                if flat is not None:
                    put(flat, [pc.part], buf[off:off + pc.part[1] - pc.part[0]])
        if plan.chunks:
            self.figures.append({"chunks": len(plan.chunks), "early": n_early,
                                 "t_first_submit": self._t_submit[0], "t_finish": t_finish,
                                 "t_sync_end": time.perf_counter()})  # every chunk waited for
            del self.figures[:-1000]
        self._captured, self._futs, self._sent, self._t_submit = {}, [], [], []


def _offsets(ch: Chunk) -> list[int]:
    out, off = [], 0
    for pc in ch.pieces:
        out.append(off)
        off += pc.part[1] - pc.part[0]
    return out
