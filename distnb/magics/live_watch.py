"""While a ``%%on_ranks`` cell runs: its live output flushed, and the live hang watch's words —
once ranks wait past ``--hang-after``, why (``Pool.watch``, ``services/watch.py``); a long healthy
cell says what its ranks are doing. A background cell's view follows it to its end."""

from __future__ import annotations

import sys
import time

from distnb.analysis.verdicts.verdict import Verdict, VerdictState
from distnb.cell_names import cell_name
from distnb.display.cell_display import CellDisplay
from distnb.display.text import LivePrinter
from distnb.pool import Pool
from distnb.ranks import format_ranks, group_by
from distnb.results import CellResult

__all__ = ["HangWatch", "LONG_CELL", "activity_line", "follow"]


#: Seconds after which a cell that runs with nothing wrong says what its ranks are doing.
LONG_CELL = 5.0


class HangWatch:
    """While a cell runs: flush live output, and once ranks disagree for a while, say why."""

    def __init__(self, pool: Pool, result: CellResult, hang_after: float, view: CellDisplay | LivePrinter) -> None:
        self._pool = pool
        self._result = result
        self._view = view
        self._next = time.monotonic() + min(hang_after, 1.0)
        self._shown = ""
        self._printed_hang = False  # printed text: a hang's verdict block is printed once a cell
        self._watch = pool.watch(result, hang_after)
        self._doing: tuple[object, ...] = ()  # what a long cell's ranks were said to be doing
        self._started = time.monotonic()

    @property
    def said(self) -> bool:
        """Whether a diagnosis was shown while the cell ran."""
        return bool(self._shown)

    def tick(self, result: CellResult) -> None:
        view = self._view
        if isinstance(view, CellDisplay):
            view.tick(result)
        else:
            view.flush()
        now = time.monotonic()
        paused = bool(self._pool.debugger.pending(result))
        if paused and isinstance(view, CellDisplay):
            view.go_live()  # the user is about to be asked: show what the ranks printed so far
        if now < self._next or not result.running or paused:
            return  # (the debugger console says where paused ranks are)
        self._next = now + 1.0
        try:
            diag = self._watch.look()
        except Exception:  # distnb's bug, not the cell's news: %dist_status says it; the cell keeps streaming
            self._pool.internal_errors.caught("the live diagnosis")
            return
        if diag is None:
            self._say_activity(result, view)
            return  # the ranks' logs show progress: nothing else to say
        headline, diag_text, state = diag.summary, diag.text(), diag.state
        if state is VerdictState.PAUSED and (verdict := self._pool.panel.verdict()):
            headline, diag_text = headline + verdict, f"{diag_text}\n{verdict}"  # ranks the panel holds before collectives
        # The live view shows the latest verdict in place, again only when the headline changes (it
        # carries no durations). Printed text can't replace a block: a hang's verdict is printed
        # once a cell, the first; a later reading (after an interrupt, the records settled) is the
        # report's, which ends the cell — three blocks of one hang read as three hangs. A pause is
        # the debugger's news and is said at each change. "Slow" is healthy ranks waiting on a
        # peer: the live view shows it while it lasts, and nothing of it stays (nor is printed).
        if state is VerdictState.SLOW:
            if isinstance(view, CellDisplay):
                view.set_diagnosis(diag_text, keep=False)
            return
        if state in (VerdictState.HANG, VerdictState.PAUSED) and headline != self._shown:
            self._shown = headline
            if isinstance(view, CellDisplay):
                view.set_diagnosis(diag_text)
            elif state is VerdictState.PAUSED:
                print(diag_text, file=sys.stderr)
            elif not self._printed_hang:
                self._printed_hang = True
                print(diag_text, file=sys.stderr)


    def _say_activity(self, result: CellResult, view: CellDisplay | LivePrinter) -> None:
        """A cell running past LONG_CELL with nothing wrong: what each group of ranks does now
        (importing, compiling, building an extension, at which line). The live view updates it in
        place and keeps none of it. Printed text (a terminal, no widgets) can't update a line: it says
        only what explains a wait (ranks importing, compiling, building an extension), in one line
        (:func:`activity_line`: not a verdict's block), once each time that changes kind; ranks
        merely running Python code print nothing."""
        doing = self._watch.activity
        if doing is None or time.monotonic() - self._started < LONG_CELL:
            return
        if isinstance(view, CellDisplay):
            key: tuple[object, ...] = tuple((p.rank, p.state, p.detail, p.line, p.func) for p in doing.positions)
        else:
            key = tuple(sorted({p.detail.split(" ", 1)[0] for p in doing.positions if p.detail}))
            if not key:
                return
        if key == self._doing:
            return
        self._doing = key
        if isinstance(view, CellDisplay):
            view.set_diagnosis(doing.text(), keep=False)
        else:
            print(activity_line(doing, time.monotonic() - self._started), file=sys.stderr)


#: Kinds of work one activity line names before "N more".
MAX_KINDS = 3


def activity_line(doing: Verdict, elapsed: float) -> str:
    """``[distnb] 6 s in, no rank waits on another: ranks 0-3 importing sympy/core/expr.py at cell
    line 8`` — what a long healthy cell's ranks do, by kind of work, in one line."""
    groups = group_by((p.rank, p.detail.split(" ", 1)[0] if p.detail else "") for p in doing.positions)
    parts = []
    for ranks, _ in groups[:MAX_KINDS]:
        p = next(p for p in doing.positions if p.rank == ranks[0])
        where = "" if not p.line else f" at cell line {p.line}" if p.line_cell in (None, p.running) else \
            f" in {p.func}() ({cell_name(p.line_cell)} line {p.line})"
        parts.append(f"{format_ranks(ranks)} {p.detail or 'running Python code'}{where}")
    more = f"; {len(groups) - MAX_KINDS} more kinds of work" if len(groups) > MAX_KINDS else ""
    return f"[distnb] {elapsed:.0f} s in, no rank waits on another: {'; '.join(parts)}{more}"


def follow(pool: Pool, result: CellResult, view: CellDisplay) -> None:
    """Keep a background cell's widget view updating until the cell ends."""
    pool.wait(result, on_tick=view.tick, tick=0.25, ask=None)  # prompts wait for %dist_wait, on the kernel's thread
    view.finish(result)
