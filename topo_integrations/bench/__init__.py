"""Side-by-side training benchmarks on an emulated cluster (`topo-align bench`, docs/benchmarks.md).

  systems.py  the systems compared (stock DeepSpeed, Megatron, PyTorch DDP and its hooks, post-local
              SGD, topo-align's modes), whether each can run here, and each algorithm's theoretical
              cross-node bytes per step
  worker.py   one rank of one system: same model, data, seed and schedule for every system
  driver.py   builds the data once, starts the emulated cluster once, runs the systems one at a time,
              reads the interface counters around each run's training window
  report.py   summary statistics, time to target loss, the Markdown table and the PNG plots
  presets.py  the emulated clusters and what a preset sets (2x2-long: the long-horizon comparison)
  budget.py   equal wall-clock budgets and validation curves (time to a loss, where one curve is below)
  longrun.py  the long-horizon report: time to flat quality, goal rows, validation-vs-time plot

Uses the emulator (topo_integrations.emulate) and the topology; frameworks are imported only inside
the worker processes.
"""

from .systems import DEFAULT_SYSTEMS, SYSTEMS, System

__all__ = ["SYSTEMS", "DEFAULT_SYSTEMS", "System"]
