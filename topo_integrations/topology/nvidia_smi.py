"""``nvidia-smi topo -m`` text -> the `NodeLayout` of one node.

Accepted shapes (docs/topology-format.md, ``nvidia-smi``): a header row of device columns (``GPU0 .. GPUn``, then
either ``NIC0 ..`` with a ``NIC Legend:`` block, or the older ``mlx5_N`` columns), followed by
``CPU Affinity`` etc.; one row per device; cells separated by tabs or spaces. Lines before the header
(comments, the ``$ nvidia-smi topo -m`` prompt) and the ``Legend:`` block are skipped.

NVLink islands are the connected components of the ``NV#`` entries between GPUs, so an NVSwitch
node is one island of 8 and a box of NVLink-bridged pairs has islands of 2.
"""

from __future__ import annotations

import re

from .layout import NodeLayout, island_tier_from_links, read_source_text
from .model import TopologyError

__all__ = ["parse_nvidia_smi", "load_nvidia_smi", "connected_components", "CELL_VALUES"]

CELL_VALUES = ("X", "SYS", "SOC", "NODE", "PHB", "PXB", "PIX", "NV<n>")
_PCIE = {"SYS", "SOC", "NODE", "PHB", "PXB", "PIX"}  # SOC: older drivers' name for SYS
_DEVICE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*\d$")
_GPU = re.compile(r"^GPU(\d+)$")
_NV = re.compile(r"^NV(\d{1,3})$")
_LEGEND_ENTRY = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
MAX_GPUS = 4096


def connected_components(n: int, edges: list[tuple[int, int]]) -> list[list[int]]:
    """Connected components of the graph on ``0..n-1`` (union-find), each sorted, in order of their
    smallest member; used for NVLink islands here and in the NCCL XML source."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def links_per_gpu(island: list[int], nv: dict[tuple[int, int], int]) -> int:
    """NVLinks a GPU of ``island`` can drive inside it.

    nvidia-smi prints ``NV12`` for *every* peer behind NVSwitches (the GPU has 12 links in all), but
    ``NV1``/``NV2`` per direct peer in a hybrid cube mesh (links add up). A full mesh with one count
    is read as switched (or a bridged pair); otherwise the smallest per-GPU sum is taken.
    """
    if len(island) == 1:
        return 0
    counts = {nv.get((a, b), 0) for a in island for b in island if a != b}
    if len(counts) == 1 and 0 not in counts:
        return counts.pop()
    return min(sum(nv.get((a, b), 0) for b in island if b != a) for a in island)


def parse_nvidia_smi(text: str, *, source: str = "nvidia-smi") -> NodeLayout:
    """Parse the text of ``nvidia-smi topo -m``; raises `TopologyError` naming the line on bad input."""
    if not isinstance(text, str):
        raise TopologyError(f"{source}: expected text, got {type(text).__name__}")
    lines = text.splitlines()
    header_at = None
    columns: list[str] = []
    for i, line in enumerate(lines):
        toks = line.split()
        if toks and toks[0] == "GPU0":
            header_at = i
            for t in toks:
                if not _DEVICE.match(t):
                    break
                columns.append(t)
            break
    if header_at is None:
        raise TopologyError(
            f"{source}: no header row starting with 'GPU0'; expected the output of `nvidia-smi topo -m`"
        )
    if len(columns) > MAX_GPUS + 1024:
        raise TopologyError(
            f"{source}: line {header_at + 1}: {len(columns)} device columns; at most {MAX_GPUS + 1024} accepted"
        )
    gpus = [c for c in columns if _GPU.match(c)]
    if [c for c in columns[: len(gpus)]] != [f"GPU{i}" for i in range(len(gpus))]:
        raise TopologyError(
            f"{source}: line {header_at + 1}: GPU columns must come first as GPU0, GPU1, ... in order; "
            f"got {columns[: len(gpus) + 1]}"
        )
    n = len(gpus)
    col_index = {c: j for j, c in enumerate(columns)}
    if len(col_index) != len(columns):
        raise TopologyError(f"{source}: line {header_at + 1}: a device column is named twice")

    rows: dict[str, list[str]] = {}
    nic_legend: dict[str, str] = {}
    in_legend = False
    for i in range(header_at + 1, len(lines)):
        line = lines[i]
        toks = line.split()
        if not toks:
            continue
        if toks[0].rstrip(":") in ("Legend", "NIC") and line.strip().endswith(":"):
            in_legend = True
            continue
        if in_legend:
            m = _LEGEND_ENTRY.match(line)
            if m:
                nic_legend[m.group(1)] = m.group(2)
            continue
        if toks[0] not in col_index:
            if toks[0].startswith(("#", "$")):
                continue
            raise TopologyError(
                f"{source}: line {i + 1}: row {toks[0]!r} is not one of the header's devices {columns[:4]}...; "
                "expected one row per device column"
            )
        name = toks[0]
        if name in rows:
            raise TopologyError(f"{source}: line {i + 1}: row {name!r} appears twice")
        cells = toks[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            raise TopologyError(
                f"{source}: line {i + 1}: row {name!r} has {len(cells)} cells; "
                f"expected {len(columns)} (one per device column)"
            )
        for j, cell in enumerate(cells):
            ok = (cell == "X") == (j == col_index[name]) and (cell == "X" or cell in _PCIE or _NV.match(cell))
            if not ok:
                raise TopologyError(
                    f"{source}: line {i + 1}: row {name!r}, column {columns[j]!r} = {cell!r}; "
                    f"accepted: {', '.join(CELL_VALUES)} ('X' only on the diagonal)"
                )
        rows[name] = cells
    missing = [g for g in gpus if g not in rows]
    if missing:
        raise TopologyError(f"{source}: no row for {missing[0]}; expected one row per GPU column")
    if n == 0:
        raise TopologyError(f"{source}: no GPU columns")

    nv: dict[tuple[int, int], int] = {}
    edges: list[tuple[int, int]] = []
    for a in range(n):
        for b in range(n):
            m = _NV.match(rows[f"GPU{a}"][b])
            if m and a != b:
                nv[(a, b)] = int(m.group(1))
                edges.append((a, b))
    islands = connected_components(n, edges)
    links = min(links_per_gpu(isl, nv) for isl in islands)
    nics = tuple(nic_legend.get(c, c) for c in columns[n:])
    return NodeLayout(
        gpus=n,
        islands=tuple(tuple(isl) for isl in islands),
        source=source,
        island_tier=island_tier_from_links(links) if links else None,
        nics=nics,
    )


def load_nvidia_smi(path: str) -> NodeLayout:
    where = f"nvidia-smi:{path}"
    return parse_nvidia_smi(read_source_text(path, where=where), source=where)
