"""The GPUs of this node and their NVLink islands, read through the `Machine` seam.

In order, the first that answers:
  1. NVML (``pynvml``, when importable and live): device names; two GPUs are in one island when
     NVML reports NVLink peer-to-peer between them; links per GPU = its active NVLinks;
  2. ``nvidia-smi topo -m`` (islands, NVLink counts; `nvidia_smi.parse_nvidia_smi`) with
     ``nvidia-smi --query-gpu=name --format=csv,noheader`` for the model;
  3. ``rocm-smi --showtopo`` (XGMI islands; `rocm_smi.parse_rocm_topo`; link speed not read);
  4. none: no GPU, no fast tier (the host's ranks form one island at the default bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import NVLINK_EFFICIENCY, NVLINK_GBPS_PER_LINK
from .machine import Machine
from .model import TopologyError
from .nvidia_smi import connected_components, parse_nvidia_smi
from .rocm_smi import parse_rocm_topo

__all__ = ["GpuFacts", "read_gpus", "NVIDIA_TOPO", "NVIDIA_NAMES", "ROCM_TOPO"]

NVIDIA_TOPO = ("nvidia-smi", "topo", "-m")
NVIDIA_NAMES = ("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
ROCM_TOPO = ("rocm-smi", "--showtopo")


@dataclass(frozen=True)
class GpuFacts:
    device: str
    """Device model (``NVIDIA A100-SXM4-80GB``), ``cpu`` when the node has no GPU."""
    count: int
    islands: tuple[tuple[int, ...], ...]
    links: int
    """NVLinks per GPU inside its island (0: none, or not known)."""
    origin: str
    """``nvml``, ``nvidia-smi``, ``rocm-smi`` or ``none``."""
    missing: tuple[str, ...] = ()


def _from_nvml(nv: Any) -> GpuFacts:
    try:
        n = nv.nvmlDeviceGetCount()
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        names = [nv.nvmlDeviceGetName(h) for h in handles]
        names = [x.decode() if isinstance(x, bytes) else str(x) for x in names]
        edges = [(a, b) for a in range(n) for b in range(a + 1, n)
                 if nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], nv.NVML_P2P_CAPS_INDEX_NVLINK)
                 == nv.NVML_P2P_STATUS_OK]
        links = []
        for h in handles:
            active = 0
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                try:
                    active += nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
                except nv.NVMLError:  # a link index this GPU does not have
                    break
            links.append(active)
    except Exception as exc:  # noqa: BLE001 - any NVML failure is a named fact error
        raise TopologyError(f"NVML: reading the GPUs failed ({type(exc).__name__}: {exc})") from None
    if n == 0:
        return GpuFacts("cpu", 0, (), 0, "nvml", ("GPUs (NVML reports none)",))
    islands = connected_components(n, edges)
    in_island = [links[g] for isl in islands if len(isl) > 1 for g in isl]
    return GpuFacts(names[0], n, tuple(tuple(i) for i in islands), min(in_island) if in_island else 0, "nvml")


def _from_nvidia_smi(machine: Machine, text: str) -> GpuFacts:
    layout = parse_nvidia_smi(text, source=f"`{' '.join(NVIDIA_TOPO)}` ({machine.describe()})")
    names_text = machine.command(NVIDIA_NAMES)
    missing: list[str] = []
    device = "NVIDIA GPU"
    if names_text is None:
        missing.append(f"GPU model (`{' '.join(NVIDIA_NAMES)}` not available)")
    else:
        names = [line.strip() for line in names_text.splitlines() if line.strip()]
        if len(names) != layout.gpus:
            raise TopologyError(f"`{' '.join(NVIDIA_NAMES)}` ({machine.describe()}) lists {len(names)} GPUs but "
                                f"`{' '.join(NVIDIA_TOPO)}` has {layout.gpus}; the two must describe the same GPUs")
        device = names[0]
    links = 0
    if layout.island_tier is not None:
        links = round(layout.island_tier.bandwidth_gbps / (NVLINK_GBPS_PER_LINK * NVLINK_EFFICIENCY))
    return GpuFacts(device, layout.gpus, layout.islands, links, "nvidia-smi", tuple(missing))


def read_gpus(machine: Machine) -> GpuFacts:
    """This node's GPUs (see the module docstring for the order of the sources)."""
    nv = machine.nvml()
    if nv is not None:
        try:
            return _from_nvml(nv)
        finally:
            try:
                nv.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down is best effort
                pass
    text = machine.command(NVIDIA_TOPO)
    if text is not None:
        return _from_nvidia_smi(machine, text)
    text = machine.command(ROCM_TOPO)
    if text is not None:
        islands = parse_rocm_topo(text, source=f"`{' '.join(ROCM_TOPO)}` ({machine.describe()})")
        n = sum(len(i) for i in islands)
        return GpuFacts("AMD GPU", n, tuple(tuple(i) for i in islands), 0, "rocm-smi",
                        ("XGMI link bandwidth (rocm-smi --showtopo gives link types, not speeds)",))
    return GpuFacts("cpu", 0, (), 0, "none", ("NVLink islands (no NVML, nvidia-smi or rocm-smi on this node)",))
