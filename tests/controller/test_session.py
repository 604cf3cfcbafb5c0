"""The session log stays bounded over a long session: by cells (full results shrink to records)
and by bytes (a chatty session's old output is let go), whatever order cells finish in."""

from __future__ import annotations

import pytest

from distnb.controller import session
from distnb.controller.session import CellRecord, SessionLog
from distnb.results import CellResult, RankResult


def _cell(log: SessionLog, out: str = "", ranks: tuple[int, ...] = (0, 1), finish: bool = True) -> CellResult:
    cell = log.next_cell()
    result = CellResult(cell=cell, code=f"x = {cell}", ranks=list(ranks), results={r: RankResult(r) for r in ranks})
    log.add_cell(result)
    if finish:
        _finish(result, out)
    return result


def _finish(result: CellResult, out: str = "") -> None:
    for res in result.results.values():
        res.status, res.stdout = "ok", out
        res.memory = {"rss": 1 << 20}


def test_old_results_shrink_to_records_past_the_cell_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "KEEP_RESULTS", 5)
    log = SessionLog()
    cells = [_cell(log) for _ in range(12)]
    history = log.history
    full = [c for c in history if isinstance(c, CellResult)]
    assert len(history) == 12
    assert len(full) <= 5 + 1 and full[-1] is cells[-1]  # the newest ones, the one just added among them
    assert all(isinstance(c, CellRecord) and c.ok and c.code == f"x = {c.cell}" for c in history[: 12 - len(full)])


def test_a_cell_still_running_when_it_ages_out_shrinks_once_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "KEEP_RESULTS", 3)
    log = SessionLog()
    background = _cell(log, finish=False)
    for _ in range(6):
        _cell(log)
    assert log.history[0] is background  # still running: its live result is kept whole
    _finish(background, "done")
    _cell(log)
    assert isinstance(log.history[0], CellRecord) and log.history[0].ok


def test_output_past_the_byte_budget_is_let_go_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "KEEP_OUTPUT_BYTES", 10_000)
    log = SessionLog()
    chatty = [_cell(log, "x" * 3_000) for _ in range(6)]  # 6,000 characters a cell over 2 ranks
    _cell(log)  # the last chatty cell is settled when the next one starts
    kept = [c for c in chatty if c.results[0].stdout]
    assert kept == chatty[-1:], [c.results[0].stdout[:3] for c in chatty]
    old = chatty[0]
    assert isinstance(log.history[0], CellResult)  # still a full result: its memory and value stay
    assert old.results[0].memory == {"rss": 1 << 20} and old.results[0].released == 3_000
    assert "let go" in old.text() and "3,000" in old.text()
    assert log.kept_output_bytes() <= 10_000


def test_the_byte_budget_counts_displays_and_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "KEEP_OUTPUT_BYTES", 1_000)
    log = SessionLog()
    first = _cell(log)
    for res in first.results.values():
        res.stderr = "e" * 400
        res.displays = [{"text/plain": "p", "image/png": "i" * 400}]
    _cell(log)
    _cell(log)
    assert all(not r.stderr and not r.displays for r in first.results.values())
    assert first.results[0].released == 801
