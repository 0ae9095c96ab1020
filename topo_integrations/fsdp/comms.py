"""FSDP2's reduce-scatter in fp32 when its reduce dtype is 16-bit (``set_custom_reduce_scatter``).

With ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` FSDP2 reduce-scatters bf16 gradients
and the collective forms its sums in bf16, rounding at every hop (invariant 6 of docs/design.md:
sums are formed in fp32). The adapter gives such a module :class:`IslandReduceScatter`: the island
reduce-scatter is the engine's (an ISLAND bucket: an all-to-all of the bf16 chunks, the sum formed in
fp32 by the chunk's owner), its fp32 result goes on to the all-reduce hook (the rail hop sums in fp32
too) and is rounded to the reduce dtype once, into FSDP2's output buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..reducer.kinds import Cls
from ..reducer.schedule.dispatch import Collective, CommBucket

__all__ = ["IslandReduceScatter"]


class IslandReduceScatter(ReduceScatter):
    """One module's reduce-scatter (module docstring). ``adapter``: the TopoAlignFSDP; ``unit``: the module's
    parameter group (seams.py)."""

    def __init__(self, adapter, unit):
        self.adapter = adapter
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"topo_align: FSDP2 asked {self.unit.key} for a {op} reduce-scatter; the adapter sets "
                               "set_force_sum_reduction_for_comms(True) and expects SUM")
        e = self.adapter.engine
        fp32 = torch.empty(output_tensor.numel(), dtype=torch.float32, device=output_tensor.device)
        e.wait(e.reduce(CommBucket(f"{self.unit.key}/island", input_tensor.view(-1), collective=Collective.ISLAND,
                                   out=fp32), Cls.SYNC))
        self.adapter.island_sum(self.unit, fp32)
        output_tensor.view(-1).copy_(fp32)
        return None
