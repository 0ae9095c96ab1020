"""The emulated clusters `topo-align bench --preset` names, and what a preset sets by default.

A preset is a topology file, a node uplink rate and, for the long-horizon preset, the defaults of
a whole comparison (model, steps, schedule, evaluation, wall-clock budget, repeats, systems); every
default yields to the flag that sets the same field (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Preset", "PRESETS", "LONG_SYSTEMS", "LONG_SYSTEMS_MANY", "REFERENCE"]

REFERENCE = "ds-zero0"
"""The reference system: its time for ``--steps`` steps is the wall-clock budget of every other
system in the same round (``equal_budget``), its final validation loss sets "flat quality"."""

LONG_SYSTEMS = ("ds-zero0", "ddp", "ddp-fp16", "post-local-sgd", "megatron-distopt", "topo-hier",
                "topo-selective", "ds-topo-selective", "ds-topo-selective-z1")
"""Systems of the long-horizon preset, in run order (the reference first: it sets the budget)."""

LONG_SYSTEMS_MANY = ("ds-zero0", "post-local-sgd", "topo-hier", "topo-selective")
"""Systems of the 4- and 8-island long presets (8 ranks on the machine's cores: one round of the
systems the goals compare, plus topo-align hierarchical; ``--localsgd-sweep`` adds post-local SGD's
other periods)."""


@dataclass(frozen=True)
class Preset:
    topology: str
    """Path relative to the repository root."""
    group_by: str
    uplink_mbit: float
    description: str
    middle_level: bool = False
    """topo-align systems reduce over three levels (``topology.middle_level``)."""
    model: str | None = None
    """A workload shape of ``bench.cli.MODELS`` this preset uses unless ``--model`` names another."""
    defaults: dict = field(default_factory=dict)
    """BenchSpec fields this preset sets unless a flag sets them."""
    systems: tuple[str, ...] | None = None
    """Default ``--systems`` (None: every system)."""


LONG_DEFAULTS = dict(
    steps=400, warmup_steps=20, lr_schedule="constant", eval_interval=25, eval_batches=8, equal_budget=True,
    repeats=2, comm_share=True, timeout_s=2400.0)
"""2x2-long: 400 steps of stock ZeRO-0 set the budget (docs/benchmarks.md, "The long-horizon preset": why 400 and
why constant after a 20-step warm-up); validation on 8 held-out micro-batches every 25 steps; two
interleaved rounds; the comm share of ZeRO-0 re-measured in the same run."""

PRESETS: dict[str, Preset] = {
    "2x2": Preset("configs/topologies/virtual-2x2.json", "island", 200.0,
                  "2 nodes x 2 ranks, node uplinks 200 Mbit/s; intra-node on loopback (topology: 20:1)"),
    "2x2-long": Preset("configs/topologies/virtual-2x2.json", "island", 100.0,
                       "2 nodes x 2 ranks, node uplinks 100 Mbit/s, the deep GPT; every system trains for stock "
                       "DeepSpeed ZeRO-0's wall time of --steps steps, validation loss along the run",
                       model="deep", defaults=LONG_DEFAULTS, systems=LONG_SYSTEMS),
    "4x2-long": Preset("configs/topologies/virtual-4x2.json", "island", 100.0,
                       "4 nodes x 2 ranks (4 islands, 8 ranks), node uplinks 100 Mbit/s, the deep GPT; 2x2-long's "
                       "equal wall-clock comparison at 4 islands (issue 31)",
                       model="deep", defaults=LONG_DEFAULTS | {"repeats": 1}, systems=LONG_SYSTEMS_MANY),
    "8x1-long": Preset("configs/topologies/virtual-8x1.json", "island", 100.0,
                       "8 nodes x 1 rank (8 islands of one rank), node uplinks 100 Mbit/s, the deep GPT; 2x2-long's "
                       "equal wall-clock comparison at 8 islands (issue 31)",
                       model="deep", defaults=LONG_DEFAULTS | {"repeats": 1}, systems=LONG_SYSTEMS_MANY),
    "4x1": Preset("configs/topologies/virtual-4x1.json", "island", 200.0,
                  "4 nodes x 1 rank under one leaf, node uplinks 200 Mbit/s (a flat cluster)"),
    "2leaf": Preset("configs/topologies/virtual-2leaf.json", "leaf", 200.0,
                    "2 leaves x 2 nodes x 1 rank, node uplinks 200 Mbit/s, spine 2:1 oversubscribed"),
    "2leaf8": Preset("configs/topologies/virtual-2leaf-8.json", "island", 200.0,
                     "2 leaves x 2 nodes x 2 ranks (8 ranks), node uplinks 200 Mbit/s, spine 2:1 "
                     "oversubscribed; topo-align reduces over three levels (island, leaf rail, spine rail)",
                     middle_level=True),
}
