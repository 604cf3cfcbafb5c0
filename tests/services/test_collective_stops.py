"""The console's stops before collectives, without processes: the ranks' next collectives compared
(analysis/next_calls.py), ranks chosen by mesh coordinates (services/mesh_ranks.py) and the new
console commands (nc, c all, attach dp=0)."""

from __future__ import annotations

from typing import Any

import pytest

from distnb.analysis.reports.meshes import MeshReport
from distnb.analysis.verdicts.next_calls import NextCall, compare_next
from distnb.config import LaunchConfig
from distnb.controller.prompts import Prompt
from distnb.controller.tracker import Tracker
from distnb.results import CellResult, RankResult
from distnb.services.debugger import Debugger, parse_command
from distnb.services.mesh_ranks import mesh_ranks


def call(rank: int, op: str = "all_reduce", group: str = "0", *, label: str = "group 0", role: str = "group 0",
         members: tuple[int, ...] | None = (0, 1, 2, 3), args: dict[str, Any] | None = None, sizes: tuple[tuple[int, ...], ...] = ((4,),),
         inside: bool = False, line: int = 5) -> NextCall:
    kept = {"op": "SUM"} if args is None and op == "all_reduce" else args or {}
    return NextCall(rank, op, group, label, role, members, tuple(sorted(kept.items())), sizes if op != "barrier" else (),
                    ("Float",) if op != "barrier" else (), f"cell 7 line {line}", inside)


def test_a_rank_about_to_call_another_op_is_named_against_the_majority_before_it_hangs() -> None:
    calls = {0: call(0), 1: call(1, "barrier", line=3), 2: call(2), 3: call(3)}
    report = compare_next(calls)
    assert report.problems == ["rank 1 is about to call barrier where ranks 0,2,3 call all_reduce [4] f32 on group 0: continuing would hang."]
    text = report.text()
    assert "  rank 0  all_reduce [4] f32 on group 0  at cell 7 line 5" in text
    assert "  rank 1  barrier on group 0  at cell 7 line 3" in text


def test_matching_collectives_say_so_and_what_comes_next() -> None:
    report = compare_next({r: call(r) for r in range(4)})
    assert report.ok and report.headline.startswith("they match: ranks 0-3 are about to call all_reduce [4] f32 on group 0.")
    assert "c all issues it everywhere" in report.text()


def test_arguments_shapes_and_dtypes_that_must_agree() -> None:
    src = compare_next({0: call(0, "broadcast", args={"src": 0}), 1: call(1, "broadcast", args={"src": 1}), 2: call(2, "broadcast", args={"src": 0})})
    assert src.problems == ["rank 1 is about to call broadcast [4] f32 src=1 where ranks 0,2 call broadcast [4] f32 src=0 on group 0: "
                            "they disagree on src: continuing would hang or give wrong results."]
    shape = compare_next({0: call(0), 1: call(1, sizes=((3,),)), 2: call(2)})
    assert shape.problems[0].endswith("their input shapes differ: continuing would fail or hang.")
    # A rank already inside the collective may not know its arguments: compared by op alone, no false alarm.
    inside = compare_next({0: call(0), 1: NextCall(1, "all_reduce", "0", "group 0", "group 0", (0, 1), None, (), (), "", True)})
    assert inside.ok, inside.problems


def test_a_member_that_will_never_come_and_one_that_was_released() -> None:
    calls = {0: call(0, members=(0, 1, 2)), 2: call(2, members=(0, 1, 2))}
    gone = {1: "finished the cell without another collective"}
    report = compare_next(calls, gone)
    assert report.problems == ["ranks 0,2 would wait on group 0 for rank 1, which finished the cell without another collective: "
                               "continuing would hang."]
    assert "  rank 1  finished the cell without another collective" in report.text()
    released = compare_next(calls, {1: "quit its debugger (q)"}, released={1})
    assert released.problems == ["ranks 0,2 need rank 1 on group 0, which quit its debugger (q): rather than let them wait, distnb "
                                 "ends the cell there (interrupted, nothing issued)."]
    unknown = compare_next(calls, unknown={1: "is still running (not stopped before a collective)"})
    assert unknown.ok and unknown.notes == ["rank 1 is still running (not stopped before a collective): whether it joins all_reduce on "
                                            "group 0 is not known yet."]


def test_a_mesh_dimension_mixed_up_is_named_though_each_group_agrees() -> None:
    tp = [call(r, group=g, label=f"tp (ranks {m[0]},{m[1]})", role="tp", members=m) for r, g, m in ((0, "1", (0, 1)), (1, "1", (0, 1)), (2, "2", (2, 3)))]
    dp = call(3, group="4", label="dp (ranks 1,3)", role="dp", members=(1, 3))
    report = compare_next({c.rank: c for c in [*tp, dp]})
    assert report.problems == ["rank 3 is about to call all_reduce [4] f32 on dp (ranks 1,3) where ranks 0-2 call all_reduce [4] f32 on tp: "
                               "the ranks disagree on the group (a mesh dimension mixed up?), so continuing likely hangs."]
    # Ranks waiting for each other in two groups: a hang, said once.
    a = call(0, group="1", label="group 1 (ranks 0,1)", role="group 1", members=(0, 1))
    b = call(1, group="2", label="group 2 (ranks 0,1)", role="group 2", members=(0, 1))
    cross = compare_next({0: a, 1: b})
    assert len(cross.problems) == 1 and "each waits for the other, continuing would hang" in cross.problems[0]


def test_a_send_whose_partner_does_something_else() -> None:
    send = call(0, "send", args={"dst": 1}, members=None)
    recv_ok = call(1, "recv", args={"src": 0}, members=None)
    assert compare_next({0: send, 1: recv_ok}).ok
    other = call(1, members=(0, 1))
    assert compare_next({0: send, 1: other}).problems == [
        "rank 0 is about to send to rank 1, which is about to call all_reduce [4] f32 on group 0: they do not pair, continuing would hang."]


def test_above_a_handful_of_ranks_the_majority_leads_and_the_odd_ranks_are_named() -> None:
    calls = {r: call(r, members=tuple(range(12))) for r in range(12)}
    calls[5] = call(5, "barrier", members=tuple(range(12)), line=3)
    report = compare_next(calls)
    rows = report.text().splitlines()[1:3]
    assert rows[0].startswith("  ranks 0-4,6-11  all_reduce [4] f32 on group 0") and rows[1].startswith("  rank 5          barrier on group 0")
    assert report.problems == ["rank 5 is about to call barrier where ranks 0-4,6-11 call all_reduce [4] f32 on group 0: continuing would hang."]


MESH = {"device": "cpu", "shape": [2, 2], "names": ["dp", "tp"], "named": True, "layout": [0, 1, 2, 3], "coord": None, "groups": {}}


def test_ranks_by_mesh_coordinates_with_errors_that_name_the_dimensions() -> None:
    report = MeshReport({r: [MESH] for r in range(4)})
    assert mesh_ranks("dp=0", report, 4) == [0, 1]
    assert mesh_ranks("tp=1", report, 4) == [1, 3]
    assert mesh_ranks("dp=1,tp=0", report, 4) == [2]
    assert mesh_ranks("dp=0-1", report, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"no mesh has dimension pp: the mesh is \(dp=2, tp=2\) on cpu \(dimensions dp, tp\)"):
        mesh_ranks("pp=0", report, 4)
    with pytest.raises(ValueError, match="dp=2: dp has coordinates 0-1"):
        mesh_ranks("dp=2", report, 4)
    with pytest.raises(ValueError, match="write dimension=coordinate"):
        mesh_ranks("dp=", report, 4)
    with pytest.raises(ValueError, match="hold no device mesh.*attach 1,3"):
        mesh_ranks("dp=0", MeshReport({r: [] for r in range(4)}), 4)
    other = dict(MESH, layout=[0, 2, 1, 3])
    with pytest.raises(ValueError, match="different ranks in different meshes"):
        mesh_ranks("dp=0", MeshReport({r: [MESH, other] for r in range(4)}), 4)


@pytest.mark.parametrize(("line", "kind", "ranks", "text"), [
    ("nc", "next", None, "nc"),
    ("nc 1,3", "next", [1, 3], "nc"),
    ("next collective", "next", None, "nc"),
    ("next collective 0-1", "next", [0, 1], "nc"),
    ("ranks 2: nc", "next", [2], "nc"),
    ("ranks 2: next collective", "next", [2], "nc"),
    ("c all", "continue", None, "c"),
    ("continue  all", "continue", None, "c"),
    ("attach dp=0", "attach", [0, 1], ""),
    ("ranks tp=1: p x", "send", [1, 3], "p x"),
    ("detach dp=1,tp=1", "detach", [3], ""),
    ("n", "send", None, "n"),  # pdb's own next is untouched
])
def test_console_commands_for_collectives_and_meshes(line: str, kind: str, ranks: list[int] | None, text: str) -> None:
    report = MeshReport({r: [MESH] for r in range(4)})
    cmd = parse_command(line, 4, lambda spec: mesh_ranks(spec, report, 4))
    assert (cmd.kind, cmd.ranks, cmd.text) == (kind, ranks, text)


def test_mesh_coordinates_need_the_meshes_and_the_debugger_reads_them_once_per_cell() -> None:
    with pytest.raises(ValueError, match="need the pool's device meshes"):
        parse_command("attach dp=0", 4)
    asked: list[int] = []

    def meshes() -> MeshReport:
        asked.append(1)
        return MeshReport({r: [MESH] for r in range(4)})

    debugger = Debugger(Tracker(4), LaunchConfig(nproc=4, backend="gloo"), diagnose=lambda *a, **k: None, meshes=meshes)  # type: ignore[arg-type, return-value]
    cell = CellResult(cell=3, code="", ranks=[0, 1, 2, 3], results={r: RankResult(r) for r in range(4)})
    assert debugger.select(cell, "dp=1") == [2, 3] and debugger.select(cell, "tp=0") == [0, 2]
    assert len(asked) == 1


def test_a_prompt_says_which_collective_it_is_paused_before() -> None:
    before = {"op": "all_reduce", "group": "0", "members": [0, 1], "args": {"op": "SUM"}, "why": "nc"}
    prompt = Prompt.of(1, {"id": 1, "cell": 7, "kind": "pdb", "prompt": "(Pdb before all_reduce) ", "output": "",
                           "where": {"file": "<cell-7>", "line": 5, "func": "<module>", "cell": 7, "code": "dist.all_reduce(t)",
                                     "context": [], "before": before}, "mode": "breakpoint"})
    assert prompt.before == before and prompt.place() == "cell 7 line 5 (dist.all_reduce(t))"
