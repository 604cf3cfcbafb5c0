"""A block of lines a rank prints after other ranks printed it, said in one line.

Ranks print the same block at different moments: a library's log (torch's twenty-line fake-tensor
or compile log on every rank), a config dump, a warning with its stack. The live view groups lines
that arrive together; a block whose copies arrive seconds apart was printed once per rank. Here a
run of at least :data:`MIN_RUN` lines that other ranks have all printed before in this cell becomes
``(20 lines: the same as ranks 0,2 printed above)``; the cell's result keeps every rank's text."""

from __future__ import annotations

from distnb.ranks import format_ranks

__all__ = ["MIN_RUN", "Repeats"]

#: The shortest run folded: one or two equal lines (a loss printed by every rank) read better as they are.
MIN_RUN = 3
#: How many distinct lines a cell remembers (the printed view holds at most 20,000 lines).
KEEP = 20_000


class Repeats:
    """The lines each rank has printed in this cell, per stream; only the flushing thread uses it."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], set[int]] = {}

    def fold(self, stream: str, rank: int, lines: list[str]) -> list[str]:
        """``lines``, with each run that other ranks printed before as one line."""
        out: list[str] = []
        i = 0
        while i < len(lines):
            end, by = self._run(stream, rank, lines, i)
            if sum(1 for line in lines[i:end] if line.strip()) >= MIN_RUN:
                out.append(f"({end - i} lines: the same as {format_ranks(sorted(by))} printed above)")
                i = end
            else:
                out.append(lines[i])
                i += 1
        return out

    def _run(self, stream: str, rank: int, lines: list[str], start: int) -> tuple[int, set[int]]:
        """The longest run from ``start`` whose every line the same other ranks printed before."""
        by: set[int] | None = None
        end = start
        while end < len(lines):
            others = self._seen.get((stream, lines[end]), set()) - {rank}
            common = others if by is None else by & others
            if not common:
                break
            by, end = common, end + 1
        return end, by or set()

    def printed(self, stream: str, rank: int, lines: list[str]) -> None:
        """``rank`` printed ``lines`` (as it wrote them, before any fold)."""
        for line in lines:
            ranks = self._seen.get((stream, line))
            if ranks is not None:
                ranks.add(rank)
            elif len(self._seen) < KEEP:
                self._seen[(stream, line)] = {rank}
