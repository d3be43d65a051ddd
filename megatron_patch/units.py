"""Byte sizes as people read them, for every command that prints one (memory plan, mpatch inspect)."""

from __future__ import annotations

GiB = 2**30


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; ``None`` (not known) -> ``"?"``."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
