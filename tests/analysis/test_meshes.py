"""Meshes and groups from messages: groups named as built, collectives paired across groups and
across cells, majority across a role, causes quoting the cell's code, stragglers against noise."""

from __future__ import annotations

from typing import Any

from distnb.analysis.agreement.cell_source import because
from distnb.analysis.agreement.groups import GroupInfo, short_name
from distnb.analysis.agreement.pairing import cross_cell, cross_group
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.event_rules import victim
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.stragglers import Arrival, StragglerReport, arrivals
from distnb.controller.collective_log import CollectiveLog

# A (dp=2, tp=2) mesh as torch 2.13 builds it on gloo: dp groups "1" (0,2) and "2" (1,3), tp groups
# "3" (0,1) and "4" (2,3), described mesh_dp / mesh_tp (seen on CPU and, with hashed names, on NCCL).
MESH_GROUPS = {"0": [0, 1, 2, 3], "1": [0, 2], "2": [1, 3], "3": [0, 1], "4": [2, 3]}
DESC = {"0": "default_pg", "1": "mesh_dp", "2": "mesh_dp", "3": "mesh_tp", "4": "mesh_tp"}
DP = {0: "1", 1: "2", 2: "1", 3: "2"}
TP = {0: "3", 1: "3", 2: "4", 3: "4"}


def _e(rid: int, group: str, seq: int, op: str = "all_gather", cell: int = 2, done: bool = True, sizes: Any = None,
       line: int | None = None, t: float = 0.0) -> dict[str, Any]:
    e = {"id": rid, "group": group, "desc": DESC.get(group, "undefined"), "seq": seq, "p2p": False, "op": op,
         "sizes": sizes or [[4]], "dtypes": ["Float"], "t": t, "done": done, "cell": cell}
    if line is not None:
        e.update(line=line, call_cell=cell, func="<module>")
    return e


def _mesh_log(per_rank: dict[int, list[dict[str, Any]]]) -> CollectiveLog:
    log = CollectiveLog()
    for r in range(4):
        log.merge(r, {"entries": per_rank.get(r, []), "groups": MESH_GROUPS, "now": 0.0})
    return log


def test_groups_read_as_built() -> None:
    assert GroupInfo("2", "mesh_dp", (1, 3)).label() == "dp (ranks 1,3)"
    assert GroupInfo("0", "default_pg", (0, 1, 2, 3)).label() == "group 0"
    assert GroupInfo("5", "undefined", (0, 1), (2, 3)).label() == "group 5 (ranks 0,1), from new_group at cell 2 line 3"
    assert GroupInfo("5", "undefined", (0, 1), (2, 3)).role() == GroupInfo("6", "undefined", (2, 3), (2, 3)).role()
    assert GroupInfo("1", "mesh_dp").role() == GroupInfo("2", "mesh_dp").role() != GroupInfo("3", "mesh_tp").role()
    # NCCL names split groups by a hash of their members: cut like a commit id.
    assert short_name("4314d7ee2124be4609c7b955eb07bdf5e29f70ab") == "4314d7ee" and short_name("12") == "12"


def test_the_log_learns_descriptions_and_new_group_sites() -> None:
    log = CollectiveLog()
    log.merge(0, {"entries": [_e(0, "3", 1)], "groups": {"3": [0, 1], "5": [0, 1]}, "now": 0.0,
                  "calls": [{"n": 1, "op": "new_group", "group": "0", "args": {"ranks": [0, 1]}, "t": 0, "end": 1,
                             "cell": 4, "line": 2, "func": "<module>", "count": 5, "made": "5"}]})
    assert log.group("3").label() == "tp (ranks 0,1)"
    assert log.group("5").label() == "group 5 (ranks 0,1), from new_group at cell 4 line 2"
    assert log.at(_e(0, "3", 1)) == "#1 on tp (ranks 0,1)"


def test_a_rank_on_the_wrong_mesh_dimension_is_named_not_the_ranks_that_completed() -> None:
    # Cell 1 reduced over dp then tp on every rank; in cell 2 rank 1 all_gathers over dp, the others over tp.
    per_rank = {r: [_e(0, DP[r], 1, "all_reduce", cell=1), _e(1, TP[r], 1, "all_reduce", cell=1)] for r in range(4)}
    for r in range(4):
        group = DP[r] if r == 1 else TP[r]
        seq = 2
        done = r in (2, 3)  # tp (2,3) happened to match; rank 0 waits for 1 on tp, rank 1 for 3 on dp
        per_rank[r].append(_e(2, group, seq, cell=2, done=done))
    log = _mesh_log(per_rank)
    crossed = cross_group(log, [0, 1, 2, 3], 2)
    assert crossed is not None and crossed.odd == [1] and crossed.index == 1
    text = crossed.text()
    assert text.startswith("collective on another group: rank 1 called all_gather over dp (ranks 1,3) where ranks 0,2,3 used tp"), text
    assert "Ranks 2,3 completed theirs" in text and "rank 0 waits on tp (ranks 0,1) for rank 1" in text
    assert "rank 1 waits on dp (ranks 1,3) for rank 3" in text and text.endswith("Root cause: rank 1, on the wrong group.")
    positions = [Position(0, "collective", op="all_gather", seq=2, group="3", since=5.0, running=2),
                 Position(1, "collective", op="all_gather", seq=2, group="2", since=5.0, running=2),
                 Position(2, "finished"), Position(3, "finished")]
    d = diagnose(positions, 1.0, 5.0, log.report([0, 1, 2, 3]))
    assert d.summary == text and d.culprits == [1]
    assert "finished the cell without entering" not in d.text() and "never" not in d.summary
    # %dist_collectives leads with the same words, not "rank 3 never did".
    assert log.report([0, 1, 2, 3]).text().startswith(f"first divergence: {text}")


def test_the_majority_is_one_side_whatever_name_its_entries_carry() -> None:
    # Rank 0's entry from the call log (the function's name), the others' from the recorder: one side.
    per_rank = {r: [_e(0, DP[r], 1, "all_reduce", cell=1), _e(1, TP[r], 1, "all_reduce", cell=1)] for r in range(4)}
    for r in range(4):
        per_rank[r].append(_e(2, DP[r] if r == 1 else TP[r], 2, "all_gather_single" if r == 0 else "all_gather", cell=2, done=r in (2, 3)))
    crossed = cross_group(_mesh_log(per_rank), [0, 1, 2, 3], 2)
    assert crossed is not None and crossed.odd == [1], crossed
    assert "where ranks 0,2,3 used tp" in crossed.text(), crossed.text()


def test_a_two_against_two_split_has_no_majority() -> None:
    per_rank = {r: [_e(0, DP[r] if r in (1, 3) else TP[r], 1, cell=2, done=False)] for r in range(4)}
    crossed = cross_group(_mesh_log(per_rank), [0, 1, 2, 3], 2)
    assert crossed is not None and crossed.odd == [0, 1, 2, 3]
    assert "no majority to tell which side is wrong" in crossed.text() and "Root cause" not in crossed.text()


def test_same_roles_in_step_are_no_cross_group_finding() -> None:
    per_rank = {r: [_e(0, DP[r], 1, cell=2), _e(1, TP[r], 1, cell=2)] for r in range(4)}
    assert cross_group(_mesh_log(per_rank), [0, 1, 2, 3], 2) is None


def test_a_one_against_one_shape_split_is_judged_by_the_other_groups_of_its_role() -> None:
    # FSDP2 over dp with rank 2's parameter another shape: inside dp (0,2) it is 1 against 1; ranks
    # 1,3 on the other dp group side with rank 0.
    sizes = {0: [[36]], 1: [[36]], 2: [[52]], 3: [[36]]}
    per_rank = {r: [_e(0, DP[r], 1, sizes=sizes[r], done=r in (1, 3))] for r in range(4)}
    report = _mesh_log(per_rank).report([0, 1, 2, 3])
    [div] = report.divergences()
    assert div.group == "1" and div.odd() == [2], report.text()
    assert "the odd one out: rank 2; ranks 1,3 had all_gather [36] f32 at #1 on the other groups of this role" in report.text()

    # Seen in CI: the aborted rank's entry came from the call log (the function's name), the others'
    # from the recorder's. all_gather_single and all_gather are one collective: the shape is the difference.
    per_rank[0] = [_e(0, DP[0], 1, op="all_gather_single", sizes=sizes[0], done=False)]
    report = _mesh_log(per_rank).report([0, 1, 2, 3])
    [div] = report.divergences()
    assert div.kind == "shape" and div.odd() == [2], report.text()
    assert "different shapes" in report.text() and "(the odd one out: rank 2;" in report.text()


def test_a_victim_of_gloos_abort_leads_to_the_odd_rank_even_when_it_died_before_its_entry_came() -> None:
    sizes = {1: [[36]], 2: [[52]], 3: [[36]]}
    per_rank = {r: [_e(0, DP[r], 1, sizes=sizes[r], done=r in (1, 3))] for r in (1, 2, 3)}
    log = _mesh_log(per_rank)
    log.died_in[0] = "all_gather_single"  # the function its dying stack named: the same collective
    dead = Position(0, "dead", detail="aborted (SIGABRT)")
    found = victim(dead, log.report([0, 1, 2, 3]))
    assert found is not None and found.odd == [2], found
    assert "rank 0 died (aborted (SIGABRT)) inside all_gather #1 on dp (ranks 0,2), a shape mismatch" in found.text()
    assert "Root cause: rank 2" in found.text() and "ranks 1,3 had all_gather [36] f32" in found.text()
    # Once the cell is over, the diagnosis says the same (no rank waits any more).
    d = diagnose([dead, Position(1, "finished"), Position(2, "failed", detail="RuntimeError: Connection reset"), Position(3, "finished")],
                 1.0, 5.0, log.report([0, 1, 2, 3]), first_death=0)
    assert d.state == "failed" and d.culprits == [2]


def test_an_async_call_left_pending_is_paired_with_the_next_cells_call() -> None:
    log = CollectiveLog()
    log.merge(0, {"entries": [_e(0, "0", 1, "all_reduce", cell=3, sizes=[[4]], line=3),
                              _e(1, "0", 2, "all_reduce", cell=4, done=False, sizes=[[6]], line=2)], "groups": {"0": [0, 1, 2, 3]}, "now": 0.0})
    for r in (1, 2, 3):
        log.merge(r, {"entries": [_e(0, "0", 1, "all_reduce", cell=4, done=True, sizes=[[6]], line=2)], "groups": {"0": [0, 1, 2, 3]}, "now": 0.0})
    paired = cross_cell(log, [0, 1, 2, 3], 4)
    assert paired is not None and paired.seq == 1 and paired.odd == [0]
    text = paired.text()
    assert "rank 0's all_reduce [4] f32 from cell 3, line 3 with ranks 1-3's all_reduce [6] f32 from cell 4, line 2" in text, text
    assert "the results on ranks 1-3 are wrong" in text and "Root cause: rank 0's call from an earlier cell" in text
    d = diagnose([Position(0, "collective", op="all_reduce", seq=2, group="0", since=5.0, running=4),
                  *(Position(r, "finished") for r in (1, 2, 3))], 1.0, 5.0, log.report([0, 1, 2, 3]))
    assert d.summary == text and d.culprits == [0]
    # In step by cell: nothing to say.
    assert cross_cell(log, [1, 2, 3], 4) is None


def test_causes_quote_the_cells_code() -> None:
    code = ("x = torch.ones(2)\nif rank == 0:\n    w = dist.all_reduce(x, async_op=True)\n"
            "for step in range(n):\n    if step % k == 0:\n        dist.all_reduce(x)\n")
    assert because(code, 3, 5) == ("the call at cell 5 line 3 is under `if rank == 0:` (cell 5 line 2): a collective only some ranks reach")
    loop = because(code, 6, 5)
    assert "inside `for step in range(n):` (cell 5 line 4): likely" in loop and "distnb counts calls, not iterations" in loop
    assert because(code, 1, 5) == "" and because("def (:", 1) == "" and because(None, 3) == ""
    assert "under `if dist.get_rank() > 0:`" in because("if dist.get_rank() > 0:\n    dist.barrier()\n", 2)


def _arrivals(late: float, step: float, noise: float, n: int = 20) -> list[Arrival]:
    return [Arrival("0", i, "all_reduce", {0: i * step, 1: i * step + noise, 2: i * step + noise / 2, 3: i * step + late}) for i in range(n)]


def test_a_straggler_is_late_relative_to_the_step_and_the_others_noise() -> None:
    # 40 ms late at steps of 100 ms, the others within 1 ms: a straggler.
    report = StragglerReport("0", [0, 1, 2, 3], _arrivals(0.040, 0.100, 0.001))
    assert report.straggler() == 3
    assert "40 ms after the first on median, 40% of a step of 100 ms, the others within 1.0 ms of each other" in report.summary()
    # 3 ms late at steps of 300 ms: last every time, and nobody waits for it to speak of.
    quiet = StragglerReport("0", [0, 1, 2, 3], _arrivals(0.003, 0.300, 0.0005))
    assert quiet.candidate() == 3 and quiet.straggler() is None
    assert quiet.summary().startswith("no straggler on group 0: rank 3 arrives last at 100%") and "within the noise" in quiet.summary()
    # 10 ms late when the others already spread by 8 ms among themselves: noise.
    assert StragglerReport("0", [0, 1, 2, 3], _arrivals(0.010, 0.050, 0.008)).straggler() is None


def test_on_nccl_a_groups_first_collective_is_known_from_the_call_before_its_recorder_entry() -> None:
    # NCCL connects a group's communicator inside its first collective: ranks 0,1 wait in the call
    # with no recorder entry yet. Their watched calls and the groups' descriptions still tell the story.
    log = CollectiveLog()
    descs = {"1": "mesh_dp", "2": "mesh_dp", "3": "mesh_tp", "4": "mesh_tp"}
    for r in range(4):
        group = DP[r] if r == 1 else TP[r]
        entries = [_e(0, group, 1, cell=2, done=True)] if r in (2, 3) else []
        calls = [{"n": 1, "op": "all_gather", "group": group, "args": {}, "t": 5 * 10**9, "end": None if r in (0, 1) else 6 * 10**9,
                  "cell": 2, "line": 3, "func": "<module>"}]
        log.merge(r, {"entries": entries, "groups": MESH_GROUPS, "descs": descs, "now": 0.0, "calls": calls})
    crossed = cross_group(log, [0, 1, 2, 3], 2)
    assert crossed is not None and crossed.odd == [1], crossed
    assert crossed.text().startswith("collective on another group: rank 1 called all_gather over dp (ranks 1,3) where ranks 0,2,3 used tp")
    assert crossed.waits_for == {0: [1], 1: [3]}


def test_recorded_on_an_h200_the_wrong_mesh_dimension_on_nccl() -> None:
    # The controller's log as it stood 4 s into the hang on 4 NCCL ranks sharing one H200: every
    # rank's recorder called its all_gather "completed" while ranks 0,1 still sat in the call
    # (connecting the group's communicator); their stacks say they are in it.
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent.parent / "data" / "nccl_wrong_mesh_dim_h200.json").read_text())
    log = CollectiveLog()
    for r, entries in data["entries"].items():
        log.merge(int(r), {"entries": entries, "groups": data["groups"], "descs": data["descs"], "now": 0.0,
                           "calls": data["calls"].get(r, [])})
    cell = data["cell"]
    tp01 = next(e["group"] for e in data["entries"]["0"])
    dp13 = next(e["group"] for e in data["entries"]["1"])
    positions = [Position(0, "collective", op="all_gather", group=tp01, since=4.0, running=cell),
                 Position(1, "collective", op="all_gather", group=dp13, since=4.0, running=cell),
                 Position(2, "finished"), Position(3, "finished")]
    d = diagnose(positions, 1.0, 4.0, log.report([0, 1, 2, 3]))
    assert d.summary.startswith("collective on another group: rank 1 called all_gather over dp (ranks 1,3) where ranks 0,2,3 used tp"), d.text()
    assert "rank 0 waits on tp (ranks 0,1) for rank 1" in d.summary and "Ranks 2,3 completed theirs" in d.summary
    assert d.culprits == [1]


def test_mesh_report_names_the_rank_whose_mesh_differs_and_scales_to_many_ranks() -> None:
    from distnb.analysis.reports.meshes import MeshReport, dim_groups, nested

    def mesh(rank: int, names: tuple[str, str] = ("dp", "tp"), shape: tuple[int, int] = (2, 2)) -> dict[str, Any]:
        layout = list(range(shape[0] * shape[1]))
        coord = [rank // shape[1], rank % shape[1]]
        groups = {n: {"name": str(i + 1), "ranks": g} for i, n in enumerate(names)
                  for g in dim_groups(list(shape), layout, i) if rank in g}
        return {"device": "cpu", "shape": list(shape), "names": list(names), "named": True, "layout": layout, "coord": coord, "groups": groups}

    assert dim_groups([2, 2], [0, 1, 2, 3], 0) == [[0, 2], [1, 3]] and dim_groups([2, 2], [0, 1, 2, 3], 1) == [[0, 1], [2, 3]]
    assert nested([2, 3], list(range(6))) == [[0, 1, 2], [3, 4, 5]]
    report = MeshReport({0: [mesh(0)], 1: [mesh(1)], 2: [mesh(2)], 3: [mesh(3, ("dp", "tq"))]}, counts={0: {"dp": 2, "tp": 5}})
    assert report.odd() == [3]
    text = report.text()
    assert "mesh 1: (dp=2, tp=2) on cpu, ranks laid out [[0, 1], [2, 3]] — as ranks 0-2 built it" in text
    assert "✗ rank 3 built (dp=2, tq=2) on cpu where the others built (dp=2, tp=2) on cpu" in text
    assert "     0  (0,0)     ranks 0,2        ranks 0,1        2 · 5" in text
    # Above a handful of ranks: no row per rank; the counts by majority and the outliers.
    big = MeshReport({r: [mesh(r, shape=(4, 4))] for r in range(16)}, counts={r: {"dp": 3, "tp": 5 if r != 9 else 4} for r in range(16)})
    big_text = big.text()
    assert "collectives over tp: ranks 0-8,10-15 5, rank 9 4" in big_text and "  rank  coords" not in big_text
    assert MeshReport({0: [], 1: []}).text().startswith("no device mesh on ranks 0,1")


def test_comms_report_merges_ranks_per_module_and_dimension() -> None:
    from distnb.analysis.reports.comms import CommsReport

    def rec(module: str, op: str, group: str, desc: str, nbytes: int, bw: bool = False) -> dict[str, Any]:
        return {"module": module, "bw": bw, "op": op, "group": group, "desc": desc, "bytes": nbytes}

    usual = [rec("model.0", "all_gather_into_tensor", "1", "mesh_dp", 288), rec("model.2", "all_reduce", "3", "mesh_tp", 128),
             rec("model.0", "reduce_scatter_tensor", "1", "mesh_dp", 576, bw=True)]
    moves = [{"module": "model.2", "bw": False, "src": "P(sum)", "dst": "R", "shape": [4, 8], "dims": ["tp"]}]
    per_rank = {r: {"records": list(usual), "redistributes": list(moves)} for r in range(4)}
    per_rank[2]["records"] = usual + [rec("model.2", "all_reduce", "3", "mesh_tp", 128)]  # one call more on rank 2
    per_rank[3] = None  # did not finish
    report = CommsReport.of(7, per_rank)
    text = report.text()
    assert text.startswith("communication of cell 7 on ranks 0-2")
    assert report.odd_ranks() == [2]
    assert "✗ rank 2: model.2 fwd all_reduce over tp: 2 calls, 256 B where the others made 1 call, 128 B" in text
    assert "per dimension: dp 2 calls 864 B · tp 1 call 128 B" in text
    assert "model.2 fwd: P(sum) → R of [4, 8] over (tp) ×1" in text
    assert "rank 3: no accounting came back" in text
    assert CommsReport.of(1, {0: {"error": "this torch has no CommDebugMode"}}).text().endswith("rank 0: this torch has no CommDebugMode")


def test_a_number_the_ranks_reached_in_different_calls_is_not_an_arrival() -> None:
    """#2 is an all_reduce on rank 0 and a barrier on rank 1 (a mismatch): not one collective whose
    arrivals say who is slow."""
    log = CollectiveLog()
    for r, ops in ((0, ["all_reduce", "all_reduce", "all_reduce"]), (1, ["all_reduce", "barrier", "all_reduce"])):
        es = [{"id": i, "group": "0", "seq": i + 1, "p2p": False, "op": op, "t": float(i) + 0.1 * r, "done": True, "cell": 3}
              for i, op in enumerate(ops)]
        log.merge(r, {"entries": es, "groups": {"0": [0, 1]}, "descs": {}, "calls": [], "now": 0.0})
    assert [a.seq for a in arrivals(log, "0", [0, 1])] == [1, 3]
