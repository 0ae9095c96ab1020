"""NCCL topology XML (``NCCL_TOPO_DUMP_FILE`` output, ``NCCL_TOPO_FILE`` input) -> `NodeLayout`.

Schema (NCCL 2.30 ``src/graph/xml.h``, ``xml.cc``): ``<system>`` > ``<cpu>`` > nested ``<pci busid class ...>`` >
``<gpu dev ...>`` with ``<nvlink target count tclass>`` children, and ``<nic>`` > ``<net name speed>``.
NVLink islands are the connected components of GPUs joined directly (target is another GPU's bus id)
or through an NVSwitch (``tclass="0x068000"``).

Parsed safely: any ``<!DOCTYPE`` or ``<!ENTITY`` is refused before parsing, so no entity expansion
("billion laughs") or external entity can happen; the standard library parser is then only given
plain elements.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter

from .layout import NodeLayout, island_tier_from_links, net_tier_from_rate, read_source_text
from .model import TopologyError
from .nvidia_smi import connected_components

__all__ = ["parse_nccl_xml", "load_nccl_xml", "NVSWITCH_CLASS"]

NVSWITCH_CLASS = "0x068000"
_FORBIDDEN = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
MAX_ELEMENTS = 200_000


def _int_attr(el: ET.Element, attr: str, source: str, lo: int, hi: int) -> int:
    raw = el.get(attr)
    try:
        v = int(raw, 0) if raw is not None else None
    except ValueError:
        v = None
    if v is None or not (lo <= v <= hi):
        raise TopologyError(
            f"{source}: <{el.tag}> attribute {attr}={raw!r}; expected an integer in [{lo}, {hi}]"
        )
    return v


def parse_nccl_xml(text: str, *, source: str = "nccl-xml") -> NodeLayout:
    """Parse an NCCL system topology XML document; raises `TopologyError` on anything unusable."""
    if not isinstance(text, str):
        raise TopologyError(f"{source}: expected text, got {type(text).__name__}")
    m = _FORBIDDEN.search(text)
    if m:
        line = text.count("\n", 0, m.start()) + 1
        raise TopologyError(
            f"{source}: line {line}: <!{m.group(1).upper()} is refused (no DTDs or entities); "
            "expected a plain NCCL topology XML as written by NCCL_TOPO_DUMP_FILE"
        )
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        line, col = getattr(exc, "position", (0, 0))
        raise TopologyError(
            f"{source}: line {line}, column {col}: not well-formed XML; expected an NCCL topology XML"
        ) from None
    if root.tag != "system":
        raise TopologyError(f"{source}: root element <{root.tag}>; expected <system>")

    parent: dict[ET.Element, ET.Element] = {}
    count = 0
    for el in root.iter():
        count += 1
        if count > MAX_ELEMENTS:
            raise TopologyError(f"{source}: more than {MAX_ELEMENTS} elements; expected one node's topology")
        for child in el:
            parent[child] = el

    gpus: list[tuple[int, str, ET.Element]] = []
    for g in root.iter("gpu"):
        dev = _int_attr(g, "dev", source, 0, 4095)
        p = parent.get(g)
        busid = p.get("busid") if p is not None and p.tag == "pci" else None
        if not busid:
            raise TopologyError(
                f'{source}: <gpu dev="{dev}"> is not inside a <pci busid=...>; expected NCCL\'s nesting'
            )
        gpus.append((dev, busid.lower(), g))
    if not gpus:
        raise TopologyError(f"{source}: no <gpu> elements; expected an NCCL topology XML of a GPU node")
    gpus.sort(key=lambda t: t[0])
    devs = [d for d, _, _ in gpus]
    if len(set(devs)) != len(devs):
        raise TopologyError(f"{source}: <gpu dev> values repeat ({devs}); expected one <gpu> per device")
    index_of_bus = {bus: i for i, (_, bus, _) in enumerate(gpus)}
    if len(index_of_bus) != len(gpus):
        raise TopologyError(f"{source}: two <gpu> elements share a PCI bus id")

    n = len(gpus)
    switch_ids: dict[str, int] = {}
    edges: list[tuple[int, int]] = []
    links = [0] * n
    for i, (dev, _, g) in enumerate(gpus):
        for link in g.iter("nvlink"):
            target = (link.get("target") or "").lower()
            cnt = _int_attr(link, "count", source, 1, 1024)
            tclass = (link.get("tclass") or "").lower()
            if target in index_of_bus:
                edges.append((i, index_of_bus[target]))
                links[i] += cnt
            elif tclass == NVSWITCH_CLASS:
                sid = switch_ids.setdefault(target, n + len(switch_ids))
                edges.append((i, sid))
                links[i] += cnt
            # Other targets (e.g. NVLink to a POWER9 CPU) do not join GPUs into an island.
    comps = connected_components(n + len(switch_ids), edges)
    islands = tuple(tuple(x for x in c if x < n) for c in comps)
    islands = tuple(sorted((c for c in islands if c), key=lambda c: c[0]))
    in_island = [link for isl in islands if len(isl) > 1 for link in (links[i] for i in isl)]

    speeds: list[int] = []
    nics: list[str] = []
    for net in root.iter("net"):
        speeds.append(_int_attr(net, "speed", source, 1, 10**9))
        nics.append(net.get("name") or f"net{len(nics)}")
    net_gbps = None
    if speeds:
        # The most common speed is the compute rail (storage ports may differ); one rail per GPU.
        rate_mbit, nrails = Counter(speeds).most_common(1)[0]
        net_gbps = net_tier_from_rate(rate_mbit / 1000.0, min(nrails, n), n)
    return NodeLayout(
        gpus=n,
        islands=islands,
        source=source,
        island_tier=island_tier_from_links(min(in_island)) if in_island else None,
        net_tier_gbps=net_gbps,
        nics=tuple(nics),
    )


def load_nccl_xml(path: str) -> NodeLayout:
    where = f"nccl-xml:{path}"
    return parse_nccl_xml(read_source_text(path, where=where), source=where)
