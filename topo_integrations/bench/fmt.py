"""How the bench's reports write quantities (report.py and longrun.py both use it; it imports neither)."""

from __future__ import annotations

__all__ = ["fmt_bytes"]


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in GB, MB or kB with two decimals (B below 1 kB); "–" when not measured (None)."""
    if n is None:
        return "–"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"
