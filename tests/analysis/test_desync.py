"""Desync diagnosis as pure functions (no process): argument mismatches, point-to-point pairs,
group creation, multi-op steps, the victim of a gloo abort, stragglers and merged traces. The
end-to-end cases on real 4-rank pools are in test_desync_e2e.py."""

from __future__ import annotations

import json
import zlib

from distnb.analysis.agreement.group_creation import creation_mismatch
from distnb.analysis.agreement.steps import step_pattern, uneven_steps
from distnb.analysis.reports.profile import ProfileReport, RankTime, merge_traces
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.event_rules import victim
from distnb.analysis.verdicts.p2p import match_p2p
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.stragglers import StragglerReport, arrivals
from distnb.analysis.verdicts.verdict import Kind
from distnb.controller.collective_log import CollectiveLog
from distnb.worker.torch_hooks.call_log import CallLog


def _entry(rid: int, seq: int, name: str = "all_reduce", dtype: str = "Float", done: bool = True, t: float = 100.0, **args: object) -> dict:
    return {"id": rid, "group": "0", "desc": "default_pg", "seq": seq, "p2p": False, "op": name, "sizes": [[4]],
            "dtypes": [dtype], "t": t, "done": done, "cell": 1, **({"args": dict(args)} if args else {})}


def _log(per_rank: dict[int, list[dict]], calls: dict[int, list[dict]] | None = None) -> CollectiveLog:
    log = CollectiveLog()
    for r, entries in per_rank.items():
        log.merge(r, {"entries": entries, "groups": {"0": sorted(per_rank)}, "calls": (calls or {}).get(r, [])})
    return log


def _p2p(rank: int, op: str, peer: int | None, tag: int = 0) -> Position:
    key = "dst" if op == "send" else "src"
    return Position(rank, "collective", op=op, since=5.0, peers=[{"op": op, "args": {key: peer, "tag": tag}}])


# -- arguments at the same position ---------------------------------------------------------------
def test_a_different_src_is_named_with_the_odd_rank() -> None:
    log = _log({0: [_entry(0, 1, "broadcast", src=0)], 1: [_entry(0, 1, "broadcast", src=0)],
                2: [_entry(0, 1, "broadcast", src=1, done=False)], 3: [_entry(0, 1, "broadcast", src=0)]})
    [div] = log.report([0, 1, 2, 3]).divergences()
    assert div.kind == "args" and div.odd() == [2]
    assert "different arguments: ranks 0,1,3 broadcast [4] f32 src=0; rank 2 broadcast [4] f32 src=1 (the odd one out: rank 2)" \
        in div.text([0, 1, 2, 3])


def test_a_different_reduce_op_diverges_but_sum_is_not_spelled_out() -> None:
    log = _log({0: [_entry(0, 1, op="SUM")], 1: [_entry(0, 1, op="MAX")], 2: [_entry(0, 1, op="SUM")]})
    [div] = log.report([0, 1, 2]).divergences()
    assert div.kind == "args" and div.odd() == [1] and "all_reduce [4] f32 op=MAX" in div.text([0, 1, 2])
    assert "op=SUM" not in div.text([0, 1, 2])
    assert "✗ all_reduce [4] f32 op=MAX" in log.report([0, 1, 2]).text()  # the odd entry flagged in the table


def test_waiting_ranks_with_different_roots_are_an_argument_mismatch() -> None:
    positions = [Position(r, "collective", op="broadcast", seq=1, group="0", since=5.0, sizes=[[4]], dtypes=["Float"],
                          args={"src": 1 if r == 2 else 0}) for r in range(4)]
    d = diagnose(positions, 3.0, 5.0)
    assert d.state == "hang" and d.culprits == [2] and "different src" in d.summary, d.summary


# -- point-to-point ----------------------------------------------------------------------------------
def test_recv_from_the_wrong_peer_blames_the_receiver() -> None:
    found = match_p2p([_p2p(0, "send", 1), _p2p(1, "recv", 2), Position(2, "finished"), Position(3, "finished")])
    assert found.culprits == [1] and found.matched == []
    assert "rank 1 waits to receive from rank 2, which finished the cell, while rank 0 sends to rank 1" in found.sentences[0]
    assert len(found.sentences) == 1, found.sentences  # rank 0's send is the same story


def test_send_to_the_wrong_peer_blames_the_sender() -> None:
    found = match_p2p([_p2p(0, "send", 2), _p2p(1, "recv", 0), Position(2, "finished")])
    assert found.culprits == [0] and "rank 0's send most likely names the wrong peer (dst=2)" in found.sentences[0]


def test_tags_that_differ_and_pairs_that_match() -> None:
    found = match_p2p([_p2p(0, "send", 1, tag=1), _p2p(1, "recv", 0, tag=2)])
    assert found.culprits == [0, 1] and "the tags must match" in found.sentences[0]
    ok = match_p2p([_p2p(0, "send", 1), _p2p(1, "recv", None), _p2p(2, "send", 3), _p2p(3, "recv", 2)])
    assert ok.sentences == [] and sorted(ok.matched) == [(0, 1), (2, 3)]


def test_matched_pairs_in_progress_are_not_a_hang() -> None:
    d = diagnose([_p2p(0, "send", 1), _p2p(1, "recv", 0), Position(2, "finished")], 3.0, 5.0)
    assert d.state == "slow" and "every open call has its partner" in d.summary, d.summary


def test_a_rank_caught_between_two_entries_is_no_different_call() -> None:
    positions = [Position(r, "collective", op="all_reduce", seq=69, group="0", since=0.0) for r in (0, 1, 3)]
    positions.insert(2, Position(2, "collective", op="all_reduce", since=2.0))
    assert diagnose(positions, 1.0, 2.0).state != "hang"


def test_diagnose_prefers_pairs_to_collective_blame() -> None:
    d = diagnose([_p2p(0, "send", 1), _p2p(1, "recv", 2), Position(2, "finished"), Position(3, "finished")], 3.0, 5.0)
    assert d.state == "hang" and d.culprits == [1] and d.summary.startswith("point-to-point calls without a partner"), d.summary
    assert "rank 1: receiving from rank 2" in d.text()


# -- group creation ----------------------------------------------------------------------------------
def _creation(n: int, count: int, ranks: list[int], line: int, end: int | None = 1) -> dict:
    return {"n": n, "op": "new_group", "group": "0", "args": {"ranks": ranks}, "t": 0, "end": end, "cell": 3, "line": line,
            "func": "<module>", "count": count}


def test_a_skipped_new_group_names_the_rank_out_of_step() -> None:
    calls = {r: [_creation(1, 1, [0, 1], 1), _creation(2, 2, [2, 3], 2, None)] for r in (0, 1, 3)}
    calls[2] = [_creation(1, 1, [2, 3], 2, None)]
    log = _log({r: [] for r in range(4)}, calls)
    found = creation_mismatch(log, [0, 1, 2, 3])
    assert found is not None and found.count == 1 and found.odd == [2]
    assert "ranks 0,1,3 called new_group([0, 1]) (cell 3 line 1); rank 2 called new_group([2, 3]) (cell 3 line 2)" in found.text()
    positions = [Position(r, "collective", op="new_group", since=5.0) for r in range(4)]
    d = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2, 3]))
    assert d.state == "hang" and d.culprits == [2] and "group creation out of step" in d.summary


def test_members_in_another_order_are_the_same_group() -> None:
    calls = {0: [_creation(1, 1, [0, 1], 1)], 1: [_creation(1, 1, [1, 0], 1)]}
    assert creation_mismatch(_log({0: [], 1: []}, calls), [0, 1]) is None


def test_a_rank_still_computing_is_not_yet_out_of_step() -> None:
    calls = {r: [_creation(1, 1, [0, 1], 1, None)] for r in (0, 1, 3)}
    log = _log({r: [] for r in range(4)}, calls)
    assert creation_mismatch(log, [0, 1, 2, 3], moving={2}) is None
    assert creation_mismatch(log, [0, 1, 2, 3]) is not None  # finished without it: out of step


def test_every_rank_stuck_in_the_same_new_group_is_a_hang_not_slow() -> None:
    d = diagnose([Position(r, "collective", op="new_group", line=2, since=9.0) for r in range(3)], 3.0, 9.0)
    assert d.state == "hang" and "new_group" in d.summary and "slow but consistent" not in d.summary


# -- steps ---------------------------------------------------------------------------------------------
def test_step_patterns() -> None:
    assert step_pattern(["ag", "rs"] * 3 + ["ag"]) == ["ag", "rs"]
    assert step_pattern(["ar"] * 4) == ["ar"]
    assert step_pattern(["ag", "rs", "bc"]) is None
    assert uneven_steps(["ag", "ag", "rs"] * 4 + ["ag"], ["ag", "ag", "rs"] * 4) == (["ag", "ag", "rs"], 5, 4)
    assert uneven_steps(["ar"] * 5, ["ar"] * 4) == (["ar"], 5, 4)
    assert uneven_steps(["ag", "rs"] * 3, ["ag", "rs", "ag"]) is None  # not at a step boundary
    # A broadcast before the loop: the steps are counted after it.
    assert uneven_steps(["bc"] + ["ag", "rs"] * 3 + ["ag"], ["bc"] + ["ag", "rs"] * 3) == (["ag", "rs"], 4, 3)


def test_an_fsdp_loop_one_step_short_is_an_uneven_loop() -> None:
    ops = ["all_gather", "reduce_scatter"]
    ahead = [_entry(i, i + 1, ops[i % 2], done=i < 8) for i in range(9)]
    behind = [_entry(i, i + 1, ops[i % 2]) for i in range(8)]
    log = _log({0: ahead, 1: ahead, 2: behind})
    positions = [Position(r, "collective", op="all_gather", seq=9, group="0", since=5.0) for r in (0, 1)] + [Position(2, "finished")]
    d = diagnose(positions, 3.0, 5.0, log.report([0, 1, 2]))
    assert d.summary.startswith("uneven loop: rank 2 ran 4 steps of (all_gather [4] f32, reduce_scatter [4] f32)"), d.summary
    assert "ranks 0,1 ran 5" in d.summary and d.kind == Kind.LOOP_COUNT and d.culprits == [2], d.summary
    assert d.culprits == [2]


# -- the victim of an abort ----------------------------------------------------------------------------
def test_a_rank_aborted_inside_a_mismatch_is_a_victim() -> None:
    log = _log({0: [_entry(0, 1, done=False)], 1: [], 2: [_entry(0, 1, dtype="Double", done=False)], 3: [_entry(0, 1, done=False)]})
    log.died_in[1] = "all_reduce"  # its stack at death: inside all_reduce, its entry never arrived
    report = log.report([0, 1, 2, 3])
    [div] = report.divergences()
    assert div.kind == "dtype" and "rank 1 died inside it" in div.text([0, 1, 2, 3])
    found = victim(Position(1, "dead", detail="aborted (SIGABRT)"), report)
    assert found is not None and found.odd == [2] and found.root.ranks == (2,), found
    assert "rank 1 is a victim" in found.text() and "Root cause: rank 2" in found.text()
    positions = [Position(0, "collective", op="all_reduce", seq=1, group="0", since=5.0), Position(1, "dead", detail="aborted"),
                 Position(2, "collective", op="all_reduce", seq=1, group="0", since=5.0),
                 Position(3, "collective", op="all_reduce", seq=1, group="0", since=5.0)]
    assert diagnose(positions, 3.0, 5.0, report, first_death=1).culprits == [2]


# -- lines from earlier cells ---------------------------------------------------------------------------
def test_a_line_in_a_function_of_an_earlier_cell_says_which() -> None:
    p = Position(0, "collective", op="all_reduce", seq=3, line=2, line_cell=4, func="train_step", running=7, code="dist.all_reduce(g)")
    assert p.collective() == "all_reduce #3 in train_step() (cell 4 line 2)"
    assert Position(0, "computing", line=5, line_cell=4, func="<module>", running=7).at() == " at cell 4 line 5"
    assert Position(0, "computing", line=5, line_cell=7, func="<module>", running=7).at() == " at cell line 5"


# -- stragglers -----------------------------------------------------------------------------------------
def test_a_rank_that_arrives_last_is_the_straggler_with_figures() -> None:
    entries = {r: [_entry(i, i + 1, t=100.0 + i * 0.1 + (0.04 if r == 3 else 0.001 * r)) for i in range(20)] for r in range(4)}
    log = _log(entries)
    report = StragglerReport("0", [0, 1, 2, 3], arrivals(log, "0", [0, 1, 2, 3], 200))
    assert report.straggler() == 3 and report.last_share()[3] == 1.0
    assert abs(report.lateness(3) - 0.04) < 1e-6
    assert report.summary().startswith("rank 3 arrives last at 100% of the last 20 all_reduces on group 0, 40 ms after the first")
    assert "ranks 0-2 spend" in report.summary() and "rank  arrives last" in report.text()
    even = _log({r: [_entry(i, i + 1, t=100.0 + i * 0.1 + 0.0001 * ((r + i) % 4)) for i in range(20)] for r in range(4)})
    assert StragglerReport("0", [0, 1, 2, 3], arrivals(even, "0", [0, 1, 2, 3])).straggler() is None


# -- profiles -------------------------------------------------------------------------------------------
def test_merged_trace_has_a_row_per_rank_on_one_clock(tmp_path) -> None:
    def trace(base_s: int, ts: float) -> bytes:
        events = [{"ph": "M", "name": "process_name", "pid": 99, "tid": 0, "args": {"name": "python"}},
                  {"ph": "X", "name": "aten::mm", "pid": 99, "tid": 1, "ts": ts, "dur": 5.0}]
        return zlib.compress(json.dumps({"baseTimeNanoseconds": base_s * 10**9, "traceEvents": events}).encode())

    # Rank 1's clock runs 2 s ahead of ours: its event at its 1002 s + 10 µs is our 1000 s + 10 µs.
    path = merge_traces({0: trace(1000, 10.0), 1: trace(1002, 10.0)}, {0: 0.0, 1: 2.0}, str(tmp_path / "t" / "m.json"))
    data = json.load(open(path))
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    ts = {e["pid"]: e["ts"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert abs(ts[0] - ts[1]) < 1e-6


def test_profile_report_words_and_flags() -> None:
    ops = {r: [{"name": "aten::mm", "count": 4, "self_s": 0.050 if r == 1 else 0.010, "total_s": 0.05, "device_s": 0.0}] for r in (0, 1)}
    report = ProfileReport(3, [RankTime(0, 0.10, 0.08, 0.07), RankTime(1, 0.10, 0.02, 0.0)], ops, "/x/cell-3.json")
    text = report.text()
    assert "rank 1 computes longest" in text and "◀ differs: rank 1 50.0 ms" in text and "/x/cell-3.json" in text
    assert abs(report.times[0].compute - 0.02) < 1e-9


# -- the rank's call log ----------------------------------------------------------------------------------
def test_call_records_give_entries_their_arguments_by_time() -> None:
    log = CallLog("<cell-")
    rec = log.begin("broadcast", None, {"src": 1, "group_src": None})
    rec["group"] = "0"  # no torch.distributed here: the group is named by hand
    log.end(rec)
    before = {"group": "0"}
    inside = {"group": "0"}
    log.annotate([before, inside], [rec["t"] - 10, rec["t"] + 1])
    assert "args" not in before and inside["args"] == {"src": 1}
    assert [c["op"] for c in log.since(-1)] == ["broadcast"] and log.since(rec["n"]) == []


# -- the same number of calls, other ones -----------------------------------------------------------
def test_as_many_collectives_with_another_reduce_op_is_a_desync_of_calls() -> None:
    from distnb.analysis.agreement.desync import count_mismatches, mismatch_text

    same = {"seqs": {"0": 5}, "created": 1, "digests": {"0": 111}}
    odd = {"seqs": {"0": 5}, "created": 1, "digests": {"0": 222}}
    [m] = count_mismatches({0: same, 1: same, 2: odd, 3: same})
    assert m.group == "0" and m.calls == {0: 0, 1: 0, 2: 1, 3: 0}
    assert mismatch_text(m).startswith("ranks 0,1,3 against rank 2 made as many collectives on group 0 but not the same ones")
    assert count_mismatches({0: same, 1: same}) == []  # digests agree: nothing to say


def test_the_call_log_digest_tells_a_reduce_op_and_a_shape_apart() -> None:
    import torch

    from distnb.worker.torch_hooks.call_log import CallLog

    def digest(*calls: tuple[str, dict, object]) -> int:
        log = CallLog("<cell-")
        for fn, args, inputs in calls:
            log.begin(fn, None, args, inputs)
        return log.digests["?"]  # no process group in this process: its name reads "?"

    base = digest(("all_reduce", {"op": "SUM"}, torch.ones(4)))
    assert base == digest(("all_reduce", {"op": "SUM"}, torch.zeros(4)))  # values are not the call
    assert base != digest(("all_reduce", {"op": "MAX"}, torch.ones(4)))
    assert base != digest(("all_reduce", {"op": "SUM"}, torch.ones(5)))
    assert base != digest(("all_reduce", {"op": "SUM"}, torch.ones(4, dtype=torch.float64)))
    # all_to_all's split sizes differ across ranks by design: not part of the digest.
    a = digest(("all_to_all_single", {"input_split_sizes": [1, 3]}, torch.ones(4)))
    assert a == digest(("all_to_all_single", {"input_split_sizes": [2, 2]}, torch.ones(4)))
