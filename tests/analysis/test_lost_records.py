"""A rank that aborted takes its unpushed records with it: its absence from the rest of the cell
is not known, never "it skipped the call", and the calls that were recorded judge the others."""

from __future__ import annotations

from typing import Any

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Kind
from distnb.controller.collective_log import CollectiveLog

CELL = 5
SOURCE = "for step in range(3):\n    loss = model(x)\n    dist.all_reduce(loss)\n"


def _entry(seq: int, size: int, done: bool = True, cell: int = CELL) -> dict[str, Any]:
    return {"id": seq, "group": "0", "desc": "default_pg", "seq": seq, "p2p": False, "op": "all_reduce", "sizes": [[size]],
            "dtypes": ["Float"], "t": float(seq), "done": done, "cell": cell, "line": 3, "call_cell": cell, "func": "<module>"}


def _judge(sizes: dict[int, list[int]], dead_last: int, dead_cell: int = CELL):
    """Ranks 0-2 alive with calls of ``sizes``; rank 3 aborted with its records up to ``dead_last``
    (the last one open), in cell ``dead_cell``."""
    log = CollectiveLog()
    for r, row in sizes.items():
        es = [_entry(i + 1, s, done=i + 1 < len(row)) for i, s in enumerate(row)]
        log.merge(r, {"entries": es, "groups": {"0": [0, 1, 2, 3]}, "descs": {}, "calls": [], "now": 0.0})
    dead = [_entry(i + 1, sizes[1][i], done=i + 1 < dead_last) for i in range(dead_last)]
    log.merge(3, {"entries": dead, "groups": {"0": [0, 1, 2, 3]}, "descs": {}, "calls": [], "now": 0.0})
    log.died_during[3] = dead_cell
    positions = [Position(r, "collective", op="all_reduce", seq=len(sizes[r]), group="0", since=4.0, running=CELL, line=3, line_cell=CELL)
                 for r in (0, 1, 2)]
    positions.append(Position(3, "dead", detail="aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)"))
    return diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 3, {CELL: SOURCE}, CELL), log.report([0, 1, 2, 3])


def test_the_recorded_calls_name_the_odd_rank_and_the_aborted_one_is_its_victim() -> None:
    verdict, report = _judge({0: [8, 8, 8, 8, 16], 1: [8, 8, 8, 8, 1], 2: [8, 8, 8, 8, 1]}, dead_last=3)
    [div] = report.divergences()
    assert (div.seq, div.kind) == (5, "shape"), report.text()  # not "rank 3 never entered #4"
    assert verdict.culprits == [0] and verdict.rule == "victim", verdict.summary
    assert "Root cause: likely rank 0, the odd one out of the calls recorded" in verdict.summary, verdict.summary
    assert "rank 3 is a victim" in verdict.summary and "while the calls recorded at all_reduce #5" in verdict.summary


def test_when_the_recorded_calls_agree_the_aborted_rank_stays_the_likely_cause() -> None:
    verdict, report = _judge({0: [8, 8, 8, 8], 1: [8, 8, 8, 8], 2: [8, 8, 8, 8]}, dead_last=2)
    assert report.divergences() == [], report.text()
    assert verdict.culprits == [3], verdict.summary


def _short_in_cell_4() -> CollectiveLog:
    """Cell 4 ended on every rank with rank 3 a collective short; rank 3 then died in this cell."""
    log = CollectiveLog()
    for r in range(4):
        es = [_entry(1, 8, cell=4)] + ([_entry(2, 8, cell=4)] if r != 3 else [])
        log.merge(r, {"entries": es, "groups": {"0": [0, 1, 2, 3]}, "descs": {}, "calls": [], "now": 0.0})
    log.died_during[3] = CELL
    return log


def test_a_call_skipped_in_an_earlier_cell_is_still_missing() -> None:
    # The entries of cell 4 ended with the cell on every rank: rank 3's absence there is a fact.
    log = _short_in_cell_4()
    [div] = log.report([0, 1, 2, 3]).divergences()
    assert (div.seq, div.kind, div.odd()) == (2, "missing", [3])


def test_an_abort_after_a_cell_that_left_the_rank_a_call_short_is_that_missing_call() -> None:
    log = _short_in_cell_4()
    positions = [Position(r, "failed", detail="RuntimeError: Connection closed by peer", line=3, running=CELL, line_cell=CELL)
                 for r in (0, 1, 2)]
    positions.append(Position(3, "dead", detail="aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)"))
    verdict = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 3, {CELL: SOURCE}, CELL)
    assert (verdict.kind, verdict.culprits) == (Kind.CALL_MISSING, [3]), verdict.summary
    assert "it did not make all_reduce [8] f32 #2 on group 0 (issued in cell 4, line 3), which ranks 0-2 made" in verdict.summary, verdict.summary


MESH_SOURCE = ("grad = torch.full((6,), float(rank))\nshard = torch.ones(3) * rank\nfor step in range(2):\n"
               "    dist.all_reduce(grad, group=dp)\n    full = torch.empty(6)\n    dist.all_gather_into_tensor(full, shard, group=tp)\n")


def test_a_rank_that_died_in_a_call_of_one_mesh_dimension_is_not_placed_in_the_other() -> None:
    """A (dp, tp) mesh: rank 3 aborted in its dp all_reduce (line 4) before any record of it came;
    its tp peer waits at line 6. Its death is not a call "on tp" at another line (which made rank 1,
    tp-less of that group, the one that "did not make" the all_gather): it died before that call."""
    log = CollectiveLog()
    groups = {"1": [0, 2], "2": [1, 3], "3": [0, 1], "4": [2, 3]}
    descs = {"1": "mesh_dp", "2": "mesh_dp", "3": "mesh_tp", "4": "mesh_tp"}

    def e(i: int, g: str, op: str, line: int, size: int, done: bool, t: float) -> dict[str, Any]:
        return {**_entry(i, size, done), "group": g, "seq": 1, "op": op, "line": line, "desc": descs[g], "t": t}
    # Rank 2 reached its all_gather first: the disagreement on its tp group (with rank 3) is the earliest.
    rows = {0: [e(1, "1", "all_reduce", 4, 6, True, 1.0), e(2, "3", "all_gather", 6, 3, False, 2.0)],
            1: [e(1, "2", "all_reduce", 4, 6, False, 1.0)],
            2: [e(1, "1", "all_reduce", 4, 6, True, 1.0), e(2, "4", "all_gather", 6, 3, False, 1.5)]}
    for r, es in rows.items():
        log.merge(r, {"entries": es, "groups": groups, "descs": descs, "calls": [], "now": 0.0})
    log.merge(3, {"entries": [], "groups": groups, "descs": descs, "calls": [], "now": 0.0})
    log.died_during[3] = CELL
    log.died_in[3], log.died_at[3] = "all_reduce", (CELL, 4)
    reset = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    positions = [Position(0, "collective", op="all_gather", seq=1, group="3", since=4.0, running=CELL, line=6, line_cell=CELL),
                 Position(1, "failed", detail=reset, line=4, running=CELL, line_cell=CELL),
                 Position(2, "failed", detail=reset, line=6, running=CELL, line_cell=CELL),
                 Position(3, "dead", detail="aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)")]
    verdict = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 3, {CELL: MESH_SOURCE}, CELL)
    assert verdict.culprits == [3] and "all_reduce" in verdict.summary, verdict.summary
    assert "did not make" not in verdict.summary, verdict.summary


SUBGROUP_SOURCE = ("lo = dist.new_group([0, 1])\nhi = dist.new_group([2, 3])\nmine = lo if rank < 2 else hi\nv = torch.ones(3) * rank\n"
                   "for it in range(2):\n    dist.all_reduce(v, group=mine)\ndist.barrier()\n")


def _subgroup_entry(i: int, g: str, seq: int, op: str, line: int, done: bool, t: float) -> dict[str, Any]:
    return {**_entry(i, 3, done), "group": g, "seq": seq, "op": op, "line": line, "desc": "undefined", "t": t}


def _subgroup_log(rows: dict[int, list[dict[str, Any]]]) -> CollectiveLog:
    """SUBGROUP_SOURCE's groups (the world, ranks 0,1 and ranks 2,3), each rank's entries as given."""
    log = CollectiveLog()
    for r, es in rows.items():
        log.merge(r, {"entries": es, "groups": {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}, "descs": {}, "calls": [], "now": 0.0})
    return log


def test_the_disagreement_first_in_the_program_leads_not_the_one_entered_first() -> None:
    """Rank 2 skipped its subgroup's all_reduces (line 6) and entered the barrier (line 7) before
    anyone; its peer rank 3 waits in the all_reduce, so is absent from the barrier. Each
    disagreement holds the other's absent rank; the all_reduce comes first in the cell."""
    e = _subgroup_entry
    rows = {r: [e(1, "1", 1, "all_reduce", 6, True, 1.1), e(2, "1", 2, "all_reduce", 6, True, 1.3), e(3, "0", 1, "barrier", 7, False, 2.0)]
            for r in (0, 1)}
    rows[2] = [e(1, "0", 1, "barrier", 7, False, 1.0)]
    rows[3] = [e(1, "2", 1, "all_reduce", 6, False, 1.2)]
    log = _subgroup_log(rows)
    positions = [Position(r, "collective", op="barrier", seq=1, group="0", since=4.0, running=CELL, line=7, line_cell=CELL) for r in (0, 1, 2)]
    positions.append(Position(3, "collective", op="all_reduce", seq=1, group="2", since=4.0, running=CELL, line=6, line_cell=CELL))
    verdict = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 3, {CELL: SUBGROUP_SOURCE}, CELL)
    assert (verdict.kind, verdict.culprits) == (Kind.CALL_MISSING, [2]), verdict.summary
    assert "rank 2 did not make all_reduce #1" in verdict.summary, verdict.summary


def test_a_rank_that_raised_before_its_subgroup_call_is_the_cause_not_a_barrier_it_never_reached() -> None:
    """Rank 1 raised before its subgroup's all_reduce (line 6): rank 0 waits there, ranks 2,3 went
    on to the barrier (line 7), entered before anything else. The barrier's absent ranks wait in, or
    left before, the earlier call: the error is the cause."""
    e = _subgroup_entry
    rows = {r: [e(1, "2", 1, "all_reduce", 6, True, 0.5), e(2, "2", 2, "all_reduce", 6, True, 0.6), e(3, "0", 1, "barrier", 7, False, 0.7)]
            for r in (2, 3)}
    rows[0] = [e(1, "1", 1, "all_reduce", 6, False, 1.0)]
    rows[1] = []
    log = _subgroup_log(rows)
    positions = [Position(0, "collective", op="all_reduce", seq=1, group="1", since=4.0, running=CELL, line=6, line_cell=CELL),
                 Position(1, "failed", detail="AssertionError: an invariant broken on rank 1", line=4, running=CELL, line_cell=CELL)]
    positions += [Position(r, "collective", op="barrier", seq=1, group="0", since=4.0, running=CELL, line=7, line_cell=CELL) for r in (2, 3)]
    verdict = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 3, {CELL: SUBGROUP_SOURCE}, CELL)
    assert (verdict.kind, verdict.culprits) == (Kind.RAISED, [1]), verdict.summary
