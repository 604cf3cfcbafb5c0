"""A cell in flight, as the tracker keeps it: which ranks still owe their CELL_DONE, how much of
each rank's output was kept, the prompts of ranks waiting for a line, and its end."""

from __future__ import annotations

import threading
import time

from distnb.controller.prompts import Prompt
from distnb.ranks import format_ranks
from distnb.results import CellEvents, CellResult, RankResult
from distnb.states import CellStatus
from distnb.wire.protocol import CellDone

__all__ = ["CellRun"]


class CellRun:
    """A cell in flight: which ranks still owe their CELL_DONE, and how much output was kept."""

    def __init__(self, result: CellResult, events: CellEvents) -> None:
        self.result = result
        self.events = events
        self.started = time.monotonic()
        self.waiting_done = set(result.ranks)
        self.kept = {(r, s): 0 for r in result.ranks for s in ("stdout", "stderr")}
        self.finished = threading.Event()
        self.death_checked = False  # the pool looked once for the root cause behind a death in it
        self.prompts: dict[int, Prompt] = {}  # each rank's latest request for a line (debugger, input())

    @classmethod
    def ended(cls, result: CellResult) -> CellRun:
        """A run for a result whose live run is no longer kept: nothing owed, already finished."""
        run = cls(result, CellEvents())
        run.waiting_done.clear()
        run.finished.set()
        return run

    def done(self, rank: int, msg: CellDone, direct: bool) -> RankResult:
        """The rank's CELL_DONE: its outcome into its result (``direct``: straight from the rank, a
        silent cell, not through its supervisor); the run no longer waits for it."""
        res = self.result.results[rank]
        res.status = CellStatus.reported(msg["status"])
        res.value, res.error, res.duration, res.memory = msg.get("value"), msg.get("error"), msg.get("duration"), msg.get("memory")
        res.profile, res.sync, res.paths, res.compiles, res.comms = (msg.get("profile"), msg.get("sync"), msg.get("paths"),
                                                                     msg.get("compiles"), msg.get("comms"))
        res.numerics, res.threads, res.imported = msg.get("numerics"), msg.get("threads") or [], msg.get("imported") or []
        res.finished_at, res.direct = time.monotonic(), direct
        self.waiting_done.discard(rank)
        return res

    def rank_finished(self, rank: int) -> bool:
        return rank not in self.waiting_done

    def add_output(self, rank: int, stream: str, text: str, keep: int) -> None:
        """Keep up to ``keep`` characters per rank and stream in the result (the rest is counted),
        and pass every chunk on to the caller's view."""
        res = self.result.results[rank]
        room = keep - self.kept[(rank, stream)]
        if room > 0:
            kept = text[:room]
            res.add_output(stream, kept)
            self.kept[(rank, stream)] += len(kept)
            res.output_truncated += len(text) - len(kept)
        else:
            res.output_truncated += len(text)
        if self.events.on_output:
            self.events.on_output(rank, stream, text)

    def strand(self, blocked: dict[int, str], dead: list[int], since_death: float) -> None:
        """End the cell for the notebook while ``blocked`` ranks (rank → what they wait in) stay
        blocked waiting for ``dead`` ones: the pool is broken, nothing else can free them."""
        now = time.monotonic()
        for r, why in blocked.items():
            res = self.result.results[r]
            res.status, res.collective, res.finished_at = CellStatus.STRANDED, why, now
            self.waiting_done.discard(r)
        self.result.notes.append(
            f"the cell ended {since_death:.1f} s after the first death: {format_ranks(blocked)} "
            f"{'stays' if len(blocked) == 1 else 'stay'} blocked waiting for {format_ranks(dead)}, and the pool is broken. "
            "%dist_restart (pool.restart()) starts over; add --replay to run the cells since launch again."
        )
        self.result.elapsed = now - self.started
        self.events = CellEvents()
        self.finished.set()
