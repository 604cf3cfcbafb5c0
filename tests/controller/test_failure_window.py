"""The cells %dist_minimize starts from (SessionLog.failure_window): the launch in which the
session's last failure ran, whatever restarts came after it (issue 49: after `%dist_restart
--replay` the minimizer said "no cell of this session has failed")."""

from __future__ import annotations

from distnb.controller.session import SessionLog
from distnb.results import CellResult, RankResult


def _cell(log: SessionLog, code: str, ok: bool = True) -> None:
    res = CellResult(cell=len(log) + 1, code=code, ranks=[0, 1], results={r: RankResult(r) for r in (0, 1)})
    for r in res.results.values():
        r.status = "ok" if ok else "error"
    log.add_cell(res)


def _codes(log: SessionLog) -> list[str]:
    return [c.code for c in log.failure_window()]


def test_the_failure_is_found_in_the_launch_before_a_replay() -> None:
    log = SessionLog()
    _cell(log, "a = 1")
    _cell(log, "b = a", ok=False)
    assert _codes(log) == ["a = 1", "b = a"]
    log.mark_launch()  # %dist_restart --replay: fresh ranks, then the cells that succeeded again
    _cell(log, "a = 1")
    _cell(log, "c = 2")  # and a cell after it
    assert _codes(log) == ["a = 1", "b = a", "a = 1", "c = 2"]  # the minimizer keeps up to the failure
    # A restart without replay keeps the session's start: the same window.
    base = log.launch_index
    log.mark_launch()
    log.mark_launch(base)
    assert _codes(log)[:2] == ["a = 1", "b = a"]
    # A failure in the current launch is the one.
    _cell(log, "d = 1 / 0", ok=False)
    assert _codes(log) == ["a = 1", "c = 2", "d = 1 / 0"]


def test_without_a_failure_the_current_launch() -> None:
    log = SessionLog()
    _cell(log, "a = 1")
    log.mark_launch()
    _cell(log, "b = 2")
    assert _codes(log) == ["b = 2"]
