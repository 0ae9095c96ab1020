"""DeepSpeed / MPI hostfile: ``host slots=N`` per line, ``#`` comments, blank lines.

    worker-1 slots=8
    worker-2 slots=8   # trailing comments are fine

``max_slots=M`` (Open MPI) is accepted and ignored. A line without ``slots=`` gets
``default_slots`` (1 as in Open MPI, unless given). Ranks follow the file's host order.
"""

from __future__ import annotations

import re

from .layout import HostSpec, read_source_text
from .model import TopologyError

__all__ = ["parse_hostfile", "load_hostfile", "format_hostfile"]

_HOST = re.compile(r"^[A-Za-z0-9._\-]+$")
_OPT = re.compile(r"^(slots|max_slots|max-slots)=(\d{1,6})$")


def parse_hostfile(text: str, *, source: str = "hostfile", default_slots: int | None = 1) -> list[HostSpec]:
    if not isinstance(text, str):
        raise TopologyError(f"{source}: expected text, got {type(text).__name__}")
    out: list[HostSpec] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *opts = line.split()
        if not _HOST.match(host) or len(host) > 255:
            raise TopologyError(f"{source}: line {i}: {host!r} is not a host name; expected 'HOST slots=N'")
        if host in seen:
            raise TopologyError(f"{source}: line {i}: host {host!r} already listed on line {seen[host]}")
        seen[host] = i
        slots = default_slots
        for opt in opts:
            m = _OPT.match(opt)
            if not m:
                raise TopologyError(f"{source}: line {i}: {opt!r}; accepted: slots=N (and max_slots=N)")
            if m.group(1) == "slots":
                slots = int(m.group(2))
                if slots < 1:
                    raise TopologyError(f"{source}: line {i}: slots=0; expected slots >= 1")
        out.append(HostSpec(host, slots))
    if not out:
        raise TopologyError(f"{source}: no hosts; expected lines 'HOST slots=N'")
    return out


def load_hostfile(path: str, *, default_slots: int | None = 1) -> list[HostSpec]:
    where = f"hostfile:{path}"
    return parse_hostfile(read_source_text(path, where=where), source=where, default_slots=default_slots)


def format_hostfile(hosts: list[tuple[str, int]]) -> str:
    """A DeepSpeed hostfile, one ``host slots=N`` line per host in the given order."""
    return "".join(f"{h} slots={n}\n" for h, n in hosts)
