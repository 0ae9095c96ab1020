"""Slurm's compressed host-list syntax: ``dgx[001-020,045],login1`` <-> a list of names."""

from __future__ import annotations

import re

from .model import TopologyError

__all__ = ["expand_hostlist", "compress_hostlist", "MAX_HOSTS"]

# A hostlist that expands to more names than any cluster has is a typo or an attack.
MAX_HOSTS = 1_000_000

_NAME_CHARS = re.compile(r"^[A-Za-z0-9._\-]+$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise TopologyError(f"hostlist {text!r}: nested '[' is not Slurm syntax")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise TopologyError(f"hostlist {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise TopologyError(f"hostlist {text!r}: '[' without ']'")
    parts.append("".join(cur))
    return parts


def _expand_ranges(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise TopologyError(f"hostlist {whole!r}: empty range inside brackets")
        if "-" in item:
            lo, _, hi = item.partition("-")
            if not (lo.isdigit() and hi.isdigit()):
                raise TopologyError(f"hostlist {whole!r}: range {item!r} must be N-M with decimal numbers")
            if len(lo) > 9 or len(hi) > 9:
                raise TopologyError(f"hostlist {whole!r}: range {item!r} has numbers longer than 9 digits")
            a, b = int(lo), int(hi)
            if b < a:
                raise TopologyError(f"hostlist {whole!r}: range {item!r} runs backwards")
            if b - a + 1 > MAX_HOSTS:
                raise TopologyError(f"hostlist {whole!r}: range {item!r} has more than {MAX_HOSTS} hosts")
            width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
            out.extend(str(i).zfill(width) for i in range(a, b + 1))
        else:
            if not item.isdigit():
                raise TopologyError(f"hostlist {whole!r}: {item!r} inside brackets must be a number")
            out.append(item)
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand ``dgx[001-003,045],x[1-2]y[1-2]`` to explicit names, in order, duplicates refused."""
    if not isinstance(text, str):
        raise TopologyError(f"hostlist: expected text, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise TopologyError("hostlist: empty")
    names: list[str] = []
    for part in _split_top(text):
        part = part.strip()
        if not part:
            raise TopologyError(f"hostlist {text!r}: empty name between commas")
        # Tokenise into literal and bracket pieces; the cartesian product gives the names.
        pieces: list[list[str]] = []
        for lit, br in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            if lit:
                pieces.append([lit])
            if br:
                pieces.append(_expand_ranges(br, text))
        combos = [""]
        for options in pieces:
            if len(combos) * len(options) > MAX_HOSTS:
                raise TopologyError(f"hostlist {text!r}: expands to more than {MAX_HOSTS} hosts")
            combos = [c + o for c in combos for o in options]
        for name in combos:
            if not _NAME_CHARS.match(name):
                raise TopologyError(f"hostlist {text!r}: {name!r} is not a valid host name")
        names.extend(combos)
        if len(names) > MAX_HOSTS:
            raise TopologyError(f"hostlist {text!r}: expands to more than {MAX_HOSTS} hosts")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise TopologyError(f"hostlist {text!r}: host {n!r} appears twice")
        seen.add(n)
    return names


def compress_hostlist(names: list[str]) -> str:
    """Inverse of :func:`expand_hostlist` for names with one trailing number (best effort, exact)."""
    out: list[str] = []
    i = 0
    while i < len(names):
        m = re.match(r"^(.*?)(\d+)$", names[i])
        if not m:
            out.append(names[i])
            i += 1
            continue
        prefix, num = m.group(1), m.group(2)
        width = len(num)
        j = i + 1
        while j < len(names):
            m2 = re.match(r"^(.*?)(\d+)$", names[j])
            if not (m2 and m2.group(1) == prefix and len(m2.group(2)) == width
                    and int(m2.group(2)) == int(num) + (j - i)):
                break
            j += 1
        if j - i == 1:
            out.append(names[i])
        else:
            last = str(int(num) + (j - i - 1)).zfill(width)
            out.append(f"{prefix}[{num}-{last}]")
        i = j
    return ",".join(out)
