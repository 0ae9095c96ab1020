"""A PyTorch DDP communication hook on the engine's dispatcher (docs/reducer.md, "PyTorch DDP").

    state = TopoAlignHookState(ddp_model, cfg)
    ddp_model.register_comm_hook(state, topo_align_hook)
    loss.backward()                        # DDP hands each bucket to the hook; DDP waits on the futures
    state.clip_grad_norm_(1.0)             # optional: the norm every rank agrees on
    optimizer.step(); state.after_optimizer_step(optimizer)   # counts steps; reconciles in `selective`

One DDP bucket, seen from the hook: its parameters (``bucket.parameters()``, laid out back to back
in ``bucket.buffer()``) are mapped to element ranges per class (SYNC, LOCAL) from the engine's
classes, and each class present becomes one :class:`~topo_integrations.reducer.schedule.dispatch.CommBucket`
keyed ``ddp<index>/<class>``. The layout is computed on every call: DDP rebuilds its buckets after
the first iteration (the order gradients became ready), and the engine may change classes at a
reconciliation; when the layout of an index changes, the LOCAL error-feedback residuals follow their
parameters into the new buckets (``_relayout``).

Release points (reducer/schedule/dispatch.py) follow DDP's own order, the same on every rank: DDP calls the
hook for bucket 0, 1, ... in index order. SYNC ranges are released when submitted; on the last bucket
(``bucket.is_last()``) the hook says ``sync_done`` (the held LOCAL ranges of every bucket go) and then
``all_submitted`` (a held asynchronous reconciliation goes), so nothing is held when DDP waits on the
futures at the end of backward. DDP does not divide the gradients when a hook is registered: the
dispatcher averages (``Reduction.MEAN``: SYNC over the DP group, LOCAL over the island).

The optimizer-side calls are GroupedReducer's: ``after_optimizer_step``, ``reconcile``,
``state_dict``/``load_state_dict``, ``stats``, ``global_grad_norm_sq``. ``no_sync()`` works (DDP calls
no hook inside it) and so does ``find_unused_parameters`` (DDP puts zeros in the bucket).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects
# (``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``).
import logging
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import TopoAlignConfig
from ..reducer.classes.classes import LOCAL, SYNC, layer_indices
from ..reducer.classes.importance import Importance
from ..reducer.engine import AdapterTraits, Engine, EngineTensors
from ..reducer.engine.clip import clip_by_norm_
from ..reducer.kinds import Cls
from ..reducer.plan.groups import ReducerGroups
from ..reducer.schedule.dispatch import CommBucket
from ..reducer.schedule.ranges import merge_spans, total
from ..reducer.wire.compression import fold_owner_residual, hop_residual_numel
from ..topology import Plan
from .consistency import verify_replicas
from .reducer import check_config, topology_groups, trainable_parameters
from .view import EngineView

__all__ = ["TopoAlignHookState", "topo_align_hook"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/ddp-hook/v1"


class TopoAlignHookState(EngineView):
    """The hook's state: one engine for one ``DistributedDataParallel`` model (see the module docstring).

    ``groups`` / ``plan``: as GroupedReducer (discovered from ``cfg`` when not given); the engine's
    data-parallel ranks must be those of DDP's process group. ``param_names``: parameter -> name (or
    name -> parameter) when ``ddp_model.module``'s own names are not the ones to classify by.
    Collective over the default group when it discovers or builds the groups.
    """

    def __init__(self, ddp_model: DistributedDataParallel, cfg: TopoAlignConfig, *,
                 groups: ReducerGroups | None = None, plan: Plan | None = None, param_names: dict | None = None,
                 loss_closure: Callable[[], torch.Tensor] | None = None):
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"TopoAlignHookState needs a torch.nn.parallel.DistributedDataParallel model, got "
                            f"{type(ddp_model).__name__} (use GroupedReducer for a bare nn.Module)")
        check_config(cfg, loss_closure, "TopoAlignHookState")
        self.cfg = cfg
        # Weakly: DDP's reducer (C++) holds this state, and a strong reference back would make a cycle
        # the collector cannot see through, keeping a dropped model, its engine and its process groups.
        self._ddp_model = weakref.ref(ddp_model)
        groups, self.fallback_reason = topology_groups(cfg, groups=groups, plan=plan)
        ddp_ranks = sorted(dist.get_process_group_ranks(ddp_model.process_group))
        if ddp_ranks != sorted(groups.dp_ranks):
            raise ValueError(f"topo_align: DDP reduces over global ranks {ddp_ranks}, the topology groups span "
                             f"{sorted(groups.dp_ranks)}; build DDP with process_group covering the same ranks")
        module = ddp_model.module
        self._named = trainable_parameters(module, param_names)
        if not self._named:
            raise ValueError("topo_align: the model has no parameter that requires a gradient")
        self._params = {n: p for n, p in self._named}
        self._name_of = {id(p): n for n, p in self._named}
        names = [n for n, _ in self._named]
        self.device = self._named[0][1].device
        tensors = EngineTensors(names, [p.numel() for _, p in self._named],
                                layers=layer_indices(names, model=module, layer_pattern=cfg.sync.layer_pattern),
                                params=self._params, loss_closure=loss_closure)
        self.engine = Engine(cfg, groups, tensors, device=self.device,
                             traits=AdapterTraits.fixed_layout(workers=cfg.communication.overlap))
        # Reconciliation chunks of the size GroupedReducer uses (the same chunks, the same numbers).
        self.engine.wire.chunk_numel = min(self.engine.wire.chunk_numel,
                                          max(1, int(self.engine.cfg.communication.bucket_size_mb * 1024 * 1024) // 4))
        self._layouts: dict[int, tuple] = {}
        """DDP bucket index -> (parameter names, class version) of its last call."""
        self._carry: dict[str, torch.Tensor] = {}
        """LOCAL residuals of parameters whose DDP bucket was rebuilt, until their new bucket's call."""
        self._sq: dict[str, torch.Tensor] = {}
        """Fisher: squared norms of this step's reduced gradients, folded in at after_optimizer_step."""
        self._optimizer = None
        self.buckets_reduced = 0
        if cfg.adaptive.enabled:
            self.engine.enable_adaptive()

    @property
    def ddp_model(self) -> DistributedDataParallel | None:
        """The DDP model this state reduces for (None once it has been dropped)."""
        return self._ddp_model()

    # ------------------------------------------------------------------ one DDP bucket

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Submit the bucket's classes to the dispatcher; a future of the reduced ``bucket.buffer()``.

        Phases: 1. element spans of each parameter and its class -> ranges per class; 2. SYNC ranges
        (released at once); 3. on the last bucket: sync_done; 4. LOCAL ranges (held until sync_done);
        5. on the last bucket: all_submitted; 6. a future completing when both are done.
        """
        buf = bucket.buffer()
        idx = bucket.index()
        last = bucket.is_last()
        e = self.engine
        spans, names, off = [], [], 0
        for p in bucket.parameters():
            n = self._name_of.get(id(p))
            if n is None:
                raise RuntimeError(f"topo_align: DDP bucket {idx} holds a parameter of shape {tuple(p.shape)} that "
                                   "is not a trainable parameter of ddp_model.module (was the module changed after "
                                   "TopoAlignHookState was built?)")
            names.append(n)
            spans.append((off, off + p.numel(), e.classes[n]))
            off += p.numel()
        if off != buf.numel():
            raise RuntimeError(f"topo_align: DDP bucket {idx} has {buf.numel()} elements, its parameters {off}; "
                               "sparse or padded buckets are not supported")
        if self._layouts.get(idx) != (tuple(names), e.class_version):
            self._relayout(idx, names)
        ranges = merge_spans(spans, (SYNC, LOCAL))
        # Reduced in fp32 (fp64 stays), as GroupedReducer's buckets and Megatron's grad_reduce_in_fp32.
        flat = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
        futs = []
        if ranges[SYNC]:
            whole = total(ranges[SYNC]) == flat.numel()
            futs.append(e.reduce(CommBucket(f"ddp{idx}/sync", flat, None if whole else ranges[SYNC]), Cls.SYNC))
        if last:
            e.sync_done()
        if ranges[LOCAL]:
            futs.append(e.reduce(CommBucket(f"ddp{idx}/local", flat, ranges[LOCAL]), Cls.LOCAL))
        if last:
            e.all_submitted()
        self.buckets_reduced += 1
        fisher = e.tracks_fisher

        def done(fut: torch.futures.Future) -> torch.Tensor:
            for f in fut.value():
                # re-raises a failed reduction for DDP; bounded, and under NCCL's semantics (a future
                # done at enqueue) the data has arrived (host) or the stream waits for it (CUDA)
                e.wait(f)
            if flat is not buf:
                buf.copy_(flat)
            if fisher:
                segs = [flat[s:t] for s, t, _ in spans]
                self._sq.update(zip(names, Importance.sq_norms(segs).unbind()))
            return buf

        return torch.futures.collect_all(futs).then(done)

    def _local_residual(self, idx: int, names) -> tuple[list[str], torch.Tensor | None]:
        """The LOCAL names of a layout and the error-feedback residual of its LOCAL payload (None when
        the LOCAL hop is exact or error feedback is off)."""
        e = self.engine
        loc = [n for n in names if e.classes[n] == LOCAL]
        if not loc:
            return loc, None
        m = sum(e.numels[n] for n in loc)
        return loc, e.wire.residual(f"ddp{idx}/local", hop_residual_numel(m, e.wire.groups.intra_size, e.local_dtype),
                                    torch.float32, e.local_dtype)

    def _relayout(self, idx: int, names: list[str]) -> None:
        """DDP's bucket ``idx`` holds other parameters than at its last call (DDP rebuilt its buckets
        after the first iteration) or the classes changed. The LOCAL residuals are per element (the
        owner's rounding of the sum folded into the sender's part), so they follow their parameters
        into the new layout (GroupedReducer keeps them, and the same numbers
        need the same residuals); after a class change the engine dropped them all already. The
        layouts retired here are every earlier one sharing a parameter with the new one (they are
        rebuilt too, later in this backward); SYNC residuals (a lossy ``sync.dtype``) are per rail
        shard of a bucket and start again from zero (one rounding step)."""
        e = self.engine
        new = set(names)
        for j, (old, version) in list(self._layouts.items()):
            if j != idx and not new & set(old):
                continue
            del self._layouts[j]
            if version == e.class_version:
                loc, r = self._local_residual(j, old)
                if r is not None:  # the owner's rounding of the sum joins my own: nothing is lost
                    g = e.wire.groups
                    r = fold_owner_residual(r, sum(e.numels[n] for n in loc), g.intra_size, g.intra_rank)
                off = 0
                for n in loc:
                    if r is not None:
                        self._carry[n] = r[off:off + e.numels[n]].clone()
                    off += e.numels[n]
            e.wire.reset_residuals(f"ddp{j}/")
        loc, r = self._local_residual(idx, names)
        if r is not None and any(n in self._carry for n in loc):
            per_element = torch.cat([self._carry.pop(n, None) if n in self._carry else r.new_zeros(e.numels[n])
                                     for n in loc])
            r[:per_element.numel()].copy_(per_element)
        self._layouts[idx] = (tuple(names), e.class_version)

    # ------------------------------------------------------------------ after the optimizer step

    def after_optimizer_step(self, optimizer=None) -> None:
        """Count the step; in `selective` apply a pending asynchronous correction, reconcile when due
        (LOCAL parameters and the optimizer state of their shape), re-rank the classes when a refresh
        is due. Call it after every ``optimizer.step()`` in every mode. Collective over the DP group on
        reconciliation steps (the same steps on every rank)."""
        if self._sq:
            sq, self._sq = self._sq, {}
            order = [n for n in self.engine.names if n in sq]
            self.engine.observe(order, torch.stack([sq[n] for n in order]))
        self.engine.after_step(self._source(optimizer), optimizer)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm``; returns the norm.

        In `selective` LOCAL gradients differ between islands, so ``torch.nn.utils.clip_grad_norm_``
        would clip differently per island: the norm here is the agreed one (one fp64 all-reduce)."""
        grads = [p.grad for _, p in self._named if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        local_sq = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()
        norm = self.global_grad_norm_sq(local_sq).sqrt()
        clip_by_norm_(grads, norm, max_norm)  # the factor stays on the device (no host read)
        return norm

    # ------------------------------------------------------------------ state, stats, checks

    def state_dict(self) -> dict:
        """Hook state of THIS rank (residuals differ per rank: save it per rank); waits for an in-flight
        asynchronous reconciliation and keeps it (GroupedReducer.state_dict)."""
        return {"format": STATE_FORMAT, "engine": self.engine.state_dict(),
                "layouts": {i: list(names) for i, (names, _) in self._layouts.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a DDP hook state (format {sd.get('format') if isinstance(sd, dict) else None!r}; "
                             f"expected {STATE_FORMAT!r})")
        self.engine.load_state_dict(sd["engine"])
        # The residuals are per DDP bucket: kept while DDP's layout of an index is the saved one.
        self._layouts = {int(i): (tuple(names), self.engine.class_version) for i, names in sd["layouts"].items()}

    def stats(self) -> dict:
        """Bytes, calls and seconds per tier and class (last step and total) plus the current classes."""
        out = self.engine.stats()
        out.update({"fallback_reason": self.fallback_reason, "buckets_reduced": self.buckets_reduced,
                    "ddp_buckets": {i: len(names) for i, (names, _) in sorted(self._layouts.items())}})
        return out

    def verify_consistency(self) -> None:
        """Invariants 1 and 2 now (GroupedReducer.verify_consistency): SYNC parameters identical on all
        ranks, LOCAL inside each island (all after a reconciliation), the classes everywhere."""
        verify_replicas(self.engine, self._named, str(sorted(self.engine.classes.items())))

    def close(self) -> None:
        """Stop the dispatcher's thread (after what is held has run)."""
        self.engine.close()


def topo_align_hook(state: TopoAlignHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, topo_align_hook)``."""
    return state.reduce_bucket(bucket)
