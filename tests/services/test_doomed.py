"""When a cell is doomed (services/fail_fast.py), on the controller's own log: only when the
records prove that a rank still running waits for a call a rank that left never reached."""

from __future__ import annotations

from distnb.controller.collective_log import CollectiveLog
from distnb.results import CellResult, RankResult
from distnb.services.fail_fast import doomed
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
