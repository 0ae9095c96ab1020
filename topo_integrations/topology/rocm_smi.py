"""``rocm-smi --showtopo`` text -> the GPUs of one AMD node and their XGMI islands.

Only the ``Link Type between two GPUs`` block is read: a matrix with a ``GPU0 GPU1 ...`` header and
one row per GPU whose cells are ``0`` on the diagonal and ``XGMI``, ``PCIE`` (or ``N/A``) elsewhere.
Islands are the connected components of the XGMI links (``nvidia_smi.connected_components``).
"""

from __future__ import annotations

from .model import TopologyError
from .nvidia_smi import connected_components

__all__ = ["parse_rocm_topo", "LINK_TYPES"]

LINK_TYPES = ("XGMI", "PCIE", "N/A")
_SECTION = "link type between two gpus"


def parse_rocm_topo(text: str, *, source: str = "rocm-smi --showtopo") -> list[list[int]]:
    """XGMI islands (sorted lists of GPU indices); a `TopologyError` naming the line on bad input."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION in line.lower()), None)
    if start is None:
        raise TopologyError(f"{source}: no 'Link Type between two GPUs' block; expected `rocm-smi --showtopo` output")
    header_at = next((i for i in range(start + 1, len(lines)) if lines[i].split()[:1] == ["GPU0"]), None)
    if header_at is None:
        raise TopologyError(f"{source}: line {start + 1}: the link-type block has no 'GPU0 GPU1 ...' header")
    cols = lines[header_at].split()
    if cols != [f"GPU{i}" for i in range(len(cols))]:
        raise TopologyError(f"{source}: line {header_at + 1}: header {cols[:4]}...; expected GPU0, GPU1, ... in order")
    n = len(cols)
    edges: list[tuple[int, int]] = []
    for a in range(n):
        i = header_at + 1 + a
        toks = lines[i].split() if i < len(lines) else []
        if len(toks) != n + 1 or toks[0] != f"GPU{a}":
            raise TopologyError(f"{source}: line {i + 1}: {' '.join(toks)[:60]!r}; expected 'GPU{a}' and {n} cells")
        for b, cell in enumerate(toks[1:]):
            if a == b:
                if cell != "0":
                    raise TopologyError(f"{source}: line {i + 1}: GPU{a} to itself is {cell!r}; expected 0")
            elif cell.upper() not in LINK_TYPES:
                raise TopologyError(
                    f"{source}: line {i + 1}: GPU{a} to GPU{b} is {cell!r}; accepted: {', '.join(LINK_TYPES)}")
            elif cell.upper() == "XGMI":
                edges.append((a, b))
    return connected_components(n, edges)
