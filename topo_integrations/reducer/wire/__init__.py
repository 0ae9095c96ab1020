"""The wire: what crosses a link. It owns the wire formats and error feedback (`compression.py`:
wire dtypes, the FP16 scale, int8 blocks), the lossy hops that sum in fp32 at the chunk's owner
(`lossy_wire.py`), the collectives on flat tensors (`collectives.py`: flat, hierarchical, rail,
reconcile, `agree_scalar`, and `run`, through which every collective is issued, traced, timed and
named), the engine's `Wire` (residuals by key, the communication device: `wire.py`), the adapters'
other collectives (`replicas.py`) and the probes and start-of-run check of every communicator
(`health.py`). It sits on the plan (groups) and the watch (errors, completion).
"""
