"""Small text helpers shared by the controller and the workers (standard library only).

Sizes are binary everywhere and say so: a MiB is 2**20 bytes, so a limit reads the same wherever
it is quoted (a push, a pull, a frame, a memory table).
"""

from __future__ import annotations

__all__ = ["MiB", "mib", "size"]

MiB = 1 << 20
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def mib(n_bytes: float) -> str:
    """A size in MiB with one decimal, as limits are stated: ``"256.0 MiB"``."""
    return f"{n_bytes / MiB:,.1f} MiB"


def size(n_bytes: float | None) -> str:
    """A size in the largest binary unit it fills: ``"1.50 GiB"``, ``"300 MiB"``, ``"12 KiB"``, ``"-"`` for None."""
    if n_bytes is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}" if unit == "GiB" else f"{n_bytes / scale:.0f} {unit}"
    return f"{n_bytes:.0f} B"
