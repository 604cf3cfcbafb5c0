"""A failure in distnb's own diagnosis is distnb's bug, not the cell's news: nothing of it reaches
the cell's output (it read "[distnb] could not diagnose: int() argument must be …" in a saved
notebook); %dist_status counts it and shows its last line, and the pool keeps the traceback."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

from distnb.controller.internal_errors import InternalErrors
from distnb.display.text import LivePrinter
from distnb.magics.live_watch import HangWatch
from distnb.results import CellResult, RankResult
from distnb.services.waiting import why_still_running
from distnb.status import PoolStatus


def _running() -> CellResult:
    return CellResult(cell=3, code="x", ranks=[0, 1], results={r: RankResult(r, status="running") for r in (0, 1)})


class _BrokenWatch:
    def look(self) -> Any:
        return int(None)  # type: ignore[call-overload]  # the trial's own failure


def test_a_live_diagnosis_that_fails_prints_nothing_and_is_kept() -> None:
    errors = InternalErrors()
    pool = SimpleNamespace(watch=lambda result, hang_after: _BrokenWatch(), internal_errors=errors,
                           debugger=SimpleNamespace(pending=lambda result: []), panel=SimpleNamespace(verdict=lambda: ""))
    out, err = io.StringIO(), io.StringIO()
    printer = LivePrinter(out=out, err=err)
    watch = HangWatch(pool, _running(), 0.0, printer)  # type: ignore[arg-type]
    for _ in range(3):
        watch._next = 0.0  # every tick looks (the watch paces itself by the clock otherwise)
        watch.tick(_running())
    printer.flush()
    assert out.getvalue() == err.getvalue() == "" and not watch.said
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
