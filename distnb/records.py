"""What the tracker keeps per rank, and per cell in flight."""

from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distnb.prompts import Prompt
from distnb.ranks import format_ranks
from distnb.results import CellResult, RankResult, RankState

__all__ = ["CellEvents", "CellRun", "RankRecord", "run_of"]


@dataclass
class CellEvents:
    """Callbacks for a running cell; all are called on distnb's I/O thread and must be quick."""

    on_output: Callable[[int, str, str], None] | None = None  # (rank, "stdout"/"stderr", text)
    on_display: Callable[[int, dict[str, str]], None] | None = None
    on_rank_done: Callable[[RankResult], None] | None = None


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
            res.status, res.collective, res.finished_at = "stranded", why, now
            self.waiting_done.discard(r)
        self.result.notes.append(
            f"the cell ended {since_death:.1f} s after the first death: {format_ranks(blocked)} "
            f"{'stays' if len(blocked) == 1 else 'stay'} blocked waiting for {format_ranks(dead)}, and the pool is broken. "
            "%dist_restart (pool.restart()) starts over; add --replay to run the cells since launch again."
        )
        self.result.elapsed = now - self.started
        self.events = CellEvents()
        self.finished.set()


def run_of(result: CellResult) -> CellRun:
    """The live run behind a result the pool returned (``submit`` attaches it)."""
    return result._run  # type: ignore[attr-defined]


@dataclass
class RankRecord:
    """What the controller knows of one rank. ``agent`` is the node agent that started it (0: this
    machine); ``group_rank`` is torchrun's node index."""

    rank: int
    state: RankState = RankState.LAUNCHED
    supervisor_pid: int | None = None
    pid: int | None = None
    host: str | None = None
    local_rank: int | None = None
    device: str | None = None
    backend: str | None = None
    returncode: int | None = None
    start_error: str | None = None
    stderr_tail: str = ""
    died_at: float | None = None  # monotonic
    main_ident: int | None = None
    agent: int = 0
    group_rank: int | None = None
    agent_beats: int = 0  # its agent's beat count when the rank said hello
    cause: str = ""  # why it died, when no exit code tells (a machine lost)
    run: CellRun | None = None
    log: list[str] = field(default_factory=list)  # output outside any cell (start-up, threads)
    decoders: dict[str, Any] = field(default_factory=dict)

    def decode(self, stream: str, data: bytes) -> str:
        dec = self.decoders.get(stream)
        if dec is None:
            dec = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        return str(dec.decode(data))
