"""What the live watch prints while a cell runs in a terminal (no widgets): a hang's verdict block
once a cell, however its headline moves (an interrupt, records settling) — the report that ends the
cell carries the last; a pause at each change. A failure in distnb's own diagnosis is distnb's bug,
not the cell's news: nothing of it reaches the cell's output (it read "[distnb] could not
diagnose: int() argument must be …" in a saved notebook); %dist_status counts it and shows its last
line, and the pool keeps the traceback."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace
from typing import Any

from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState
from distnb.controller.internal_errors import InternalErrors
from distnb.display.text import LivePrinter
from distnb.magics.live_watch import HangWatch
from distnb.results import CellResult, RankResult
from distnb.services.waiting import why_still_running
from distnb.status import PoolStatus


def _running() -> CellResult:
    return CellResult(cell=3, code="x", ranks=[0, 1], results={r: RankResult(r, status="running") for r in (0, 1)})


class _Looks:
    def __init__(self, verdicts: list[Verdict]) -> None:
        self.verdicts = verdicts

    def look(self) -> Verdict:
        return self.verdicts.pop(0)


def _pool(watch: Any, errors: InternalErrors | None = None) -> Any:
    return SimpleNamespace(watch=lambda result, hang_after: watch, internal_errors=errors or InternalErrors(),
                           debugger=SimpleNamespace(pending=lambda result: []), panel=SimpleNamespace(verdict=lambda: ""))


def _ticks(pool: Any, n: int) -> tuple[str, HangWatch]:
    out, err = io.StringIO(), io.StringIO()
    printer = LivePrinter(out=out, err=err)
    watch = HangWatch(pool, _running(), 0.0, printer)
    with contextlib.redirect_stderr(err):  # the watch prints its verdicts to the cell's stderr
        for _ in range(n):
            watch._next = 0.0  # every tick looks (the watch paces itself by the clock otherwise)
            watch.tick(_running())
        printer.flush()
    return out.getvalue() + err.getvalue(), watch


def test_a_hang_is_printed_once_a_cell_and_a_pause_at_each_change() -> None:
    def hang(said: str) -> Verdict:
        return Verdict(VerdictState.HANG, Kind.STILL_RUNNING, said, [1], positions=[Position(0, "collective", op="all_reduce", since=5.0)])

    pause = Verdict(VerdictState.PAUSED, Kind.PAUSED, "rank 1 is paused in the debugger.", positions=[Position(1, "paused")])
    looks = [hang("rank 0 waits in all_reduce while rank 1 runs."), hang("rank 0 waits in all_reduce while rank 1 runs."),
             hang("rank-conditional collective: rank 0 entered all_reduce."), pause, hang("rank 1 finished without it.")]
    text, watch = _ticks(_pool(_Looks(looks)), len(looks))
    assert text.count("[distnb] ") == 2 and watch.said, text
    assert "rank 0 waits in all_reduce while rank 1 runs." in text and "rank 1 is paused in the debugger." in text, text
    assert "rank-conditional" not in text and "finished without" not in text, text


class _BrokenWatch:
    def look(self) -> Any:
        return int(None)  # type: ignore[call-overload]  # the trial's own failure


def test_a_live_diagnosis_that_fails_prints_nothing_and_is_kept() -> None:
    errors = InternalErrors()
    text, watch = _ticks(_pool(_BrokenWatch(), errors), 3)
    assert text == "" and not watch.said
    assert errors.count == 3 and "in the live diagnosis" in (errors.last or "") and "TypeError: int() argument" in (errors.last or "")


def test_a_failed_diagnosis_at_a_timeout_adds_no_note_and_is_kept() -> None:
    errors = InternalErrors()
    result = _running()
    result.timed_out = True

    def fails(_: CellResult) -> Any:
        raise KeyError("rank")

    why_still_running(result, fails, errors)
    assert result.notes == [] and result.verdict is None
    assert errors.count == 1 and "still running at a timeout" in (errors.last or "")


def test_the_status_says_how_many_and_the_last_ones_first_and_last_lines() -> None:
    errors = InternalErrors()
    try:
        int(None)  # type: ignore[call-overload]
    except TypeError:
        errors.caught("the live diagnosis")
    status = PoolStatus(state="running", backend="gloo", world_size=2, ranks=[], diagnosis_errors=errors.count,
                        last_diagnosis_error=errors.last)
    line = next(line for line in status.text().splitlines() if "diagnosis" in line)
    assert line.startswith("1 internal error(s) in distnb's diagnosis (the cells went on without it; please report them"), line
    assert " in the live diagnosis — TypeError: int() argument must be" in line, line
