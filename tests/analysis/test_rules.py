"""Each verdict rule on records made for it: the rule that fires, its kind, culprits, site and
certainty. Every rule in ``RULES`` has a case here (the last test holds the list to it), so a new
rule comes with its test. The corpus (benchmarks/bench_diagnosis.py) judges them on real pools."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from words_lint import faults

from distnb.analysis.verdicts.diagnose import RULES, diagnose
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Certainty, Kind, Verdict, VerdictState
from distnb.controller.collective_log import CollectiveLog

CELL = 5
SOURCE = "\n".join([
    "x = torch.ones(4)",              # 1
    "for step in range(3):",          # 2
    "    dist.all_reduce(x)",         # 3
    "if rank == 0:",                  # 4
    "    dist.all_reduce(loss)",      # 5
    "dist.barrier()",                 # 6
])


def entry(i: int, seq: int, op: str = "all_reduce", line: int | None = 3, size: int = 4, done: bool = True, group: str = "0",
          dtype: str = "Float", cell: int = CELL, **args: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"id": i, "group": group, "desc": "default_pg" if group == "0" else DESCS.get(group, "undefined"), "seq": seq, "p2p": False,
                         "op": op, "sizes": [[size]] if size else [], "dtypes": [dtype] if size else [], "t": float(i), "done": done,
                         "cell": cell}
    if line is not None:
        e.update(line=line, call_cell=cell, func="<module>")
    if args:
        e["args"] = args
    return e


def log_of(per_rank: dict[int, list[dict[str, Any]]], groups: dict[str, list[int]] | None = None,
           calls: dict[int, list[dict[str, Any]]] | None = None, descs: dict[str, str] | None = None) -> CollectiveLog:
    log = CollectiveLog()
    for r, entries in per_rank.items():
        log.merge(r, {"entries": entries, "groups": groups or {"0": sorted(per_rank)}, "descs": descs or {},
                      "calls": (calls or {}).get(r, []), "now": 0.0})
    return log


def waits(rank: int, op: str = "all_reduce", seq: int | None = None, line: int = 3, group: str | None = "0", **kw: Any) -> Position:
    return Position(rank, "collective", op=op, seq=seq, group=group, since=5.0, line=line, running=CELL, line_cell=CELL, **kw)


def judge(positions: list[Position], log: CollectiveLog | None = None, first_death: int | None = None) -> Verdict:
    ranks = sorted(p.rank for p in positions)
    return diagnose(positions, 3.0, 5.0, log.report(ranks) if log is not None else None, first_death, {CELL: SOURCE})


def loop_calls(n: int, done: bool = True) -> list[dict[str, Any]]:
    return [entry(i, i + 1, done=done or i < n - 1) for i in range(n)]


# -- the cases: each returns the verdict the named rule must give ---------------------------------
def case_paused() -> Verdict:
    return judge([Position(0, "paused", detail="paused in the debugger", line=3, running=CELL), waits(1)])


def case_quiet() -> Verdict:
    return diagnose([Position(0, "collective", op="all_reduce", since=0.5), Position(1, "finished")], 3.0, 0.5)


def case_creation() -> Verdict:
    def made(n: int, ranks: list[int], line: int) -> dict[str, Any]:
        return {"n": n, "op": "new_group", "group": "0", "args": {"ranks": ranks}, "t": 0, "end": None, "cell": CELL, "line": line,
                "func": "<module>", "count": n}
    calls = {r: [made(1, [0, 1], 1), made(2, [2, 3], 2)] for r in (0, 1, 3)}
    calls[2] = [made(1, [2, 3], 2)]
    log = log_of({r: [] for r in range(4)}, calls=calls)
    return judge([waits(r, "new_group", line=2 if r == 2 else 1) for r in range(4)], log)


def case_cross_cell() -> Verdict:
    # Rank 0's all_reduce(async_op=True) of cell 4, never waited on, pairs with the others' of cell 5.
    per_rank = {0: [entry(0, 1, cell=4, line=2, done=False)], **{r: [entry(0, 1, done=False)] for r in (1, 2, 3)}}
    return judge([waits(r, seq=1) for r in range(4)], log_of(per_rank))


def case_victim() -> Verdict:
    # A rank aborted inside a mismatch no rank's position ties to a cell (the agreement rule judges
    # one cell): the log's first divergence names the odd rank, not the one that died.
    per_rank = {0: [entry(0, 1)], 1: [], 2: [entry(0, 1, dtype="Double")], 3: [entry(0, 1)]}
    log = log_of(per_rank)
    log.died_in[1] = "all_reduce"
    return judge([Position(0, "finished"), Position(1, "dead", detail="aborted (SIGABRT)"), Position(2, "finished"),
                  Position(3, "finished")], log, first_death=1)


MESH = {"1": [0, 2], "2": [1, 3], "3": [0, 1], "4": [2, 3]}
DESCS = {"1": "mesh_dp", "2": "mesh_dp", "3": "mesh_tp", "4": "mesh_tp"}
TP = {0: "3", 1: "3", 2: "4", 3: "4"}
DP = {0: "1", 1: "2", 2: "1", 3: "2"}


def case_wrong_group() -> Verdict:
    # Rank 1 all_gathers over dp where the others use tp, from the same line.
    per_rank = {r: [entry(0, 1, "all_gather", line=3, group=DP[r] if r == 1 else TP[r], done=r in (2, 3))] for r in range(4)}
    log = log_of(per_rank, MESH, descs=DESCS)
    return judge([waits(0, "all_gather", 1, group="3"), waits(1, "all_gather", 1, group="2"), Position(2, "finished"),
                  Position(3, "finished")], log)


def case_agreement() -> Verdict:
    # The first case: after a loop of three, `if master_process: dist.all_reduce(loss)` —
    # rank 0 makes a call (another shape, another line) the others never make.
    per_rank = {0: loop_calls(3) + [entry(3, 4, line=5, size=1, done=False)], **{r: loop_calls(3) for r in (1, 2, 3)}}
    return judge([waits(0, seq=4, line=5), *(Position(r, "finished") for r in (1, 2, 3))], log_of(per_rank))


def case_p2p_departure() -> Verdict:
    # A pipeline: each rank receives from the one before and sends to the next; rank 1 sends two ahead.
    def call(n: int, op: str, peer: int, line: int) -> dict[str, Any]:
        key = "dst" if op == "send" else "src"
        return {"n": n, "op": op, "group": "0", "args": {key: peer, "tag": 0}, "t": n, "end": None if op == "recv" else n,
                "cell": CELL, "line": line, "func": "<module>", "sizes": [[4]], "dtypes": ["Float"]}
    # Rank 2 sends to rank 0 (two ahead, round the ring) where ranks 0,1 send to the next.
    calls = {0: [call(1, "send", 1, 6)], 1: [call(1, "recv", 0, 4), call(2, "send", 2, 6)], 2: [call(1, "recv", 1, 4), call(2, "send", 0, 6)],
             3: [call(1, "recv", 2, 4)]}
    for c in calls[2] + calls[1]:
        c["end"] = c["n"]
    log = log_of({r: [] for r in range(4)}, calls=calls)
    return judge([Position(0, "finished"), Position(1, "finished"), Position(2, "finished"),
                  Position(3, "collective", op="recv", since=5.0, peers=calls[3], running=CELL, line=4)], log)


def case_died() -> Verdict:
    return judge([waits(0), Position(1, "dead", detail="exited with code 3"), waits(2)], first_death=1)


def case_raised() -> Verdict:
    return judge([waits(0), Position(1, "failed", line=2, code="raise ValueError('bad batch')", detail="ValueError: bad batch"), waits(2)])


def case_p2p() -> Verdict:
    def p2p(rank: int, op: str, peer: int) -> Position:
        key = "dst" if op == "send" else "src"
        return Position(rank, "collective", op=op, since=5.0, peers=[{"op": op, "args": {key: peer, "tag": 0}}])
    return judge([p2p(0, "send", 1), p2p(1, "recv", 2), Position(2, "finished"), Position(3, "finished")])


def case_finished_early() -> Verdict:
    return judge([waits(0, "barrier", line=6), waits(1, "barrier", line=6), Position(2, "finished")])


def case_not_in_cell() -> Verdict:
    return judge([Position(0, "collective", op="all_reduce", seq=1, group="0", since=5.0), Position(1, "idle")])


def case_unresponsive() -> Verdict:
    return judge([waits(0), Position(1, "unresponsive", detail="its process (pid 7) is stopped")])


def case_computing() -> Verdict:
    return judge([waits(0), Position(1, "computing", line=2, since=5.0)])


def case_new_group_wait() -> Verdict:
    return judge([waits(r, "new_group", line=1, group=None) for r in range(2)])


def case_disagree() -> Verdict:
    return judge([waits(0, "all_reduce", 4, group=None), waits(1, "broadcast", 4, group=None), waits(2, "all_reduce", 4, group=None)])


def case_same_collective() -> Verdict:
    return judge([waits(r, group=None) for r in range(3)])


def case_seq_blame() -> Verdict:
    # A loaded job known by NCCL's dumps alone: every entry completed by the abort, every rank
    # "in" its last collective; rank 2 got to #3 on group 0, the others to #4.
    log = log_of({r: [entry(i, i + 1) for i in range(3 if r == 2 else 4)] for r in range(3)})
    positions = [waits(r, seq=3 if r == 2 else 4, group=None) for r in range(3)]
    return diagnose(positions, 3.0, 5.0, log.report([0, 1, 2]), None, {CELL: SOURCE}, dumps_only=frozenset(range(3)))


def case_straggler() -> Verdict:
    # A cell in its stride (no wait past the threshold): rank 3 arrives 40 ms after the others at
    # each of 20 collectives, the others within 3 ms of each other.
    late = {r: [entry(i, i + 1) | {"t": 100.0 + i * 0.1 + (0.04 if r == 3 else 0.001 * r)} for i in range(20)] for r in range(4)}
    positions = [Position(r, "collective", op="all_reduce", seq=21, group="0", since=0.02, line=3, running=CELL, line_cell=CELL)
                 for r in range(4)]
    return judge(positions, log_of(late))


#: rule → (case, kind, culprits, state, certainty or None for either)
CASES: dict[str, tuple[Callable[[], Verdict], Kind, list[int], VerdictState, Certainty | None]] = {
    "paused": (case_paused, Kind.PAUSED, [], VerdictState.PAUSED, Certainty.CERTAIN),
    "quiet": (case_quiet, Kind.NONE, [], VerdictState.OK, None),
    "creation": (case_creation, Kind.GROUP_CREATION, [2], VerdictState.HANG, Certainty.LIKELY),
    "cross_cell": (case_cross_cell, Kind.CROSS_CELL, [0], VerdictState.HANG, Certainty.LIKELY),
    "wrong_group": (case_wrong_group, Kind.WRONG_GROUP, [1], VerdictState.HANG, Certainty.LIKELY),
    "agreement": (case_agreement, Kind.CALL_EXTRA, [0], VerdictState.HANG, Certainty.CERTAIN),
    "victim": (case_victim, Kind.MISMATCH, [2], VerdictState.FAILED, Certainty.LIKELY),
    "p2p_departure": (case_p2p_departure, Kind.P2P_UNMATCHED, [2], VerdictState.HANG, Certainty.LIKELY),
    "died": (case_died, Kind.DIED, [1], VerdictState.HANG, Certainty.CERTAIN),
    "raised": (case_raised, Kind.RAISED, [1], VerdictState.HANG, Certainty.CERTAIN),
    "p2p": (case_p2p, Kind.P2P_UNMATCHED, [1], VerdictState.HANG, Certainty.LIKELY),
    "finished_early": (case_finished_early, Kind.CALL_MISSING, [2], VerdictState.HANG, Certainty.LIKELY),
    "not_in_cell": (case_not_in_cell, Kind.NOT_IN_CELL, [1], VerdictState.HANG, Certainty.CERTAIN),
    "unresponsive": (case_unresponsive, Kind.UNRESPONSIVE, [1], VerdictState.HANG, Certainty.LIKELY),
    "computing": (case_computing, Kind.STILL_RUNNING, [1], VerdictState.HANG, Certainty.LIKELY),
    "new_group_wait": (case_new_group_wait, Kind.GROUP_CREATION, [], VerdictState.HANG, Certainty.LIKELY),
    "seq_blame": (case_seq_blame, Kind.CALL_MISSING, [2], VerdictState.HANG, Certainty.LIKELY),
    "disagree": (case_disagree, Kind.MISMATCH, [1], VerdictState.HANG, Certainty.LIKELY),
    "same_collective": (case_same_collective, Kind.SLOW_COLLECTIVE, [], VerdictState.SLOW, None),
    "straggler": (case_straggler, Kind.STRAGGLER, [3], VerdictState.SLOW, None),
}


@pytest.mark.parametrize("rule", list(CASES))
def test_the_rule_gives_its_verdict(rule: str) -> None:
    case, kind, culprits, state, certainty = CASES[rule]
    verdict = case()
    assert (verdict.rule, verdict.kind, verdict.culprits, verdict.state) == (rule, kind, culprits, state), verdict.text()
    if certainty is not None:
        assert verdict.certainty == certainty, verdict.text()
    if verdict.certainty == Certainty.LIKELY and verdict.is_problem:
        assert verdict.reason, f"a likely verdict says why it is only likely: {verdict.text()}"
    assert verdict.text().startswith("[distnb] ")
    # A death or an error is said by the cell's own report: the verdict adds no root cause to it.
    assert verdict.beyond_report == (rule not in ("died", "raised")), rule


def test_a_p2p_departure_names_the_peer_used_and_the_peer_expected() -> None:
    verdict = case_p2p_departure()
    assert ("rank 2's sends at cell 5 line 6 go to rank 0 (2 ranks on), where the other ranks' there go to the next rank "
            "(rank 3, for rank 2)") in verdict.summary, verdict.text()


def test_every_rule_has_a_case() -> None:
    assert [name for name, _ in RULES] == list(CASES)


def test_the_agreement_rule_names_site_cause_and_evidence() -> None:
    verdict = case_agreement()
    assert verdict.summary.startswith("rank-conditional collective: rank 0 entered all_reduce #4 [1] f32 at cell line 5, but ranks 1-3 "
                                      "finished the cell without entering it"), verdict.summary
    assert "under `if rank == 0:` (line 4)" in verdict.summary and verdict.summary.endswith("Root cause: rank 0.")
    assert [(s.cell, s.line) for s in verdict.sites] == [(CELL, 5)]
    assert verdict.evidence is not None and verdict.evidence.records[0].startswith("all_reduce [1] f32")
    assert verdict.evidence.records[1] == "no call"


def test_a_rank_that_skipped_the_call_in_the_loop_is_missing_it() -> None:
    per_rank = {r: loop_calls(3, done=False) for r in (0, 2, 3)}
    per_rank[1] = loop_calls(2)
    verdict = judge([*(waits(r, seq=3) for r in (0, 2, 3)), Position(1, "finished")], log_of(per_rank))
    assert (verdict.kind, verdict.culprits) == (Kind.LOOP_COUNT, [1]), verdict.text()
    assert "rank 1 ran 2 steps of (all_reduce [4] f32) at cell line 3" in verdict.summary


def test_a_call_at_the_same_site_with_another_shape_is_a_certain_mismatch() -> None:
    per_rank = {r: [entry(0, 1, size=6 if r == 2 else 4, done=False)] for r in range(4)}
    verdict = judge([waits(r, seq=1) for r in range(4)], log_of(per_rank))
    assert (verdict.kind, verdict.culprits, verdict.certainty) == (Kind.MISMATCH, [2], Certainty.CERTAIN), verdict.text()
    assert verdict.evidence is not None and verdict.evidence.fields == ("shape",)


def test_a_rank_whose_call_is_further_down_the_cell_skipped_the_others_call() -> None:
    # Ranks 0,2,3 wait in the loop's all_reduce; rank 1 is already at the barrier below it.
    per_rank = {r: [entry(0, 1, done=False)] for r in (0, 2, 3)}
    per_rank[1] = [entry(0, 1, "barrier", line=6, size=0, done=False)]
    verdict = judge([*(waits(r, seq=1) for r in (0, 2, 3)), waits(1, "barrier", 1, line=6)], log_of(per_rank))
    assert (verdict.kind, verdict.culprits) == (Kind.CALL_MISSING, [1]), verdict.text()


def _no_seams(rule: str, text: str) -> None:
    assert not faults(text), (rule, faults(text))


@pytest.mark.parametrize("rule", list(CASES))
def test_every_verdicts_words_have_no_seams_or_cut_labels(rule: str) -> None:
    _no_seams(rule, CASES[rule][0]().text())


def test_the_collectives_view_of_each_case_has_no_seams_or_cut_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, list[Position], CollectiveLog | None]] = []
    original, running = judge, [""]

    def keep(positions: list[Position], log: CollectiveLog | None = None, first_death: int | None = None) -> Verdict:
        seen.append((running[0], positions, log))
        return original(positions, log, first_death)

    monkeypatch.setitem(globals(), "judge", keep)
    for rule, (case, *_) in CASES.items():
        running[0] = rule
        case()
    logged = [(rule, positions, log) for rule, positions, log in seen if log is not None]
    assert len(logged) >= 6, [rule for rule, _, _ in logged]  # the cases with a log: agreement, mismatches, p2p, groups
    for rule, positions, log in logged:
        _no_seams(rule, log.report(sorted(p.rank for p in positions)).text())


def test_finished_ranks_whose_counts_show_the_call_are_not_said_to_have_skipped_it() -> None:
    # A slow link (seen on network-namespace hosts): ranks 0,2,3 finished all_reduce #2 and the cell
    # while rank 1 still received its data; their log of #2 had not arrived, their CELL_DONE had.
    per_rank = {1: loop_calls(1) + [entry(1, 2, done=False)], **{r: loop_calls(1) for r in (0, 2, 3)}}
    finished = [Position(r, "finished", seqs={"0": 2}) for r in (0, 2, 3)]
    verdict = judge([*finished, waits(1, seq=2)], log_of(per_rank))
    assert verdict.state == VerdictState.SLOW and verdict.kind == Kind.SLOW_COLLECTIVE and verdict.culprits == [], verdict.text()
    assert "ranks 0,2,3 issued all_reduce #2" in verdict.summary and "without entering" not in verdict.text(), verdict.text()
    # Counts that stop short of the call agree with the log: the loop ran once more on rank 1.
    short = [Position(r, "finished", seqs={"0": 1}) for r in (0, 2, 3)]
    skipped = judge([*short, waits(1, seq=2)], log_of(per_rank))
    assert (skipped.state, skipped.kind, skipped.culprits) == (VerdictState.HANG, Kind.LOOP_COUNT, [1]), skipped.text()
    # With no counts (an older rank), the log alone decides, as before.
    unknown = judge([*(Position(r, "finished") for r in (0, 2, 3)), waits(1, seq=2)], log_of(per_rank))
    assert unknown.state == VerdictState.HANG, unknown.text()


MASTER_SETUP = 'import os\nddp_rank = int(os.environ["RANK"])\nmaster_process = ddp_rank == 0\n'
MASTER_LOOP = "\n".join([
    "for it in range(4):",                          # 1
    "    for micro in range(2):",                   # 2
    "        loss = model(x)",                      # 3
    "        loss.backward()",                      # 4: DDP's all_reduce, from C++
    "    opt.step()",                               # 5
    "    if it % 2 == 1 and master_process:",       # 6
    "        dist.all_reduce(loss)",                # 7
])


@pytest.mark.parametrize("pushed", [0, 1, 3])
def test_a_master_only_call_that_aborted_rank_0_is_its_branch_whatever_reached_distnb_first(pushed: int) -> None:
    """Issue 49's headline: rank 0's ``all_reduce(loss)`` under ``if … and master_process:`` pairs
    with the others' DDP all_reduce, and gloo aborts rank 0 before it pushes its calls. Its black
    box gives its own call (#4, a scalar); of its DDP calls before it, ``pushed`` reached distnb.
    Whatever that number, the verdict is rank 0's extra call under its ``if``, never a DDP call
    "not made", and the collectives view says the same."""
    ddp = [entry(i, i + 1, line=None, size=4160, done=i < 3) for i in range(4)]
    mine = entry(9, 4, line=7, size=0, done=False)
    mine.update(sizes=[[]], dtypes=["Float"])
    log = log_of({0: [e for e in ddp[:pushed] if e["done"]] + [mine], 1: ddp, 2: ddp, 3: ddp})
    log.died_during[0] = CELL
    positions = [Position(0, "dead", detail="aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)"),
                 Position(1, "failed", line=4, running=CELL, detail="RuntimeError: Connection reset by peer"),
                 waits(2, seq=4, line=4), Position(3, "failed", line=4, running=CELL, detail="RuntimeError: Connection reset by peer")]
    v = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]), 0, {1: MASTER_SETUP, CELL: MASTER_LOOP})
    assert v.kind == Kind.CALL_EXTRA and v.culprits == [0], v.text
    assert v.summary.startswith("rank-conditional collective: rank 0 entered all_reduce #4 [] f32 at cell line 7, but ranks 1-3 did not "
                                "enter it"), v.summary
    assert "is under `if it % 2 == 1 and master_process:` (line 6)" in v.summary, v.summary
    report = log.report([0, 1, 2, 3]).text()
    assert report.startswith("first divergence: collective #4 on group 0 (ranks 0-3): different shapes: rank 0 all_reduce [] f32; "
                             "ranks 1-3 all_reduce [4160] f32"), report


def test_a_rank_past_a_position_is_not_said_to_have_skipped_it() -> None:
    """A group's sequence numbers run without gaps: a rank whose log holds #4 made #2 and #3, even
    when their entries died with it."""
    full = [entry(i, i + 1) for i in range(4)]
    log = log_of({0: [full[0], full[3]], 1: full, 2: full})
    log.died_during[0] = CELL
    assert log.report([0, 1, 2]).divergences() == []


def test_the_table_says_not_recorded_where_a_rank_got_past_a_position_without_its_entry() -> None:
    full = [entry(i, i + 1) for i in range(4)]
    log = log_of({0: [full[0], full[3]], 1: full})
    text = log.report([0, 1]).text()
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert "not recorded" in rows["2"] and "not recorded" in rows["3"] and "—" not in text.split("(⏳")[0], text
    assert "not recorded: made, but its record died with the rank or was let go)" in text, text
    assert "not recorded" not in log_of({0: full, 1: full}).report([0, 1]).text()


@pytest.mark.parametrize(("cpu", "state", "words"), [
    (0.9, VerdictState.SLOW, "still computing outside any collective (its main thread is busy 90% of the time or more): slow, not a hang yet"),
    (0.25, VerdictState.SLOW, "is busy 25% of the time or more"),  # a thread that computes only part of the time
    (0.01, VerdictState.HANG, "without using the CPU (blocked on something else: a sleep, a lock, a queue, I/O"),
    (0.1, VerdictState.HANG, "(slow, stuck in a loop, or about to skip it)"),
    (None, VerdictState.HANG, "(slow, stuck in a loop, or about to skip it)"),
])
def test_a_rank_still_running_code_is_slow_while_it_computes_and_a_likely_hang_while_blocked(cpu: float | None, state: VerdictState,
                                                                                               words: str) -> None:
    """A rank given more work computes while the others wait at the barrier: a healthy cell, slow,
    never a hang block; a rank that sleeps, waits on a lock or reads a socket uses no CPU."""
    v = judge([waits(0), Position(1, "computing", line=2, since=5.0, cpu=cpu)])
    assert v.kind == Kind.STILL_RUNNING and v.state == state and v.culprits == [1] and words in v.summary, v.summary


def test_a_straggler_never_takes_the_place_of_a_fault() -> None:
    """The straggler rule judges a calm cell only: the same late arrivals beside a rank that died,
    or a wait past the threshold, give those verdicts."""
    late = {r: [entry(i, i + 1) | {"t": 100.0 + i * 0.1 + (0.04 if r == 3 else 0.001 * r)} for i in range(20)] for r in range(4)}
    calm = [Position(r, "collective", op="all_reduce", seq=21, group="0", since=0.02, line=3, running=CELL, line_cell=CELL) for r in range(4)]
    assert judge(calm, log_of(late)).rule == "straggler"
    died = [*calm[:1], Position(1, "dead", detail="SIGKILL"), *calm[2:]]
    assert judge(died, log_of(late), first_death=1).rule == "died"
    stuck = [Position(r, "collective", op="all_reduce", seq=21, group="0", since=5.0, line=3, running=CELL, line_cell=CELL) for r in range(4)]
    assert judge(stuck, log_of(late)).rule == "same_collective"
    even = {r: [entry(i, i + 1) | {"t": 100.0 + i * 0.1 + 0.0001 * ((r + i) % 4)} for i in range(20)] for r in range(4)}
    assert judge(calm, log_of(even)).rule == "quiet"


def test_a_call_torch_skipped_on_a_group_the_rank_is_not_in_is_named_as_such() -> None:
    """Rank 2 called all_reduce with a group new_group gave it as a non-member (torch returns at
    once, with a warning): the group's member that waits is not "the extra call" of a tie of two —
    rank 2, whose call went nowhere, is the one that did not make it, and the skip is the cause."""
    skipped = {"n": 1, "op": "all_reduce", "group": "?", "args": {}, "t": 1, "end": 1, "cell": CELL, "line": 3, "func": "<module>",
               "skipped": True}
    log = log_of({0: [entry(0, 1, group="1", done=False)], 1: [], 2: []}, groups={"0": [0, 1, 2], "1": [0, 2]}, calls={2: [skipped]})
    positions = [waits(0, group="1", seq=1), Position(1, "finished"), Position(2, "finished")]
    verdict = judge(positions, log)
    assert (verdict.kind, verdict.culprits, verdict.victims) == (Kind.CALL_MISSING, [2], [0]), verdict.text()
    assert "rank 2 called all_reduce at cell line 3 on a group it is not a member of" in verdict.summary, verdict.text()
    assert "torch skipped the call" in verdict.summary and verdict.certainty == Certainty.LIKELY and verdict.reason, verdict.text()
    # Without the call log's mark, the same records are the tie they were.
    del skipped["skipped"]
    plain = judge(positions, log_of({0: [entry(0, 1, group="1", done=False)], 1: [], 2: []}, groups={"0": [0, 1, 2], "1": [0, 2]},
                                    calls={2: [skipped]}))
    assert "not a member" not in plain.summary and plain.culprits == [0], plain.text()


def test_a_thread_that_raised_before_its_call_is_the_cause() -> None:
    """Ranks 0,1 wait in an all_reduce their `work()` thread made; rank 2's thread raised in
    work() first (the rank itself finished the cell): the thread and its error are the cause,
    not a condition on the rank."""
    per_rank = {r: [entry(0, 1, line=5, done=False) | {"func": "work"}] for r in (0, 1)} | {2: []}
    error = {"thread": "loader", "ename": "ValueError", "evalue": "bad shard index", "cell": CELL, "line": 4, "func": "work",
             "during": CELL}
    positions = [waits(0, seq=1, line=8), waits(1, seq=1, line=8), Position(2, "finished", threads=[error])]
    verdict = judge(positions, log_of(per_rank))
    assert (verdict.kind, verdict.culprits) == (Kind.CALL_MISSING, [2]), verdict.text()
    assert ("rank 2's thread 'loader' raised ValueError: bad shard index in work() (cell 5 line 4): the thread ended there, "
            "before its call") in verdict.summary, verdict.text()
    assert "rank 2: finished the cell; its thread 'loader' raised ValueError" in verdict.text()
    assert verdict.explained  # no "--paths" hint under it
    # Raised in another function than the call's: said as likely, beside the verdict.
    elsewhere = dict(error, func="prefetch")
    other = judge([*positions[:2], Position(2, "finished", threads=[elsewhere])], log_of(per_rank))
    assert "likely the thread that was to make the call" in other.summary, other.text()
