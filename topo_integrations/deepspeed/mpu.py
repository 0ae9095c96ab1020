"""An ``mpu`` that makes DeepSpeed's data-parallel group the island (selective at ZeRO-1/2).

DeepSpeed 0.19.8 reads exactly these methods (traced in docs/deepspeed.md):
``get_data_parallel_{group,world_size,rank}`` (engine DP group = ZeRO partition group, batch
arithmetic, sampler rank) and ``get_model_parallel_{group,world_size,rank}`` (norm / overflow
reductions, checkpoint names). It probes ``initialize_sequence_parallel`` and the
``get_sequence_*``, ``get_tensor_model_parallel_*``, ``get_pipe*`` names with ``hasattr``: they must
stay ABSENT, or DeepSpeed takes the mpu for an Ulysses/TP one.

The model-parallel group is a 1-rank group (so ``is_parallel`` is False and every parameter counts
in the norm); creating it is collective over the world (one ``new_group`` per rank, in rank order).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["IslandMPU"]


class IslandMPU:
    def __init__(self, groups) -> None:
        self._groups = groups
        me = dist.get_rank()
        solo = None
        for r in range(dist.get_world_size()):  # collective: every rank creates every singleton
            g = dist.new_group(ranks=[r])
            if r == me:
                solo = g
        self._solo = solo

    def get_data_parallel_group(self):
        return self._groups.intra

    def get_data_parallel_world_size(self) -> int:
        return self._groups.intra_size

    def get_data_parallel_rank(self) -> int:
        return self._groups.intra_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return sorted(self._groups.intra_ranks)

    def get_model_parallel_group(self):
        return self._solo

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0
