"""The live hang watch of one running cell: a look once a second that costs the notebook little
whatever the world size, and the full diagnosis only when there is something to diagnose.

A full diagnosis asks every rank for its stack (a round trip to each control thread) and compares
them all: ~0.1-0.3 s of the notebook's CPU at 1,024 ranks, too much to pay every second while a
healthy cell trains. The ranks already push each collective they enter within ~50 ms, and the
tracker polls running ranks' logs about once a second as a backstop, so the log alone says whether
anything is suspect: a collective open longer than ``hang_after`` on a running rank, a rank that
failed or died while others run, or a log that stopped moving (ranks computing, or stuck where
the recorder has no entry yet: NCCL connecting a communicator, a send/recv, ``new_group``). Only
then is the full diagnosis run; while a cell computes with no collective, it is repeated at a
slowing pace (1, 2, 4, 8 s). The straggler check reads the log alone, over a window of recent
collectives sized so a look stays cheap at any world size.
"""

from __future__ import annotations

import time

from distnb.analysis.verdicts.stragglers import straggler_window
from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState
from distnb.controller.tracker import Tracker
from distnb.results import CellResult
from distnb.services.inspector import Inspector
from distnb.states import CellStatus

__all__ = ["CellWatch", "QUIET_MAX", "STRAGGLER_EVERY"]

#: Seconds between two straggler checks of a running cell (it needs new collectives to change).
STRAGGLER_EVERY = 3.0
#: The slowest pace of full diagnoses while a cell computes with no collective open (seconds).
QUIET_MAX = 8.0


class CellWatch:
    """Looks at one running cell; :meth:`look` returns a diagnosis when there is one to show."""

    def __init__(self, tracker: Tracker, inspector: Inspector, result: CellResult, hang_after: float) -> None:
        self._tracker = tracker
        self._inspector = inspector
        self._result = result
        self._hang_after = hang_after
        self._changes = -1
        self._moved = time.monotonic()
        self._quiet = 1.0
        self._next_full = 0.0
        self._next_straggler = 0.0
        self._straggler_changes = -1
        self.full_looks = 0  # how many looks needed the full diagnosis (for tests and benchmarks)
        # Once a hang, a failure or a desync has been said, a straggler never takes its place.
        self._alarmed = False
        #: What the ranks were doing at the last look that found nothing wrong (a long import, a
        #: compile, a set-up that builds an extension): the live view says it on a long cell.
        self.activity: Verdict | None = None

    def look(self) -> Verdict | None:
        """The diagnosis to show now, or None when the log shows the ranks making progress."""
        result = self._result
        running = result.running
        if not running:
            return None
        now = time.monotonic()
        log = self._tracker.collective_log
        if log.changes != self._changes:
            self._changes, self._moved = log.changes, now
        if now - self._tracker.run_of(result).started < self._hang_after:
            return None  # nothing can be called a hang yet
        if self._suspect(running) or (now - self._moved >= self._hang_after and now >= self._next_full):
            self.full_looks += 1
            diag = self._inspector.diagnose(result, self._hang_after)
            calm = diag.state in (VerdictState.OK, VerdictState.RUNNING)
            self._quiet = min(self._quiet * 2, QUIET_MAX) if calm else 1.0
            self._next_full = now + self._quiet
            if not calm:
                self._alarmed = self._alarmed or diag.kind != Kind.STRAGGLER
                return diag
            self.activity = diag if diag.positions else None
        if self._alarmed or any(res.status != CellStatus.RUNNING and res.status != CellStatus.OK for res in result.results.values()):
            return None
        if now >= self._next_straggler and log.changes != self._straggler_changes:
            self._next_straggler, self._straggler_changes = now + STRAGGLER_EVERY, log.changes
            return self._inspector.straggler(result, straggler_window(len(result.ranks)))
        return None

    def _suspect(self, running: list[int]) -> bool:
        """A rank of the cell ended badly while others run, or one has waited in a collective (or
        a watched call: send/recv, new_group) for ``hang_after`` by its own clock."""
        result = self._result
        if any(res.status in (CellStatus.ERROR, CellStatus.DEAD, CellStatus.INTERRUPTED) for res in result.results.values()):
            return True
        log = self._tracker.collective_log
        for r in running:
            entry = log.stuck(r)
            if entry is not None and log.age(r, entry) >= self._hang_after:
                return True
            calls = log.open_calls(r)
            if calls and log.age(r, {"t": calls[0]["t"] / 1e9}) >= self._hang_after:
                return True
        return False
