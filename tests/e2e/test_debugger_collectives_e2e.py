"""Stepping that knows collectives, on real gloo pools driven through the console: ``nc`` stops
every paused rank just before its next collective and shows them side by side (a desync is seen
before it hangs), ``c all``, ranks chosen by mesh coordinates, ``q`` that never leaves the other
ranks waiting for the rank that left, and ``--pdb`` holding the other ranks at their next collective.

Bounds come from the product's own constants (ESCALATE_AFTER: an interrupt's wait in gloo is
unblocked after it; NEXT_SETTLE: how long the console waits for ranks to stop), with margin."""

from __future__ import annotations

import time
from pathlib import Path

from test_debugger_e2e import Console, run

import distnb
from distnb.services.debugger import NEXT_SETTLE
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

from conftest import MARK_INSIDE

#: From a release to the cell's end on every rank: the escalation's delay, then the shutdown of
#: the gloo wait and the messages back (milliseconds; seconds of margin for a loaded machine).
RELEASE_BOUND = ESCALATE_AFTER + 10.0
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
ALL = [0, 1, 2, 3]  # every rank at the first prompt together


def test_nc_shows_a_desync_before_it_hangs(pool: distnb.Pool) -> None:
    code = "t = torch.ones(4)\nbreakpoint()\nnc_x = rank\nif rank == 1:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)\nt"
    con = Console("nc", "attach 1", "ranks all: q")
    result = run(pool, code, con, asking=ALL)
    cell = result.cell
    shown = con.after(0)
    assert f"[rank 1]\n> <cell-{cell}>(5)<module>()\n-> dist.barrier()" in shown
    assert f"ranks 0,2,3 are paused before all_reduce (nothing issued yet) at cell {cell} line 7 (dist.all_reduce(t))" in shown
    assert f"rank 1 is paused before barrier (nothing issued yet) at cell {cell} line 5 (dist.barrier())" in shown
    assert f"  rank 1  barrier on group 0  at cell {cell} line 5 (dist.barrier())" in shown
    assert f"  rank 2  all_reduce [4] f32 on group 0  at cell {cell} line 7 (dist.all_reduce(t))" in shown
    assert "[distnb] rank 1 is about to call barrier where ranks 0,2,3 call all_reduce [4] f32 on group 0: continuing would hang." in shown
    assert con.prompts == ["[ranks 0-3] (Pdb) ", "[ranks 0-3] (Pdb) ", "[rank 1] (Pdb before barrier) "]
    # Quitting everywhere there: nothing was issued, so nothing is out of step and the group needs no rebuilding.
    assert all(result[r].error["ename"] == "BdbQuit" for r in range(4)), result.text()
    assert "desync" not in result.text() and not any("fresh default process group" in n for n in result.notes)
    assert pool.run(ALL_REDUCE).values == {r: "4.0" for r in range(4)}


def test_nc_steps_from_collective_to_collective_and_says_when_the_cell_has_no_more(pool: distnb.Pool) -> None:
    code = ("t = torch.ones(1) * (rank + 1)\nbreakpoint()\ndist.all_reduce(t)\nu = torch.zeros(1) + rank\n"
            "dist.broadcast(u, src=2)\n(t.item(), u.item())")
    con = Console("nc", "p t.item()", "nc", "nc")
    result = run(pool, code, con, asking=ALL)
    assert result.ok and result.values == {r: "(10.0, 2.0)" for r in range(4)}, result.text()
    assert "[distnb] they match: ranks 0-3 are about to call all_reduce [1] f32 on group 0." in con.after(0)
    assert con.prompts[1] == "[ranks 0-3] (Pdb before all_reduce) "
    assert all(f"[rank {r}] {r + 1.0}" in con.after(1) for r in range(4))  # paused before it: not reduced yet
    assert "[distnb] they match: ranks 0-3 are about to call broadcast [1] f32 src=2 on group 0." in con.after(2)
    assert "[distnb] ranks 0-3 finished the cell without another collective." in con.after(3)


def test_quitting_one_rank_stops_the_others_before_a_collective_that_needs_it(pool: distnb.Pool) -> None:
    con = Console("ranks 1: q", "c all")
    result = run(pool, "t = torch.ones(1)\nbreakpoint()\ndist.all_reduce(t)\nt.item()", con, asking=ALL)
    assert con.prompts == ["[ranks 0-3] (Pdb) ", "[ranks 0,2,3] (Pdb) "]
    assert ("[distnb] rank 1 leaves the cell (quit from the debugger (q)): ranks 0,2,3 will stop before any collective that "
            "needs it rather than wait") in con.text
    assert result[1].error["ename"] == "BdbQuit", result.text()
    assert [result[r].status for r in (0, 2, 3)] == ["interrupted"] * 3, result.text()
    for r in (0, 2, 3):
        assert "stopped before all_reduce on group 0 rather than wait for rank 1, which left this cell" in result[r].stderr
    assert not any("fresh default process group" in n for n in result.notes)  # nothing was issued: nothing to rebuild
    assert pool.run(ALL_REDUCE).values == {r: "4.0" for r in range(4)}


def test_pdb_holds_the_other_ranks_before_their_next_collective(pool: distnb.Pool, tmp_path: Path) -> None:
    """Rank 2 raises once rank 3 is inside the all_reduce (its file); ranks 0 and 1 are still
    computing and reach it only once held (they wait for the hold, so no timing decides the test)."""
    assert pool.run(MARK_INSIDE).ok
    ready = str(tmp_path / "ready")
    code = (f"import os, time\nt = torch.ones(2)\nif rank == 2:\n    while not os.path.exists({ready!r}) and time.monotonic() < {time.monotonic() + 120}:\n"
            "        time.sleep(0.01)\n"
            "    time.sleep(0.5)\n    1 / 0\n"
            "from distnb.worker.torch_hooks.call_log import STOPS\n"
            "for _ in range(600 if rank in (0, 1) else 0):\n    if STOPS.hold:\n        break\n    time.sleep(0.05)\n"
            f"if rank == 3:\n    dbg_mark_inside({ready!r})\n"
            "dist.all_reduce(t)\nt")
    con = Console("ranks 0,1: p rank", "c all")
    started = time.monotonic()
    result = run(pool, code, con, pdb=True)
    cell = result.cell
    text = con.text
    assert ("[distnb] rank 2 raised and is in post-mortem: holding ranks 0,1 before their next collective, so the pool is "
            "inspected at one point (nothing issued there); rank 3 was already inside all_reduce: it waits there.") in text
    assert f"ranks 0,1 are held before all_reduce (nothing issued yet) at cell {cell} line 15 (dist.all_reduce(t))" in text
    assert f"rank 2 is in post-mortem at cell {cell} line 7 (1 / 0)" in text
    assert f"  rank 3  all_reduce [2] f32 on group 0 (already waiting in it)  at cell {cell} line 15 (dist.all_reduce(t))" in text
    assert ("ranks 0,1,3 need rank 2 on group 0, which raised (in post-mortem: it calls no other collective in this cell): rather "
            "than let them wait, distnb ends the cell there (interrupted, nothing issued).") in text
    assert "[rank 0] 0" in con.after(0) and "[rank 1] 1" in con.after(0)  # the held ranks' namespaces, inspected
    assert "rank 3 was waiting for it in all_reduce: interrupting it now" in text and "ranks 0,1 will stop before any collective" in text
    assert result[2].error["ename"] == "ZeroDivisionError", result.text()
    assert [result[r].status for r in (0, 1, 3)] == ["interrupted"] * 3, result.text()
    assert time.monotonic() - started < 0.5 + 2 * NEXT_SETTLE + RELEASE_BOUND + 30  # far from --pg-timeout (30 min)
    assert any("fresh default process group" in n for n in result.notes), result.text()  # rank 3's gloo wait was cut
    assert pool.run(ALL_REDUCE).values == {r: "4.0" for r in range(4)}


def test_ranks_chosen_by_mesh_coordinates_and_a_mesh_dimension_mixed_up(pool: distnb.Pool) -> None:
    made = pool.run("from torch.distributed.device_mesh import init_device_mesh\n"
                    "dbg_mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('row', 'col'))", timeout=120)
    assert made.ok, made.text()
    code = "t = torch.ones(2)\nbreakpoint()\ng = dbg_mesh.get_group('col' if rank != 3 else 'row')\ndist.all_reduce(t, group=g)"
    con = Console("attach row=0", "p rank", "ranks col=1: p rank", "attach pp=0", "attach all", "nc", "ranks all: q")
    result = run(pool, code, con, asking=ALL)
    assert "commands go to ranks 0,1." in con.after(0) and con.prompts[2] == "[ranks 0,1] (Pdb) "
    assert "[rank 0] 0" in con.after(1) and "[rank 1] 1" in con.after(1)
    assert "[rank 1] 1" in con.after(2) and "[rank 3] 3" in con.after(2) and "rank 0" not in con.after(2)
    assert "[distnb] no mesh has dimension pp:" in con.after(3) and "(row=2, col=2) on cpu" in con.after(3)
    assert ("rank 3 is about to call all_reduce [2] f32 on row (ranks 1,3) where ranks 0-2 call all_reduce [2] f32 on col: "
            "the ranks disagree on the group (a mesh dimension mixed up?), so continuing likely hangs.") in con.after(5)
    assert all(result[r].error["ename"] == "BdbQuit" for r in range(4)), result.text()
