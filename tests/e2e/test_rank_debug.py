"""The ranks' debugpy behind :class:`distnb.services.rank_debug.RankDebug` (what the debugger panel
drives), through the Python API: ranks on two nodes (one started by a node agent, as on another
machine), a breakpoint one rank reaches while the other waits for it in a collective, the pool's
diagnosis while it is paused, and the listening socket debugpy opened closed again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

import distnb
from distnb.services.rank_debug import ANSWER_TIMEOUT, ATTACH_TIMEOUT

from conftest import wait_until

pytestmark = pytest.mark.timeout(240)

#: The panel's file for a made-up cell (ipykernel's hash path); the body starts at its line 2.
PATH = "/tmp/ipykernel_0/4242.py"
BODY = ("import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "if dist.get_rank() == 0:\n"
        "    mark = 'rank 0 was here'\n"
        "dist.all_reduce(t)\n"
        "total = t.item()\n")


@pytest.fixture
def two_node_pool(fresh_pool: Callable[..., distnb.Pool]) -> distnb.Pool:
    # A fresh pool: debugpy, once started in a rank, stays there for the rank's life.
    return fresh_pool(nproc=1, nnodes=2, local_nodes=True, spares=False)


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (from /proc: its sockets' inodes in the LISTEN state)."""

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_paused_rank_is_not_a_hang_and_the_rank_waiting_for_it_is_named(two_node_pool: distnb.Pool, tmp_path: Path) -> None:
    pool = two_node_pool
    events: list[dict[str, Any]] = []
    pool.panel.on_event = events.append
    before = {s.rank: _listening_ports(s.pid) for s in pool.status().ranks if s.pid}
    assert pool.panel.attach({PATH: [{"line": 5}]}) == ""
    assert pool.panel.attached == [0, 1]
    after = {s.rank: _listening_ports(s.pid) for s in pool.status().ranks if s.pid}
    assert after == before, f"debugpy left a listening socket in a rank: {before} → {after}"

    result = pool.submit(BODY, source={"path": PATH, "line": 2})
    wait_until(lambda: pool.panel.paused().keys() == {0}, ATTACH_TIMEOUT, "rank 0 to stop at the panel's breakpoint")
    assert [e["body"]["description"] for e in events if e["event"] == "stopped"] == ["rank 0 breakpoint"]

    frames = pool.panel.stack()
    assert [(f["name"], f["line"], f["source"]["path"]) for f in frames] == [("rank 0 · MainThread · <module>", 5, PATH)]

    # Rank 1 reaches the all_reduce and waits there for rank 0, which the panel holds.
    def diagnosis() -> distnb.Verdict:
        return pool.diagnose(result, hang_after=0.0)

    wait_until(lambda: "waits for it" in diagnosis().text(), ANSWER_TIMEOUT * 3, "rank 1 to wait in the all_reduce")
    diag = diagnosis()
    assert diag.state == "paused", diag.text()
    assert "rank 0 is paused in the debugger panel" in diag.text() and "rank 1 waits for it in all_reduce" in diag.text(), diag.text()
    assert "continue in the debugger panel" in diag.text()

    scopes = pool.panel.forward(0, {"seq": 1, "command": "scopes", "arguments": {"frameId": frames[0]["id"]}})
    ref = scopes["body"]["scopes"][0]["variablesReference"]
    names = {v["name"]: v["value"] for v in pool.panel.forward(0, {"seq": 2, "command": "variables",
                                                                    "arguments": {"variablesReference": ref}})["body"]["variables"]}
    assert names["t"].startswith("tensor([1.])"), names

    assert pool.panel.step("next")["success"]  # one line: the panel's "next" on the selected rank
    wait_until(lambda: events[-1]["event"] == "stopped" and events[-1]["body"]["reason"] == "step", ANSWER_TIMEOUT,
               "rank 0 to stop after one step")
    assert pool.panel.stack()[0]["line"] == 6
    assert pool.panel.step("continue")["success"]
    done = pool.wait(result, timeout=ANSWER_TIMEOUT * 3)
    assert done.ok, done.text()
    assert pool.pull("total") == {0: 3.0, 1: 3.0}
    assert events[-1]["event"] == "continued"

    # The panel turned off: no breakpoint left, the cell runs through.
    pool.panel.detach()
    again = pool.wait(pool.submit(BODY, source={"path": PATH, "line": 2}), timeout=ANSWER_TIMEOUT * 3)
    assert again.ok and not pool.panel.paused(), again.text()

    # With no breakpoint the ranks run untraced; one set while a cell runs still stops that cell.
    go = str(tmp_path / "go")
    late = pool.submit(f"import os, time\nwhile not os.path.exists({go!r}):\n    time.sleep(0.01)\nlate_total = 0\nfor late_i in range(3):\n"
                       "    late_total += late_i\n", source={"path": "/tmp/ipykernel_0/55.py", "line": 2})
    wait_until(lambda: "time.sleep" in pool.stacks(all_threads=False).text(), ANSWER_TIMEOUT, "the cell to reach its wait")
    pool.panel.set_breakpoints("/tmp/ipykernel_0/55.py", [{"line": 6}])
    open(go, "w").close()  # the cell goes on once the breakpoint is set
    wait_until(lambda: pool.panel.paused().keys() == {0, 1}, ATTACH_TIMEOUT, "both ranks to stop at a breakpoint set mid-cell")
    assert {f["line"] for f in pool.panel.stack()} == {6}
    pool.panel.detach()
    assert pool.wait(late, timeout=ANSWER_TIMEOUT * 3).ok and pool.pull("late_total") == {0: 3, 1: 3}

    # Nobody at the panel: interrupting the cell ends it on ranks paused there too.
    pool.panel.set_breakpoints(PATH, [{"line": 5}])
    held = pool.submit(BODY, source={"path": PATH, "line": 2})
    wait_until(lambda: pool.panel.paused().keys() == {0}, ATTACH_TIMEOUT, "rank 0 to stop at the panel's breakpoint")
    pool.interrupt()
    stopped = pool.wait(held, timeout=ANSWER_TIMEOUT * 3)
    assert {res.status for res in stopped.results.values()} == {"interrupted"}, stopped.text()
    wait_until(lambda: not pool.panel.paused(), ANSWER_TIMEOUT, "the panel to hear that rank 0 is no longer held")
    assert "paused" not in pool.stacks().text()
    pool.panel.detach()
    assert pool.wait(pool.submit("dist.all_reduce(t)"), timeout=ANSWER_TIMEOUT * 3).ok  # the group still works

    # "Pause on exceptions": the rank whose cell raises stops at the raise, in the cell.
    pool.panel.set_exception_breakpoints({"filters": ["userUnhandled"]})
    raising = pool.submit("import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('odd rank')\n",
                          source={"path": "/tmp/ipykernel_0/77.py", "line": 2})
    wait_until(lambda: pool.panel.paused().keys() == {1}, ATTACH_TIMEOUT, "rank 1 to stop at its exception")
    assert events[-1]["body"]["reason"] == "exception", events[-1]
    [frame] = pool.panel.stack()
    assert frame["name"].startswith("rank 1 · MainThread · <module>") and frame["line"] == 4, frame  # (pydevd adds "(Current frame)")
    assert pool.panel.step("continue")["success"]
    failed = pool.wait(raising, timeout=ANSWER_TIMEOUT * 3)
    assert failed[0].status == "ok" and failed.failed == [1] and "ValueError: odd rank" in failed.text(), failed.text()


DESYNC = ("import torch, torch.distributed as dist\n"
          "t2 = torch.ones(4)\n"
          "if dist.get_rank() == 0:\n"
          "    dist.all_reduce(t2)\n"
          "else:\n"
          "    dist.barrier()\n")


def test_before_each_collective_the_panel_shows_a_desync_before_it_hangs(two_node_pool: distnb.Pool) -> None:
    pool = two_node_pool
    events: list[dict[str, Any]] = []
    pool.panel.on_event = events.append
    assert pool.panel.attach() == ""
    pool.panel.set_collective_stops(True)

    result = pool.submit(DESYNC, source={"path": "/tmp/ipykernel_0/99.py", "line": 2})
    wait_until(lambda: pool.panel.paused().keys() == {0, 1}, ATTACH_TIMEOUT, "both ranks to stop before their collective")
    assert sorted(e["body"]["description"] for e in events if e["event"] == "stopped") == ["rank 0 before all_reduce", "rank 1 before barrier"]
    names = {f["name"].split(" · ")[0]: (f["name"], f["line"]) for f in pool.panel.stack() if "before" in f["name"]}
    assert names == {"rank 0": ("rank 0 · MainThread · <module> · before all_reduce [4] f32 on group 0", 5),
                     "rank 1": ("rank 1 · MainThread · <module> · before barrier on group 0", 7)}, names
    verdict = pool.panel.verdict()
    assert "(nothing issued yet)" in verdict, verdict
    assert "on group 0, rank 0 calls all_reduce [4] f32; rank 1 calls barrier: continuing would hang." in verdict, verdict
    diag = pool.diagnose(result, hang_after=0.0)
    assert diag.state == "paused" and "paused in the debugger panel" in diag.text(), diag.text()

    # Nothing was issued: interrupting ends the cell at once, no collective to unblock.
    pool.interrupt()
    ended = pool.wait(result, timeout=ANSWER_TIMEOUT * 3)
    assert {r.status for r in ended.results.values()} == {"interrupted"}, ended.text()
    assert pool.collectives(refresh=True).text().count("barrier") == 0

    # Stops off: the same ranks call matching collectives straight through.
    pool.panel.set_collective_stops(False)
    same = pool.wait(pool.submit("dist.all_reduce(t2)\n", source={"path": "/tmp/ipykernel_0/98.py", "line": 2}), timeout=ANSWER_TIMEOUT * 3)
    assert same.ok and not pool.panel.paused(), same.text()
