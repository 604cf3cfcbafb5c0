"""Live plain-text rendering of a running cell's output, for terminals, nbconvert and CI logs.

Output arrives on distnb's I/O thread; it is only buffered there. Printing happens on the thread
that waits for the cell (in Jupyter, the kernel's main thread), so it lands in the right cell.
Lines that several ranks print at about the same time are printed once with their rank set.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from distnb.ranks import format_ranks
from distnb.results import RankResult, group_by

__all__ = ["LivePrinter", "stage_summary"]


def stage_summary(stages: dict[int, object], elapsed: float) -> str:
    """``launching 4 ranks (3.2 s): ready 2 · connected 1 · started 1``."""
    counts: dict[str, list[int]] = {}
    for rank, stage in sorted(stages.items()):
        name = getattr(stage, "value", str(stage))
        counts.setdefault("ready" if name == "idle" else name, []).append(rank)
    order = ["ready", "connected", "started", "launched", "dead"]
    parts = [f"{name} {format_ranks(counts[name]).split(' ', 1)[1]}" for name in order if name in counts]
    return f"launching {len(stages)} ranks ({elapsed:.1f} s): " + " · ".join(parts)


class LivePrinter:
    """Buffers per-rank output from any thread; :meth:`flush` prints grouped lines."""

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        hold: float = 0.15,
        max_lines: int = 20_000,
        max_chars: int = 4 << 20,
    ) -> None:
        self._out = out
        self._err = err
        self._hold = hold
        self._lock = threading.Lock()
        self._partial: dict[tuple[int, str], str] = {}
        self._pending: dict[int, list[tuple[str, str]]] = {}
        self._oldest: float | None = None
        self._max_lines = max_lines
        self._max_chars = max_chars
        self.lines_printed = 0
        self.chars_printed = 0
        self.capped = 0  # lines not printed because of the cap
        self._notes: list[str] = []
        self.announced: set[str] = set()

    def feed(self, rank: int, stream: str, text: str) -> None:
        """Called on the I/O thread for each chunk of output."""
        with self._lock:
            buf = self._partial.get((rank, stream), "") + text
            *lines, rest = buf.split("\n")
            self._partial[(rank, stream)] = rest
            if lines:
                self._pending.setdefault(rank, []).extend((stream, line) for line in lines)
                if self._oldest is None:
                    self._oldest = time.monotonic()

    def rank_done(self, result: "RankResult") -> None:
        """Called on the I/O thread as each rank finishes; a death is announced at once."""
        if result.status == "dead":
            with self._lock:
                self._notes.append(result.death_text())

    def flush(self, final: bool = False) -> None:
        """Print what is ready; ``final`` prints everything, partial lines included."""
        with self._lock:
            notes, self._notes = self._notes, []
        for note in notes:
            self.announced.add(note)
            print(f"[distnb] {note}", file=self._err or sys.stderr)
        with self._lock:
            if final:
                for (rank, stream), rest in sorted(self._partial.items()):
                    if rest:
                        self._pending.setdefault(rank, []).append((stream, rest))
                self._partial.clear()
            elif self._oldest is None or time.monotonic() - self._oldest < self._hold:
                return  # let other ranks catch up so identical lines group
            pending, self._pending, self._oldest = self._pending, {}, None
        for stream in ("stdout", "stderr"):
            per_rank = {r: [line for s, line in ls if s == stream] for r, ls in sorted(pending.items())}
            # Line i of every rank that has one, grouped: extra lines on one rank don't split the rest.
            for i in range(max((len(ls) for ls in per_rank.values()), default=0)):
                for ranks, line in group_by((r, ls[i]) for r, ls in per_rank.items() if i < len(ls)):
                    self._print(stream, f"[{format_ranks(ranks)}{' stderr' if stream == 'stderr' else ''}] {line}")

    def _print(self, stream: str, text: str) -> None:
        if self.lines_printed >= self._max_lines or self.chars_printed >= self._max_chars:
            self.capped += 1
            return
        self.lines_printed += 1
        self.chars_printed += len(text)
        target = (self._err or sys.stderr) if stream == "stderr" else (self._out or sys.stdout)
        print(text, file=target)

    def cap_note(self) -> str:
        if not self.capped:
            return ""
        return (
            f"[distnb] {self.capped:,} more output lines were not shown (the view keeps "
            f"{self._max_lines:,} lines); each rank's first 1 MB per stream is in the result's .stdout/.stderr."
        )
