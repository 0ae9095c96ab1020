"""How the bench starts its ranks: forked from one process that imported what they import.

A bench rank used to be a new interpreter per rank and per system (``ip netns exec NS python -m
topo_integrations.bench.worker SPEC``) that imported torch, numpy, the bench's trainers and, for
the ``ds-*`` systems, DeepSpeed before its first step: 3 to 5 CPU seconds a rank, on a machine whose
2 cores also run the ranks that are timed. ``RankStarter`` starts one zygote
(emulate/zygote.py) per bench invocation that imports them once, and every rank of every system is
forked from it into its node's namespace. What a system imports beyond this list (megatron-core,
after its CPU compatibility layer; torchft) it still imports itself. Step times are measured after
the start, so they do not change; where the zygote cannot start, the ranks start as before and the
log says so.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Sequence

__all__ = ["RANK_PRELOAD", "RankStarter"]

RANK_PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.fsdp", "topo_integrations.config",
                "topo_integrations.reducer", "topo_integrations.train.model", "topo_integrations.bench.trainers")
"""What every bench rank imports (``deepspeed`` is added where a ``ds-*`` system runs)."""


class RankStarter:
    """``with RankStarter(systems, log) as s: s.launch(cluster, command, ...)``: the runner's launch
    with the ranks forked from the zygote (or, where it did not start, as new interpreters);
    ``s.how`` says which, for the results."""

    def __init__(self, systems: Sequence[str], log: Callable[[str], None]) -> None:
        self.preload = RANK_PRELOAD + (("deepspeed",) if any(k.startswith("ds-") for k in systems) else ())
        self.log, self.zygote = log, None
        self.how = "a new interpreter per rank (ip netns exec)"

    def __enter__(self) -> "RankStarter":
        from ..emulate.zygote import Zygote, ZygoteError

        try:
            self.zygote = Zygote(self.preload, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", "1")})
        except (OSError, ZygoteError) as exc:
            self.log(f"bench: ranks start as new interpreters: the zygote did not start ({exc})")
            return self
        self.how = f"forked from one process that imported {', '.join(self.zygote.preloaded)}"
        self.log(f"bench: ranks {self.how} (emulate/zygote.py)")
        return self

    def __exit__(self, *exc) -> None:
        if self.zygote is not None:
            self.zygote.close()

    @property
    def launch(self) -> Callable:
        from ..emulate.runner import launch

        return functools.partial(launch, zygote=self.zygote) if self.zygote is not None else launch
