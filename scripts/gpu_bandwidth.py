"""The int8 wire's kernels against the GPU's memory bandwidth (scripts/gpu_check.py, ``wire-bandwidth``).

Timed with CUDA events (median of ``REPEATS`` after ``WARMUP``), on 2^26 fp32 elements (256 MiB, far
beyond L2), three operations of reducer/wire/compression.py and lossy_wire.py:

* ``pack``: ``quantize_blocks(v, residual)`` -- fp32 to int8 blocks with one fp32 scale per 256
  elements, the rounding error kept for error feedback (what a sender does);
* ``unpack``: ``dequantize_blocks(q, scale)`` -- int8 blocks back to fp32;
* ``owner-sum``: what the owner of a chunk does between the all-to-all and the all-gather of a lossy
  hop: decode the chunk from each of ``MEMBERS`` members and sum them in fp32.

Each is charged the bytes it must move at least (read once, write once: :func:`min_bytes`) and its
achieved GB/s is compared with a device-to-device copy of as many bytes (``Tensor.copy_``: what the
GPU streams in practice) and with the nominal HBM bandwidth (:func:`nominal_hbm_gbps`). The goal is
80 % of HBM; the case fails when an operation is below ``floor`` times HBM (``--bandwidth-floor``,
default 0.8: the goal).
"""

from __future__ import annotations

import os

NUMEL = 1 << 26
MEMBERS = 8
WARMUP, REPEATS = 3, 15
GOAL = 0.8
FLOOR_ENV = "GPU_CHECK_BANDWIDTH_FLOOR"

HBM_GBPS = {"H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0,
            "H200": 4800.0, "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100 80GB PCIe": 1935.0}
"""Published HBM bandwidth by device name, for a torch whose device properties lack the memory clock."""


def nominal_hbm_gbps(props) -> tuple[float | None, str]:
    """(GB/s, where it came from): double data rate x bus width x memory clock from the device's
    properties, else the published figure of a known device name, else (None, why)."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2 * bus_bits / 8 * clock_khz * 1e3 / 1e9, (
            f"device properties: {bus_bits}-bit bus at {clock_khz / 1e3:.0f} MHz, double data rate")
    name = getattr(props, "name", "")
    for key, gbps in HBM_GBPS.items():
        if key in name:
            return gbps, f"published figure for {key}"
    return None, f"unknown for {name!r} (no memory clock in the device properties)"


def min_bytes(op: str, numel: int, members: int = MEMBERS, block: int = 256) -> int:
    """Bytes ``op`` must read and write at least for ``numel`` fp32 elements of payload."""
    scales = numel // block * 4
    if op == "pack":  # read v, write q, the residual and the scales
        return numel * 4 + numel + numel * 4 + scales
    if op == "unpack":  # read q and the scales, write fp32
        return numel + scales + numel * 4
    if op == "owner-sum":  # read every member's int8 chunk and scales, write one fp32 chunk
        return numel + scales + numel // members * 4
    raise ValueError(f"unknown operation {op!r}")


def _time_ms(fn, dev) -> float:
    import torch

    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize(dev)
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2]


def _copy_gbps(nbytes: int, dev) -> float:
    """A device-to-device copy that reads and writes ``nbytes`` in all."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return nbytes / _time_ms(lambda: dst.copy_(src), dev) / 1e6


def run(name: str, rank: int, dev):
    import torch

    from topo_integrations.reducer.wire.compression import dequantize_blocks, quantize_blocks

    floor = float(os.environ.get(FLOOR_ENV, GOAL))
    props = torch.cuda.get_device_properties(dev)
    hbm, source = nominal_hbm_gbps(props)
    g = torch.Generator(device=dev).manual_seed(0)
    v = torch.randn(NUMEL, device=dev, generator=g)
    residual = torch.empty_like(v)
    q, scale = quantize_blocks(v, residual)
    m = NUMEL // MEMBERS
    ops = {
        "pack": lambda: quantize_blocks(v, residual),
        "unpack": lambda: dequantize_blocks(q, scale),
        # the owner's decode and fp32 sum of MEMBERS chunks (lossy_wire.py, int8 blocks), in member order
        "owner-sum": lambda: dequantize_blocks(q, scale).view(MEMBERS, m).sum(dim=0),
    }
    out, worst = {}, None
    for op, fn in ops.items():
        nbytes = min_bytes(op, NUMEL)
        ms = _time_ms(fn, dev)
        gbps = nbytes / ms / 1e6
        copy = _copy_gbps(nbytes, dev)
        rec = {"bytes": nbytes, "ms": ms, "gbps": gbps, "copy_gbps": copy, "of_copy": gbps / copy}
        if hbm:
            rec["of_hbm"] = gbps / hbm
            worst = rec["of_hbm"] if worst is None else min(worst, rec["of_hbm"])
        out[op] = rec
    data = {"device": props.name, "hbm_gbps": hbm, "hbm_source": source, "numel": NUMEL, "members": MEMBERS,
            "goal": GOAL, "floor": floor, "ops": out}
    parts = [f"{op} {r['gbps']:.0f} GB/s = {100 * r.get('of_hbm', float('nan')):.0f}% of HBM, "
             f"{100 * r['of_copy']:.0f}% of a copy" for op, r in out.items()]
    if hbm is None:
        return "FAIL", f"nominal HBM bandwidth {source}; " + "; ".join(parts), data
    ok = worst >= floor
    return ("PASS" if ok else "FAIL"), (
        f"{'; '.join(parts)} (HBM {hbm:.0f} GB/s, {source}; goal {100 * GOAL:.0f}%, floor {100 * floor:.0f}%)"), data
