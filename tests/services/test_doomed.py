"""When a cell is doomed (services/fail_fast.py), on the controller's own log: only when the
records prove that a rank still running waits for a call a rank that left never reached."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from distnb.controller.collective_log import CollectiveLog
from distnb.results import CellResult, RankResult
from distnb.services.fail_fast import FINISHED, Doomed, doomed
from distnb.services.waiting import wait_for_cell
from distnb.wire.record_types import CallRecord, CollectiveEntry


def _entry(i: int, seq: int, done: bool, group: str = "0", cell: int = 5) -> CollectiveEntry:
    return {"id": i, "rec": "fr", "group": group, "desc": "default_pg", "seq": seq, "p2p": False, "op": "all_reduce",
            "sizes": [[4]], "dtypes": ["Float"], "t": 100.0 + i, "done": done, "state": "completed" if done else "started", "cell": cell}


def _log(per_rank: dict[int, list[CollectiveEntry]], calls: dict[int, list[CallRecord]] | None = None,
         members: list[int] | None = None) -> CollectiveLog:
    log = CollectiveLog()
    ranks = sorted(per_rank)
    for r in ranks:
        log.merge(r, {"entries": per_rank[r], "calls": (calls or {}).get(r, []), "now": 200.0, "gkey": 1,
                      "groups": {"0": members if members is not None else ranks}})
    return log


def _result(statuses: dict[int, str]) -> CellResult:
    res = CellResult(cell=5, code="", ranks=sorted(statuses), results={r: RankResult(r) for r in statuses})
    for r, status in statuses.items():
        res.results[r].status = status
        if status == "error":
            res.results[r].error = {"ename": "ValueError", "evalue": "bad batch", "traceback": "", "line": 3}
    return res


def test_waiting_for_a_collective_the_raised_rank_never_reached_is_doomed() -> None:
    done = [_entry(1, 1, True)]
    log = _log({0: done + [_entry(2, 2, False)], 1: list(done), 2: done + [_entry(2, 2, False)]})
    found = doomed(_result({0: "running", 1: "error", 2: "running"}), log)
    assert found is not None and found.left == {1: "raised ValueError"} and sorted(found.waiting) == [0, 2]
    assert "all_reduce" in found.waiting[0] and "#2" in found.waiting[0]
    assert found.text().startswith("[distnb] rank 1 raised ValueError and left cell 5; the others wait (ranks 0,2 in all_reduce")


def test_a_rank_that_issued_the_call_before_it_raised_dooms_nothing() -> None:
    # async_op=True: rank 1 entered #2, then raised; gloo may still complete it in the background.
    log = _log({0: [_entry(1, 1, True), _entry(2, 2, False)], 1: [_entry(1, 1, True), _entry(2, 2, False)]})
    assert doomed(_result({0: "running", 1: "error"}), log) is None


def test_a_rank_still_computing_or_a_group_without_the_raised_rank_is_not_doomed() -> None:
    busy = _log({0: [_entry(1, 1, True)], 1: [_entry(1, 1, True)]})
    assert doomed(_result({0: "running", 1: "error"}), busy) is None  # rank 0 is in no call at all
    # Rank 0 waits on a group of ranks 0 and 2 only: rank 1's raise does not stop it.
    apart = _log({0: [_entry(1, 1, False, group="3")], 1: [], 2: []}, members=[0, 1, 2])
    apart.groups["3"] = [0, 2]
    assert doomed(_result({0: "running", 1: "error", 2: "running"}), apart) is None
    # Every rank finished or none left: nothing to end.
    assert doomed(_result({0: "ok", 1: "error"}), busy) is None


def test_a_receive_from_the_rank_that_left_is_doomed() -> None:
    recv: CallRecord = {"n": 3, "op": "recv", "group": "0", "args": {"src": 1}, "t": 100_000_000_000, "end": None, "cell": 5,
                        "line": 4, "func": "<module>"}
    log = _log({0: [], 1: []}, calls={0: [recv]})
    found = doomed(_result({0: "running", 1: "dead"}), log)
    assert found is not None and found.waiting == {0: "recv from rank 1"} and found.left == {1: "died"}


def test_ranks_that_finished_the_cell_count_as_gone_only_where_asked_and_then_the_waiting_is_a_hang() -> None:
    """The minimizer's tries (Pool.wait(proven_hang_ends=True)): rank 0 in a barrier its peers,
    done with the cell, never reached is the hang a timeout would show, seconds sooner."""
    done = [_entry(1, 1, True)]
    log = _log({0: done + [_entry(2, 2, False)], 1: list(done), 2: list(done)})
    statuses = {0: "running", 1: "ok", 2: "ok"}
    assert doomed(_result(statuses), log) is None  # a notebook's cell waits to its --timeout
    found = doomed(_result(statuses), log, finished=True)
    assert found is not None and found.hang and found.left == {1: "finished", 2: "finished"} and list(found.waiting) == [0]
    assert found.text().startswith("[distnb] ranks 1,2 finished cell 5; the others wait (rank 0 in all_reduce") and "a hang" in found.text()
    # One that raised among them: not a hang, the cell is interrupted as before.
    mixed = doomed(_result({0: "running", 1: "ok", 2: "error"}), log, finished=True)
    assert mixed is not None and not mixed.hang
    # A peer that finished after entering the call (async_op=True) may still complete it.
    issued = _log({0: done + [_entry(2, 2, False)], 1: done + [_entry(2, 2, False)]})
    assert doomed(_result({0: "running", 1: "ok"}), issued, finished=True) is None


class _Doom:
    def __init__(self, found: Doomed) -> None:
        self.found = found

    def check(self) -> Doomed:
        return self.found


def test_the_wait_ends_a_proven_hang_as_its_timeout_would_and_interrupts_a_doomed_cell() -> None:
    run = SimpleNamespace(finished=threading.Event())
    interrupted: list[list[int]] = []
    hang = _result({0: "running", 1: "ok"})
    wait_for_cell(hang, run, None, interrupted.append, 30.0, None, 0.01, None,  # type: ignore[arg-type]
                  fail_fast=_Doom(Doomed(5, {1: FINISHED}, {0: "barrier"})))  # type: ignore[arg-type]
    assert hang.timed_out and interrupted == [] and "a hang, proven" in hang.notes[-1]  # ranks left running, as at a timeout
    raised = _result({0: "running", 1: "error"})
    wait_for_cell(raised, SimpleNamespace(finished=_SetOnWait()), None, interrupted.append, 30.0, None, 0.01, None,  # type: ignore[arg-type]
                  fail_fast=_Doom(Doomed(5, {1: "raised ValueError"}, {0: "barrier"})))  # type: ignore[arg-type]
    assert not raised.timed_out and interrupted == [[0]]


class _SetOnWait(threading.Event):
    """Finished on the second look: the first tick's fail-fast check has run by then."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.looks += 1
        if self.looks > 1:
            self.set()
        return self.is_set()
