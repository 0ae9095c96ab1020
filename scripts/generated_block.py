"""A generated block of a docs page: the text between two HTML-comment markers, rewritten by a
script (``--write``) and compared by a test or ``--check``, so figures on a page are never copied
by hand (scripts/design_layers.py, scripts/suite_times.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def current(doc: Path, begin: str, end: str) -> str | None:
    """The block of ``doc`` from ``begin`` to ``end`` (markers included), or None without markers."""
    text = doc.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        return None
    return text[text.index(begin): text.index(end) + len(end)]


def write_or_check(doc: Path, begin: str, end: str, new: str, *, check: bool, command: str) -> int:
    """Replace the block with ``new`` (or, with ``check``, only compare): 0 when the page holds
    ``new`` afterwards, 1 with a line naming ``command`` when it has no block or a stale one."""
    old = current(doc, begin, end)
    if old is None:
        print(f"{doc.name} has no generated block ({begin!r} ... {end!r})", file=sys.stderr)
        return 1
    if check:
        if old != new:
            print(f"{doc.name}: the generated block is stale; run {command}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(doc.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    return 0


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown page with every fenced code block blanked (its ``#`` lines are no headings)."""
    out, fence = [], None
    for line in text.splitlines():
        mark = line.lstrip()[:3]
        if mark in ("```", "~~~") and (fence is None or mark == fence):
            fence = None if fence else mark
            out.append("")
            continue
        out.append("" if fence else line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: inline code, emphasis and link targets dropped, lower case,
    every character but letters, digits, ``_``, ``-`` and spaces removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[`*]", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> list[tuple[int, str]]:
    """``(line index, anchor)`` of every heading of a Markdown page, in order; a repeated anchor gets
    ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = []
    for i, line in enumerate(prose_lines(text)):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append((i, base if n == 0 else f"{base}-{n}"))
    return out
