"""The engine's collectives: one set of groups, one communication device, one error-feedback store.

Every adapter issues its gradient, reconciliation and control collectives through a :class:`Wire`:

* lossy hops (FP16/BF16/INT8 wire) keep their rounding errors (the sender's and the owner's of the
  sum) in a residual named by a *key* the adapter chooses (e.g. ``"sync/3"`` for bucket 3 of the SYNC
  class); :meth:`Wire.residual` creates it (and re-creates it when the element count changed, e.g.
  after a class change), so there is one error-feedback scheme (compression.py, lossy_wire.py) for
  everybody;
* every tensor handed to a collective must be on the communication device (``groups.device``):
  collectives.py checks it, and :meth:`Wire.tensor` makes the small control tensors (norms,
  overflow flags, scores) there, so with NCCL nothing is sent from the host;
* bytes and seconds go to the engine's :class:`~topo_integrations.reducer.engine.stats.Stats` per tier and
  class (``sync``, ``local``, ``reconcile``, ``control``).
"""

from __future__ import annotations

import torch

from . import collectives as C
from .compression import is_lossy

__all__ = ["Wire", "Agreed"]


class Wire:
    def __init__(self, groups, *, device, error_feedback: bool, stats, chunk_numel: int = 1 << 18):
        self.groups = groups
        self.device = torch.device(device)
        if getattr(groups, "device", None) is None:
            groups.device = self.device
        self.error_feedback = error_feedback
        self.stats = stats
        self.chunk_numel = max(1, int(chunk_numel))
        """Elements per reconciliation chunk (1 MiB of fp32 by default; adapters cap it at their bucket
        size): the unit the dispatcher places into the window before the next SYNC bucket, so small
        enough that most of a reconciliation fits there."""
        self._residuals: dict[str, torch.Tensor] = {}
        self._rec = {c: stats.recorder(c) for c in ("sync", "local", "reconcile", "control")}
        self.dispatch = None
        """The engine's Dispatcher: control collectives (:meth:`agree`) are issued through it, so that
        they take their place in the one schedule (dispatch.py)."""

    # ------------------------------------------------------------------ helpers

    def record(self, cls: str):
        return self._rec[cls]

    def tensor(self, values, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A small control tensor on the communication device (never a host tensor on NCCL)."""
        return torch.as_tensor(values, dtype=dtype).to(self.device).reshape(-1)

    def residual(self, key: str, numel: int, src: torch.dtype, wire: torch.dtype) -> torch.Tensor | None:
        """The fp32 error-feedback residual ``key`` of ``numel`` elements; None when the hop is exact
        or error feedback is off."""
        if not self.error_feedback or not is_lossy(src, wire):
            return None
        r = self._residuals.get(key)
        if r is None or r.numel() != numel:
            r = torch.zeros(numel, dtype=torch.float32, device=self.device)
            self._residuals[key] = r
        return r

    def reset_residuals(self, prefix: str = "") -> None:
        """Drop the residuals whose key starts with ``prefix`` (all by default)."""
        for k in [k for k in self._residuals if k.startswith(prefix)]:
            del self._residuals[k]

    def residual_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._residuals.items()}

    def load_residual_state(self, sd: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: v.to(self.device).clone() for k, v in sd.items()}

    # ------------------------------------------------------------------ collectives (in place)

    def flat_(self, t: torch.Tensor, *, cls: str = "sync", average: bool = True) -> torch.Tensor:
        """One all-reduce over the data-parallel group (the `flat` mode / adaptive flat level)."""
        return C.flat_all_reduce(t, self.groups, average=average, record=self._rec[cls])

    def hierarchical_(self, t: torch.Tensor, *, key: str, wire: torch.dtype, cls: str = "sync",
                      average: bool = True, low_priority: bool = False) -> torch.Tensor:
        """Island reduce-scatter, rail all-reduce of the shard in ``wire`` (error feedback under
        ``key``), island all-gather (three levels with ``topology.middle_level``)."""
        g = self.groups
        res = self.residual(key, C.residual_numel(-(-t.numel() // g.intra_size), g, wire), t.dtype, wire)
        return C.hierarchical_all_reduce(t, g, inter_dtype=wire, residual=res, average=average,
                                         low_priority=low_priority, record=self._rec[cls])

    def intra_(self, t: torch.Tensor, *, key: str, wire: torch.dtype, cls: str = "local",
               average: bool = True) -> torch.Tensor:
        """All-reduce inside the island only (LOCAL class, ``intra_low``), error feedback under ``key``."""
        res = self.residual(key, C.hop_residual_numel(t.numel(), self.groups.intra_size, wire), t.dtype, wire)
        return C.intra_all_reduce(t, self.groups, wire_dtype=wire, residual=res, average=average,
                                  low_priority=True, record=self._rec[cls])

    def rail_(self, t: torch.Tensor, *, key: str, wire: torch.dtype, cls: str = "sync",
              average: bool = False, low_priority: bool = False) -> torch.Tensor:
        """All-reduce over my rail only (the same shard of every island), error feedback under ``key``:
        the inter hop of a reduction whose island step a framework already did (ZeRO-1/2 with the
        island as DeepSpeed's DP group, Megatron's distributed optimizer)."""
        g = self.groups
        res = self.residual(key, C.residual_numel(t.numel(), g, wire), t.dtype, wire)
        C.check_device(t, g, "rail all-reduce")
        C.rail_all_reduce(t.view(-1), g, wire=wire, residual=res, low_priority=low_priority, record=self._rec[cls])
        if average and g.inter_size > 1:
            t.div_(g.inter_size)
        return t

    def rail_reduce_scatter_(self, out: torch.Tensor, t: torch.Tensor, *, key: str, wire: torch.dtype,
                             cls: str = "sync") -> torch.Tensor:
        """Reduce-scatter SUM of ``t`` over my rail into ``out`` (rail member i gets chunk i), in
        ``wire`` with error feedback under ``key`` (ZeRO-3's cross-island step)."""
        res = self.residual(key, t.numel(), t.dtype, wire)
        return C.rail_reduce_scatter(out, t, self.groups, wire=wire, residual=res, record=self._rec[cls])

    def reduce_scatter_intra_(self, out: torch.Tensor, t: torch.Tensor, *, cls: str = "sync") -> torch.Tensor:
        """Reduce-scatter SUM of ``t`` inside the island into ``out`` (member i gets chunk i)."""
        return C.reduce_scatter(out, t, self.groups, record=self._rec[cls])

    def reconcile_chunks(self, flat: torch.Tensor, *, shard: bool, wire: torch.dtype = torch.float32,
                         key: str = "reconcile") -> list:
        """Mean across islands of ``flat`` (fp32) as one closure per chunk of ``chunk_numel`` (the
        dispatcher issues them; a lossy ``wire`` keeps each chunk's rounding error under
        ``key/<chunk>``). ``shard``: a per-rank partition (rail all-reduce / K); else identical inside
        the island (1/L per member over the rail, then an island all-gather)."""
        g = self.groups
        out = []
        for i, start in enumerate(range(0, flat.numel(), self.chunk_numel)):
            part = flat[start:start + self.chunk_numel]
            if shard:
                def job(part=part, i=i):
                    self.rail_(part, key=f"{key}/s{i}", wire=wire, cls="reconcile", average=True, low_priority=True)
            else:
                def job(part=part, i=i):
                    res = self.residual(f"{key}/r{i}", C.residual_numel(-(-part.numel() // g.intra_size), g, wire),
                                        part.dtype, wire)
                    C.reconcile_average(part, g, low_priority=True, wire=wire, residual=res,
                                        record=self._rec["reconcile"])
            out.append(job)
        return out

    def agree(self, x: torch.Tensor, op: str = "sum", *, over: str = "dp", cls: str = "control",
              host: bool = False) -> torch.Tensor:
        """SUM or MAX of ``x`` over the DP group (``over="dp"``) or my rail (``"inter"``); a copy.
        Through the dispatcher when there is one (its place in the schedule). On CUDA the value is
        the caller's stream's to use (a stream wait; the host does not wait for it); ``host``: the
        value as a host tensor, for a decision the caller takes on the host (:meth:`agree_later`)."""
        return self.agree_later(x, op, over=over, cls=cls, host=host).value()

    def agree_later(self, x: torch.Tensor, op: str = "sum", *, over: str = "dp", cls: str = "control",
                    host: bool = True) -> "Agreed":
        """:meth:`agree` issued now, its value read later (:class:`Agreed`). ``host``: the value is
        copied to the host on the communication stream inside the agreement (CUDA: a non-blocking
        copy into pinned memory, done when the item has landed), so reading it waits for that item
        only, never for the training stream's later work (no ``.cpu()`` on the caller's stream)."""
        def fn():
            y = C.agree_scalar(x, self.groups, op, over=over, record=self._rec[cls])
            return y.to("cpu", non_blocking=self.dispatch is not None) if host else y
        if self.dispatch is None:
            return Agreed(None, value=fn())
        return Agreed(self.dispatch, self.dispatch.issue(fn, f"agree({op}) over {over}", cls), host=host)


class Agreed:
    """An agreement issued in the schedule (:meth:`Wire.agree_later`) whose value is read later: the
    host waits (bounded, :meth:`Dispatcher.collect`) only when it reads a value not landed yet."""

    def __init__(self, dispatch, item=None, *, value=None, host: bool = True):
        self.dispatch, self.item, self._value, self.host = dispatch, item, value, host

    def landed(self) -> bool:
        """Whether :meth:`value` returns without waiting."""
        return self.dispatch is None or self.dispatch.landed(self.item)

    def value(self) -> torch.Tensor:
        """The agreed tensor (raises the agreement's error, if it failed): a host copy that has
        landed (``host``), or a device tensor the caller's stream waits for."""
        return self._value if self.dispatch is None else self.dispatch.collect(self.item, host=self.host)
