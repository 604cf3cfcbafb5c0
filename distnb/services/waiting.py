"""Waiting for a cell from the notebook: the live view's ticks, a deadline, the prompts of ranks
paused in the debugger or in ``input()``, and Ctrl-C — the first interrupts the ranks, the second
stops waiting and leaves them running (a rank blocked in C++ or a collective may not answer)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable

from distnb.controller.cell_run import CellRun
from distnb.ranks import format_ranks
from distnb.results import CellResult
from distnb.services.debugger import Ask, Debugger

__all__ = ["wait_for_cell"]


def wait_for_cell(
    result: CellResult,
    run: CellRun,
    debugger: Debugger,
    interrupt: Callable[[Iterable[int]], object],
    timeout: float | None,
    on_tick: Callable[[CellResult], None] | None,
    tick: float,
    ask: Ask | None,
    say: Callable[[str], None] | None = None,
) -> None:
    """Return when the cell has finished, ``timeout`` has passed (``result.timed_out``) or a second
    interrupt came (``result.detached``)."""
    # From this call, not the cell's start: %dist_wait --timeout on an old background cell waits.
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted = False
    say = say or _stderr
    while not run.finished.is_set():
        try:
            if ask is not None and not interrupted and debugger.pending(result):
                debugger.console(result, ask, before_prompt=None if on_tick is None else lambda: on_tick(result))
            wait_for = tick if deadline is None else max(0.0, min(tick, deadline - time.monotonic()))
            if run.finished.wait(wait_for):
                return
            if on_tick is not None:
                on_tick(result)
            if deadline is not None and time.monotonic() >= deadline:
                result.timed_out = True
                return
        except KeyboardInterrupt:
            if interrupted:
                result.detached = True
                result.notes.append(
                    f"Stopped waiting after a second interrupt; {format_ranks(result.running)} did not respond "
                    "(likely blocked in C++ or a collective). They keep running: see them with %dist_stacks, interrupt them again with "
                    "%dist_interrupt, or %dist_restart."
                )
                return
            interrupted = True
            interrupt(result.running)
            say(f"[distnb] interrupting cell {result.cell} on {format_ranks(result.running)}: they stop at their next Python line "
                "(a rank blocked in a collective stops when it returns); a second interrupt stops waiting and leaves them running.")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
