"""TopoAlignFSDP: the engine behind FSDP2's gradient reduction (docs/fsdp.md).

The model is ``fully_shard``-ed on a 1-D mesh per island (``island_mesh(groups)["shard"]``), so
FSDP2's reduce-scatter of each module's gradients stays inside the island. One backward, seen from
the adapter:

  reduce-scatter  FSDP2's, over the island, SUM (``set_force_sum_reduction_for_comms``: with a divide
                  factor other than the island size FSDP2 would use ``ReduceOp.PREMUL_SUM``, which
                  gloo refuses); with a 16-bit reduce dtype it is the engine's instead
                  (``set_custom_reduce_scatter``: an ISLAND bucket, fp32 sums kept for the hook).
  all-reduce hook FSDP2 hands the reduce-scatter output (this rank's padded shard of every parameter
                  of the module, seams.py) to ``set_all_reduce_hook``: the SYNC ranges go to the
                  engine as one RAIL bucket (all-reduce SUM over the rail, whose members hold the same
                  shard; wire ``sync.dtype`` / ``communication.inter_dtype``, error feedback keyed
                  ``fsdp<i>/sync``), LOCAL ranges are scaled by the number of islands (the island's
                  estimate of the sum); the hook returns once the data is there (CPU) or the caller's
                  stream waits for it (CUDA: FSDP2 runs the hook on its all-reduce stream).
  divide          FSDP2 divides by ``islands x island size`` (``set_gradient_divide_factor``): SYNC
                  gradients are the global mean, LOCAL ones the island mean.
  end of backward an autograd callback tells the engine the step's buckets are submitted (held
                  reconciliation chunks may go).

``set_requires_all_reduce(False)`` (accumulate island sums): the hook keeps the fp32 island sum and
zeroes what FSDP2 accumulates; the next hook call with the flag on adds it and crosses islands once,
so non-final micro-steps send nothing across islands (native HSDP's ``partial_reduce_output``).
``set_requires_gradient_sync(False)``: FSDP2 reduces nothing and calls no hook.

After ``optimizer.step()`` call ``after_optimizer_step(optimizer)``: it counts the step and, in
`selective`, reconciles LOCAL shards and their optimizer moments across islands every
``local.reconcile_interval`` steps (the rail partners hold the same shard: ``shard=True`` items).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..config import TopoAlignConfig
from ..reducer.classes.classes import LOCAL, SYNC, layer_indices
from ..reducer.classes.importance import Importance
from ..reducer.engine import AdapterTraits, Engine, EngineTensors
from ..reducer.kinds import Cls
from ..reducer.plan.groups import ReducerGroups
from ..reducer.reconcile.reconcile import ReconcileItem, is_second_moment
from ..reducer.schedule.dispatch import Collective, CommBucket, Reduction
from ..reducer.schedule.ranges import merge_spans, total
from ..topology import Plan
from ..torch.reducer import topology_groups
from ..torch.view import EngineView
from .mesh import check_mesh_rows, island_rows
from .refusals import check_config, refuse_setup
from .seams import Unit, mesh_kind, reduce_dtype, shard_ranks, units_of

__all__ = ["TopoAlignFSDP", "ShardSource", "STATE_FORMAT"]

log = logging.getLogger("topo_align")

STATE_FORMAT = "topo-align/fsdp/v1"
NARROW = (torch.bfloat16, torch.float16)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage FSDP2 all-gathers from), else ``t`` itself."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


class _Shards(Mapping):
    """name -> this rank's shard of the parameter now (the magnitude scores read it at a refresh)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return local_of(self._params[name])

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class ShardSource:
    """What `selective` reconciles under FSDP2: this rank's shard of every LOCAL parameter (drift is
    measured on it) and of every optimizer-state tensor of the parameter's shape, as ``shard=True``
    items (the rail partners hold the same shard). FSDP2 all-gathers the shards at the next forward,
    so nothing is to be done after writing them."""

    def __init__(self, params: dict[str, torch.Tensor], optimizer=None):
        self.params = params
        self.optimizer = optimizer

    def items(self, local: list[str]) -> list[ReconcileItem]:
        out = [ReconcileItem(f"param:{n}", local_of(self.params[n]), shard=True, param=n) for n in local]
        state = getattr(self.optimizer, "state", None) or {}
        for n in local:
            p = self.params[n]
            st = state.get(p, {})
            for k in sorted(st):
                v = st[k]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                    out.append(ReconcileItem(f"state:{n}:{k}", local_of(v), shard=True, nonneg=is_second_moment(k),
                                             state=True))
        return out

    def written(self) -> None:
        pass


class _EngineCheckpoint:
    """The engine's state of every rank as one ``torch.distributed.checkpoint`` entry: a value per
    rank, keyed by the rank (a DCP key held by several ranks is written once), packed into bytes so
    that DCP neither flattens nor deduplicates its tensors (``Stateful``: DCP calls both methods)."""

    def __init__(self, owner: "TopoAlignFSDP"):
        self.owner = owner
        self.key = f"rank{dist.get_rank()}"

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.owner.state_dict(), buf)
        return {self.key: buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        if self.key not in sd or not isinstance(sd[self.key], bytes):
            raise ValueError(f"topo_align: the checkpoint holds no FSDP adapter state for {self.key} (saved with "
                             "another world size?)")
        self.owner.load_state_dict(torch.load(io.BytesIO(sd[self.key]), weights_only=True))


class TopoAlignFSDP(EngineView):
    """See the module docstring; built by :func:`~topo_integrations.fsdp.apply`.

    ``model``: ``fully_shard`` applied to it (and usually its blocks) with an island mesh;
    ``groups`` / ``plan``: the engine's groups (discovered from ``cfg`` when not given; the islands
    must be the ones the model is sharded over). Collective over the default group when it builds
    groups, then over the data-parallel group (the start-of-run check, the agreed initial classes).
    """

    def __init__(self, model: nn.Module, cfg: TopoAlignConfig, *, groups: ReducerGroups | None = None,
                 plan: Plan | None = None, mesh=None):
        check_config(cfg)
        self.cfg = cfg
        self.model = model
        units = units_of(model)
        if not units:
            raise refuse_setup(f"a model without fully_shard modules ({type(model).__name__})",
                               "the adapter hooks FSDP2's reduce-scatters", "call fully_shard(...) on the model first")
        groups, self.fallback_reason = topology_groups(cfg, groups=groups, plan=plan)
        for u in units:
            kind = mesh_kind(u)
            where = f"fully_shard module {u.key} ({type(u.module).__name__})"
            if kind != "shard":
                raise refuse_setup(
                    f"{where} on a {'2-D (HSDP)' if kind == 'hsdp' else 'replicate-only'} mesh",
                    "FSDP2 then all-reduces across replicas itself and calls the all-reduce hook after that",
                    "shard on the island: fully_shard(..., mesh=island_mesh(groups)['shard'])")
            check_mesh_rows(shard_ranks(u), groups, where)
        if mesh is not None and mesh.ndim == 2 and mesh.mesh.tolist() != island_rows(groups):
            raise ValueError(f"topo_align: the mesh's rows {mesh.mesh.tolist()} are not the plan's islands "
                             f"{island_rows(groups)}; build it with island_mesh(groups)")
        self.units = units
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        managed = {id(p) for u in units for p, _ in u.segments()}
        self._named = [(n, p) for n, p in self._named if id(p) in managed]
        if not self._named:
            raise ValueError("topo_align: the model has no FSDP2-managed parameter that requires a gradient")
        self._params = dict(self._named)
        self._ids = {id(p): n for n, p in self._named}
        names = [n for n, _ in self._named]
        self.device = local_of(self._named[0][1]).device
        tensors = EngineTensors(names, [p.numel() for _, p in self._named],
                                layers=layer_indices(names, model=model, layer_pattern=cfg.sync.layer_pattern),
                                params=_Shards(self._params))
        self.engine = Engine(cfg, groups, tensors, device=self.device, traits=AdapterTraits.fixed_layout(workers=True))
        self._agree_initial_classes()
        self._optimizer = None
        self._partial: dict[int, torch.Tensor] = {}
        """Unit index -> fp32 island sums of micro-steps under ``set_requires_all_reduce(False)``."""
        self._fp32: dict[int, torch.Tensor] = {}
        """Unit index -> the fp32 island sum of this backward (16-bit reduce dtype), for the hook."""
        self._sq: dict[str, torch.Tensor] = {}
        self._in_backward = False
        self.hook_calls = 0
        self.deferred = 0
        """Hook calls that kept island sums for a later micro-step (``set_requires_all_reduce(False)``)."""
        self._install()
        if cfg.adaptive.enabled:
            self.engine.enable_adaptive()

    # ------------------------------------------------------------------ set-up

    def _agree_initial_classes(self) -> None:
        """`selective` with a top fraction: rank the tensors by magnitude, agreed over the DP group
        (each rank holds a shard, so its own magnitudes are not everyone's), as GroupedReducer ranks
        its full replicas at start."""
        e = self.engine
        top = e.cfg.sync.top_fraction
        if not (e.selective and 0.0 < top < 1.0):
            return
        mine = Importance.magnitude([local_of(p) for _, p in self._named]).double()
        agreed = e.wire.agree(mine.to(self.device), "sum") / e.groups.dp_size
        e.reconfigure(classes=e.policy.classify(agreed.cpu().tolist()))

    def _install(self) -> None:
        from .comms import IslandReduceScatter

        g = self.engine.groups
        L, K = g.intra_size, g.inter_size
        for u in self.units:
            m = u.module
            # every trainable parameter in every reduce-scatter (zeros without a gradient): a fixed layout
            m.set_reduce_scatter_unused_params(True, recurse=False)
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(float(L * K))
            if K == 1:  # one island: FSDP2's reduce-scatter is the whole reduction
                continue
            m.set_all_reduce_hook(self._hook(u))
            if reduce_dtype(u) in NARROW:
                m.set_custom_reduce_scatter(IslandReduceScatter(self, u))
        if K == 1 and g.position == 0:
            log.info("topo_align: FSDP2 adapter: one island (%s); FSDP2's reduce-scatter over it is the whole "
                     "reduction", self.fallback_reason or "a one-tier plan")

    def _hook(self, unit: Unit):
        def hook(out: torch.Tensor) -> None:
            self.reduce_output(unit, out)
        return hook

    # ------------------------------------------------------------------ one reduce-scatter output

    def _name(self, p) -> str:
        n = self._ids.get(id(p))
        if n is None:  # a load with assign=True replaced the parameter objects: map them again
            self._ids = {id(q): k for k, q in self.model.named_parameters() if k in self._params}
            self._params.update({k: q for k, q in self.model.named_parameters() if k in self._params})
            n = self._ids.get(id(p))
        if n is None:
            raise RuntimeError(f"topo_align: FSDP2 reduces a parameter of shape {tuple(p.shape)} that is not one "
                               "of the model's when the adapter was applied (was the model changed after apply()?)")
        return n

    def layout(self, unit: Unit, numel: int) -> tuple[list[tuple[int, int, str]], list[str]]:
        """``(start, end, class)`` of every parameter's segment of the unit's reduce-scatter output,
        and the names; raises when FSDP2's output does not have the expected size."""
        e = self.engine
        spans, names, off = [], [], 0
        for p, k in unit.segments():
            n = self._name(p)
            spans.append((off, off + k, e.classes[n]))
            names.append(n)
            off += k
        if off != numel:
            raise RuntimeError(f"topo_align: FSDP2's reduce-scatter output of {unit.key} "
                               f"({type(unit.module).__name__}) has {numel} elements, its parameters' padded shards "
                               f"{off} (set_reduce_scatter_unused_params was turned off?)")
        return spans, names

    def island_sum(self, unit: Unit, fp32: torch.Tensor) -> None:
        """The custom reduce-scatter's fp32 island sum of this backward, for the hook."""
        self._fp32[unit.index] = fp32

    def reduce_output(self, unit: Unit, out: torch.Tensor) -> None:
        """The all-reduce hook (module docstring): cross-island step of one reduce-scatter output."""
        e = self.engine
        self.hook_calls += 1
        self._open_backward()
        flat = self._fp32.pop(unit.index, None)
        if flat is None:
            flat = out if out.dtype in (torch.float32, torch.float64) else out.float()
        if not unit.all_reduce_grads:  # set_requires_all_reduce(False): keep the island sum, send nothing
            kept = self._partial.get(unit.index)
            self._partial[unit.index] = flat.clone() if kept is None else kept.add_(flat)
            out.zero_()
            self.deferred += 1
            return
        kept = self._partial.pop(unit.index, None)
        if kept is not None:
            flat.add_(kept)
        spans, names = self.layout(unit, flat.numel())
        ranges = merge_spans(spans, (SYNC, LOCAL))
        if ranges[SYNC]:
            whole = total(ranges[SYNC]) == flat.numel()
            e.wait(e.reduce(CommBucket(f"{unit.key}/sync", flat, None if whole else ranges[SYNC],
                                       reduction=Reduction.SUM, collective=Collective.RAIL), Cls.SYNC))
        k = e.groups.inter_size
        for s, t in ranges[LOCAL]:
            flat[s:t].mul_(k)  # the island's estimate of the sum over every rank
        if flat is not out:
            out.copy_(flat)
        if e.tracks_fisher:
            self._sq.update(zip(names, Importance.sq_norms([flat[s:t] for s, t, _ in spans]).unbind()))

    def _open_backward(self) -> None:
        """First hook call of a backward: the end of the backward tells the engine (an autograd callback)."""
        if self._in_backward:
            return
        self._in_backward = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        except RuntimeError:  # not inside a backward: closed at after_optimizer_step
            pass

    def _end_backward(self) -> None:
        if self._in_backward:
            self._in_backward = False
            self.engine.sync_done()
            self.engine.all_submitted()

    # ------------------------------------------------------------------ after the optimizer step

    def _source(self, optimizer) -> ShardSource:
        if optimizer is not None:
            self._optimizer = optimizer
        return ShardSource(self._params, self._optimizer)

    def after_optimizer_step(self, optimizer=None) -> None:
        """Count the step; in `selective` apply a pending asynchronous correction, reconcile when due
        (LOCAL shards and their optimizer moments), re-rank the classes when a refresh is due. Call it
        after every ``optimizer.step()``. Collective over the DP group on reconciliation steps."""
        self._end_backward()
        if self._partial:
            keys = ", ".join(self.units[i].key for i in sorted(self._partial))
            raise RuntimeError(f"topo_align: an optimizer step with island-only gradients pending ({keys}): the last "
                               "micro-step's backward must run with set_requires_all_reduce(True)")
        if self._sq:
            sq, self._sq = self._sq, {}
            order = [n for n in self.engine.names if n in sq]
            self.engine.observe(order, torch.stack([sq[n] for n in order]))
        self.engine.after_step(self._source(optimizer), optimizer)
        self.log_step("FSDP2 adapter")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm is at most ``max_norm``; returns the norm, equal on
        every rank: the global norm, or in `selective` ``sqrt(mean over islands of |g_island|^2)``
        (one fp64 all-reduce of this rank's shard's squared norm over the DP group, / islands).
        ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients would give each island its own
        norm when LOCAL gradients differ."""
        grads = [local_of(p.grad) for _, p in self._named if p.grad is not None]
        e = self.engine
        mine = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum() if grads else \
            torch.zeros((), dtype=torch.float64)
        norm = (e.wire.agree(mine.reshape(1).to(self.device), "sum") / e.groups.inter_size).sqrt().reshape(())
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1 and grads:
            torch._foreach_mul_(grads, scale)
        return norm

    # ------------------------------------------------------------------ state and stats

    def state_dict(self) -> dict:
        """State of THIS rank (residuals differ per rank); no collective (invariant 7). Reconcile first
        (``reconcile(optimizer)``) so that a `selective` checkpoint holds identical replicas."""
        return {"format": STATE_FORMAT, "engine": self.engine.state_dict(), "units": [u.key for u in self.units]}

    def load_state_dict(self, sd: dict) -> None:
        got = sd.get("format") if isinstance(sd, dict) else None
        if got != STATE_FORMAT:
            raise ValueError(f"not an FSDP adapter state (format {got!r}; expected {STATE_FORMAT!r})")
        if sd["units"] != [u.key for u in self.units]:
            raise ValueError(f"topo_align: the state was saved with {len(sd['units'])} fully_shard modules, this "
                             f"model has {len(self.units)}; the error-feedback residuals are per module")
        self.engine.load_state_dict(sd["engine"])

    def checkpoint_state(self) -> _EngineCheckpoint:
        """This adapter's entry for ``torch.distributed.checkpoint``: ``dcp.save({..., "topo_align":
        ta.checkpoint_state()}, ...)`` and the same dict to ``dcp.load`` (docs/fsdp.md)."""
        return _EngineCheckpoint(self)

    def stats(self) -> dict:
        out = self.engine.stats()
        out.update({"fallback_reason": self.fallback_reason, "units": len(self.units),
                    "hook_calls": self.hook_calls, "deferred": self.deferred})
        return out

    def close(self) -> None:
        """Stop the dispatcher's thread; a later reduction through the hooks fails with a clear error."""
        self.engine.close()

