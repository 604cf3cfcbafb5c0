"""Small text helpers shared by the controller and the workers (standard library only).

Sizes are binary everywhere and say so: a MiB is 2**20 bytes, so a limit reads the same wherever
it is quoted (a push, a pull, a frame, a memory table).
"""

from __future__ import annotations

from distnb.ranks import group_by

__all__ = ["MiB", "merge_lines", "mib", "prefix_lines", "size"]

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


def merge_lines(outputs: list[tuple[int, str]]) -> list[tuple[list[int], str]]:
    """Per-rank texts → ``(ranks, line)`` rows, each line shown once for the ranks that share it.

    Ranks with the same number of lines are aligned line by line (the common case of a cell
    whose prints differ only in a rank number); otherwise whole outputs are grouped.
    """
    split = [(r, _lines(t)) for r, t in outputs]
    if len({len(ls) for _, ls in split}) == 1:
        rows: list[tuple[list[int], str]] = []
        for i in range(len(split[0][1]) if split else 0):
            rows.extend(group_by((r, ls[i]) for r, ls in split))
        return rows
    return [(ranks, line) for ranks, ls in group_by((r, tuple(ls)) for r, ls in split) for line in ls]


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def prefix_lines(label: str, text: str) -> str:
    """``[ranks 0-3] line`` for every line of text (a trailing newline adds no empty line)."""
    return "\n".join(f"[{label}] {line}" for line in _lines(text))
