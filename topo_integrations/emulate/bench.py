"""Side-by-side benchmarks on the emulated cluster: the implementation lives in
:mod:`topo_integrations.bench` (driver, systems, report); this module re-exports its entry points
for code that looks for them beside the emulator."""

from ..bench.driver import PRESETS, BenchError, BenchSpec, run_bench
from ..bench.report import markdown, plot, summarize
from ..bench.systems import DEFAULT_SYSTEMS, SYSTEMS, System, availability, theory_bytes

__all__ = ["PRESETS", "BenchError", "BenchSpec", "run_bench", "markdown", "plot", "summarize", "SYSTEMS",
           "DEFAULT_SYSTEMS", "System", "availability", "theory_bytes"]
