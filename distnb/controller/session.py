"""The session log: every cell run and every value pushed, in order, for replay and export.

Memory stays flat over long sessions: only the last :data:`KEEP_RESULTS` cells keep their full
results (output, values, memory); older ones shrink to a :class:`CellRecord` (code, ranks,
success) once they have ended. Those full results hold at most :data:`KEEP_OUTPUT_BYTES` of
output in all — a cell may keep a MiB per rank and stream, so a chatty 8-rank session would
otherwise hold over a GiB — beyond which the oldest let their output go (the notebook still shows
it). Pickled pushes beyond :data:`KEEP_PUSH_BYTES` in all are let go oldest first.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from distnb.cell_names import cell_name, next_cell_number
from distnb.errors import RemoteError
from distnb.results import CellResult

__all__ = ["KEEP_OUTPUT_BYTES", "KEEP_PUSH_BYTES", "KEEP_RESULTS", "CellRecord", "PushRecord", "SessionLog", "Step"]


@dataclass(frozen=True, slots=True)
class CellRecord:
    """What replay and export need of an old cell, once its outputs are let go."""

    cell: int
    code: str
    ranks: tuple[int, ...]
    ok: bool
    label: int | None = None  # the notebook's In[n]
    imported: tuple[str, ...] = ()  # torch's modules the cell imported first (CellResult.imported)

    @classmethod
    def of(cls, result: CellResult) -> CellRecord:
        ranks = tuple(result.ranks)
        # Most cells run on the same rank set: share one tuple (and the code text of repeats).
        ranks = _SHARED.setdefault(ranks, ranks)
        return cls(result.cell, sys.intern(result.code) if len(result.code) < 256 else result.code, ranks, result.ok, result.label,
                   tuple(result.imported))


_SHARED: dict[tuple[int, ...], tuple[int, ...]] = {}


@dataclass(frozen=True)
class PushRecord:
    """Values pushed into the ranks (``%dist_push``): replay and export re-create them in order,
    since the cells after a push depend on them."""

    position: int  # pushed when the pool's history held this many cells
    ranks: tuple[int, ...]
    names: tuple[str, ...]
    blob: bytes | None  # the pickled ``{name: value}`` the ranks received; None once let go (too large to keep)


#: One thing a session did, in order: a cell (full result, or its record once let go) or a push.
Step = CellResult | CellRecord | PushRecord


#: Cells whose full results the log keeps; older ones keep only what replay and export need.
KEEP_RESULTS = 100
#: Output (stdout, stderr, displays, in characters) the full results may hold in all.
KEEP_OUTPUT_BYTES = 64 << 20
#: Pickled pushes kept for replay and export; beyond this the oldest are let go (and say so).
KEEP_PUSH_BYTES = 256 << 20



class SessionLog:
    """Cells and pushes of one pool, across its restarts (cell numbers keep counting)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._history: list[CellResult | CellRecord] = []
        self._pushes: list[PushRecord] = []
        self._launch_index = 0
        self._starts = [0]  # every launch's start in history, oldest first: a failure's is found after a replay
        # Bookkeeping of the full results in history (by index), so that each cell costs O(1):
        self._full: deque[int] = deque()  # the newest KEEP_RESULTS of them, oldest first
        self._held: list[int] = []  # older ones still running (a background cell): shrunk once ended
        self._unsized: list[int] = []  # not yet seen ended (their output may still grow)
        self._sizes: dict[int, int] = {}  # ended ones: output still held
        self._kept_bytes = 0

    @property
    def history(self) -> list[CellResult | CellRecord]:
        """Every cell run, oldest first (a copy: the log is only changed through its methods)."""
        return list(self._history)

    @property
    def pushes(self) -> list[PushRecord]:
        return list(self._pushes)

    @property
    def launch_index(self) -> int:
        """How many cells ran before the current launch."""
        return self._launch_index

    def __len__(self) -> int:
        return len(self._history)

    def last(self) -> CellResult | CellRecord | None:
        return self._history[-1] if self._history else None

    def mark_launch(self, at: int | None = None) -> None:
        """A launch succeeded: replay and export start from here (or from ``at``, where a restart
        that replayed nothing keeps the session's own start)."""
        with self._lock:
            if at is None:
                self._launch_index = len(self._history)
                self._starts.append(self._launch_index)
            else:
                self._launch_index = self._starts[-1] = at

    def failure_window(self) -> list[CellResult | CellRecord]:
        """The cells from the start of the launch in which the session's last failed cell ran, on:
        after ``%dist_restart --replay`` the cells since the launch are the replayed ones, which
        succeeded, and the failure that prompted the restart is in the launch before. The current
        launch's cells where no cell has failed."""
        with self._lock:
            last = next((i for i in range(len(self._history) - 1, -1, -1) if not self._history[i].ok), None)
            start = self._launch_index if last is None else max(s for s in self._starts if s <= last)
            return self._history[start:]

    def next_cell(self) -> int:
        return next_cell_number()  # unique in the process: cell_name() looks the In[n] up by it

    def add_cell(self, result: CellResult) -> None:
        with self._lock:
            self._history.append(result)
            index = len(self._history) - 1
            self._full.append(index)
            self._unsized.append(index)
            self._settle()

    def kept_output_bytes(self) -> int:
        """Output the ended full results hold, in characters (at most about :data:`KEEP_OUTPUT_BYTES`)."""
        return self._kept_bytes

    def _settle(self) -> None:
        """Size the cells that have ended since the last look, shrink ended ones older than the
        newest :data:`KEEP_RESULTS` to records, and let the oldest output go past the byte budget."""
        unsized, self._unsized = self._unsized, []
        for i in unsized:
            cell = self._history[i]
            if isinstance(cell, CellResult) and cell.running:
                self._unsized.append(i)
            elif isinstance(cell, CellResult):
                self._sizes[i] = size = cell.output_bytes()
                self._kept_bytes += size
        while len(self._full) > KEEP_RESULTS:
            self._held.append(self._full.popleft())
        if self._held:
            self._held = [i for i in self._held if not self._shrink(i)]
        for i in self._full:  # oldest first
            if self._kept_bytes <= KEEP_OUTPUT_BYTES:
                break
            if self._sizes.get(i):
                self._kept_bytes -= self._sizes[i]
                self._sizes[i] = 0
                cell = self._history[i]
                assert isinstance(cell, CellResult)
                cell.release_output()

    def _shrink(self, i: int) -> bool:
        """Cell ``i`` as a record, once it has ended (False while it runs)."""
        if i not in self._sizes:
            return False
        self._kept_bytes -= self._sizes.pop(i)
        cell = self._history[i]
        assert isinstance(cell, CellResult)
        self._history[i] = CellRecord.of(cell)
        return True

    def add_push(self, ranks: Iterable[int], names: tuple[str, ...], blob: bytes) -> None:
        with self._lock:
            self._pushes.append(PushRecord(len(self._history), tuple(ranks), names, blob))
            kept = 0
            for i in range(len(self._pushes) - 1, -1, -1):  # newest first: let the oldest go
                old = self._pushes[i]
                kept += len(old.blob or b"")
                if old.blob is not None and kept > KEEP_PUSH_BYTES:
                    self._pushes[i] = PushRecord(old.position, old.ranks, old.names, None)

    def since_launch(self) -> list[Step]:
        """Cells and pushes since the last launch, in the order they happened."""
        with self._lock:
            start, history = self._launch_index, list(self._history)
            pushes = [p for p in self._pushes if p.position >= start]
        steps: list[Step] = []
        for i in range(start, len(history) + 1):
            steps.extend(p for p in pushes if p.position == i)
            if i < len(history):
                steps.append(history[i])
        return steps

    def replay(self, steps: list[Step], run: Callable[[str, Sequence[int], int | None], CellResult],
               push: Callable[[bytes, list[int], tuple[str, ...]], None], on_replay: Callable[[CellResult], None] | None = None) -> None:
        """Do ``steps`` (:meth:`since_launch`) again on fresh ranks: each push, and each cell that
        had succeeded, stopping at the first cell that fails this time."""
        for old in steps:
            if isinstance(old, PushRecord):
                if old.blob is None:
                    raise RemoteError(
                        f"replay stopped: the values pushed before {self.cell_at(old.position)} "
                        f"({', '.join(old.names)}) were too large to keep; push them again and re-run from there."
                    )
                push(old.blob, list(old.ranks), old.names)
                self.add_push(old.ranks, old.names, old.blob)  # again: a later replay starts here
            elif old.ok:
                result = run(old.code, old.ranks, old.label)  # the notebook's In[n] stays the cell's name
                if on_replay is not None:
                    on_replay(result)
                if not result.ok:
                    break

    def cell_at(self, position: int) -> str:
        """The cell at a history position, named as everywhere (``"the next cell"`` past the end)."""
        return cell_name(self._history[position].cell) if position < len(self._history) else "the next cell"

    def recent_sources(self, n: int = 200) -> dict[str, str]:
        """``{"<cell-N>": code}`` of the last ``n`` cells: stack frames in cells show their lines."""
        return {f"<cell-{c.cell}>": c.code for c in self._history[-n:]}

    def codes(self, n: int = 200) -> dict[int, str]:
        """``{cell: code}`` of the last ``n`` cells (what a diagnosis quotes as evidence)."""
        return {c.cell: c.code for c in self._history[-n:]}

    def memory_timeline(self, ranks: list[int]) -> list[tuple[int, dict[int, dict[str, Any]]]]:
        """Per cell since launch, each rank's memory sample (start, end, peak)."""
        timeline = []
        for cell in self._history[self._launch_index :]:
            if isinstance(cell, CellResult):
                samples = {r: res.memory for r, res in cell.results.items() if res.memory and r in ranks}
                if samples:
                    timeline.append((cell.cell, samples))
        return timeline
