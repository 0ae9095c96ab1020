"""Adapters for plain PyTorch (docs/reducer.md): any ``nn.Module`` and ``DistributedDataParallel``.

  buckets.py      flat gradient buckets in reverse registration order (GroupedReducer's)
  reducer.py      GroupedReducer: buckets filled from post-accumulate-grad hooks, for any nn.Module
  ddp_hook.py     TopoAlignHookState + topo_align_hook: a DDP comm hook on the same engine
  consistency.py  ConsistencyError and the replica check both use

Like the DeepSpeed and Megatron adapters they only map their buffers to the engine's buckets
(reducer/schedule/dispatch.py); every collective is the engine's. Inside this package ``import torch`` is
still PyTorch (absolute imports).
"""

from .consistency import ConsistencyError
from .ddp_hook import TopoAlignHookState, topo_align_hook
from .reducer import GroupedReducer

__all__ = ["GroupedReducer", "ConsistencyError", "TopoAlignHookState", "topo_align_hook"]
