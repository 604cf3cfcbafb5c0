"""RankDebug's bookkeeping through its seam (the requests table): ranks whose debugpy numbers
threads, frames and variables alike, as real ones do, answered by a scripted debugpy per rank.
The real thing runs in tests/e2e/test_rank_debug.py and test_debug_panel_protocol.py."""

from __future__ import annotations

from typing import Any

from distnb.services.rank_debug import FIRST_ID, RankDebug
from distnb.states import RankState
from distnb.status import RankStatus


class ScriptedRanks:
    """Stands in for Requests.ask: each DAP request is answered at once, as each rank's debugpy
    would, with the same local ids on every rank (1 for the thread, 2 the frame, 4 and 5 the scopes)."""

    def __init__(self) -> None:
        self.debug: RankDebug | None = None
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.lines: dict[int, int] = {}  # rank → the line its frame stands at (default 4)

    def ask(self, identity: Any, ranks: list[int], msg: dict[str, Any], timeout: float, partial: bool = False) -> dict[int, dict[str, Any]]:
        assert self.debug is not None
        for rank in ranks:
            for req in msg["msgs"]:
                self.sent.append((rank, req))
                body = {
                    "stackTrace": {"stackFrames": [{"id": 2, "name": "<module>", "line": self.lines.get(rank, 4), "source": {"path": "/p.py"}}]},
                    "threads": {"threads": [{"id": 1, "name": "MainThread"}]},
                    "scopes": {"scopes": [{"name": "Locals", "variablesReference": 4}, {"name": "Globals", "variablesReference": 5}]},
                    "variables": {"variables": [{"name": "x", "value": str(rank), "variablesReference": 0}]},
                }.get(req["command"], {})
                self.debug.deliver(rank, [{"type": "response", "request_seq": req["seq"], "success": True, "command": req["command"],
                                           "body": body}])
        return {r: {"ok": True} for r in ranks}


def _debug() -> tuple[RankDebug, ScriptedRanks, list[dict[str, Any]]]:
    ranks = ScriptedRanks()
    statuses = [RankStatus(rank=r, state=RankState.RUNNING, pid=100 + r, host="h", device="cpu") for r in (0, 1)]
    debug = RankDebug(ranks, lambda: statuses)  # type: ignore[arg-type]
    ranks.debug = debug
    events: list[dict[str, Any]] = []
    debug.on_event = events.append
    assert debug.attach({"/p.py": [{"line": 4}]}) == ""
    return debug, ranks, events


def _stop(debug: RankDebug, rank: int) -> None:
    debug.deliver(rank, [{"type": "event", "event": "stopped", "body": {"reason": "breakpoint", "threadId": 1, "allThreadsStopped": True}}])


def _go(debug: RankDebug, rank: int) -> None:
    debug.deliver(rank, [{"type": "event", "event": "continued", "body": {"threadId": 1, "allThreadsContinued": True}}])


def test_attach_gives_every_rank_the_panels_breakpoints() -> None:
    _, ranks, _ = _debug()
    for rank in (0, 1):
        commands = [req["command"] for r, req in ranks.sent if r == rank]
        assert commands == ["initialize", "attach", "configurationDone", "setBreakpoints"]


def test_each_ranks_ids_are_the_panels_own_and_map_back() -> None:
    debug, _, events = _debug()
    _stop(debug, 0)
    _stop(debug, 1)
    threads = [e["body"]["threadId"] for e in events]
    assert len(set(threads)) == 2 and min(threads) >= FIRST_ID  # both ranks call their thread 1
    assert [debug.owner(t)[:2] for t in threads] == [(0, "thread"), (1, "thread")]  # type: ignore[index]
    frames = debug.stack()
    assert [f["name"] for f in frames] == ["rank 0 · MainThread · <module>", "rank 1 · MainThread · <module>"]
    assert frames[0]["id"] != frames[1]["id"] and all(debug.owner(f["id"])[2] == 2 for f in frames)  # type: ignore[index]
    assert debug.threads() == [{"id": threads[0], "name": "rank 0 · MainThread"}, {"id": threads[1], "name": "rank 1 · MainThread"}]
    scopes = debug.forward(1, {"seq": 9, "command": "scopes", "arguments": {"frameId": frames[1]["id"]}})
    refs = [s["variablesReference"] for s in scopes["body"]["scopes"]]
    assert all(debug.owner(ref) == (1, "ref", local) for ref, local in zip(refs, (4, 5)))
    assert scopes["request_seq"] == 9


def test_commands_go_to_the_selected_rank_and_the_panel_keeps_the_others_in_view() -> None:
    debug, ranks, events = _debug()
    _stop(debug, 0)
    _stop(debug, 1)
    frames = debug.stack()
    debug.forward(1, {"seq": 1, "command": "scopes", "arguments": {"frameId": frames[1]["id"]}})  # the user clicks rank 1
    ranks.sent.clear()
    assert debug.step("continue", events[0]["body"]["threadId"])["success"]  # the panel names rank 0's thread
    assert [(r, req["command"]) for r, req in ranks.sent] == [(1, "continue")]
    _go(debug, 1)
    assert events[-1]["event"] == "stopped" and debug.owner(events[-1]["body"]["threadId"])[0] == 0  # type: ignore[index]
    assert "rank 0 still paused" in events[-1]["body"]["description"]
    assert [f["name"] for f in debug.stack()] == ["rank 0 · MainThread · <module>"]
    assert debug.owner(frames[1]["id"]) is None  # rank 1 moved on: its frames are gone
    ranks.sent.clear()
    assert debug.step("continue", None)["success"]  # rank 1 is no longer paused: the first paused one
    assert [(r, req["command"]) for r, req in ranks.sent] == [(0, "continue")]
    _go(debug, 0)
    assert events[-1]["event"] == "continued" and not debug.paused()
    assert debug.step("next")["message"] == "no rank is paused"


def test_turning_the_panel_off_clears_the_breakpoints_and_releases_paused_ranks() -> None:
    debug, ranks, _ = _debug()
    _stop(debug, 1)
    ranks.sent.clear()
    debug.detach()
    assert sorted((r, req["command"], str(req["arguments"].get("breakpoints"))) for r, req in ranks.sent) == [
        (0, "setBreakpoints", "[]"), (1, "continue", "None"), (1, "setBreakpoints", "[]")]


def test_a_restarted_rank_is_attached_again() -> None:
    ranks = ScriptedRanks()
    statuses = [RankStatus(rank=0, state=RankState.IDLE, pid=100, host="h", device="cpu")]
    debug = RankDebug(ranks, lambda: statuses)  # type: ignore[arg-type]
    ranks.debug = debug
    assert debug.attach() == "" and debug.attached == [0]
    ranks.sent.clear()
    assert debug.attach() == "" and not ranks.sent  # the same process: nothing to do
    statuses[0] = RankStatus(rank=0, state=RankState.IDLE, pid=200, host="h", device="cpu")
    assert debug.attach() == ""
    assert [req["command"] for _, req in ranks.sent] == ["initialize", "attach", "configurationDone"]


def test_above_a_handful_of_ranks_alike_stacks_share_an_entry_the_odd_rank_named_and_a_step_on_it_steps_them_all() -> None:
    ranks = ScriptedRanks()
    ranks.lines[9] = 7  # rank 9 stopped elsewhere
    statuses = [RankStatus(rank=r, state=RankState.RUNNING, pid=100 + r, host="h", device="cpu") for r in range(10)]
    debug = RankDebug(ranks, lambda: statuses)  # type: ignore[arg-type]
    ranks.debug = debug
    assert debug.attach() == ""
    for r in range(10):
        _stop(debug, r)
    frames = debug.stack()
    assert [(f["name"], f["line"]) for f in frames] == [("ranks 0-8 · MainThread · <module>", 4), ("rank 9 · MainThread · <module>", 7)]
    debug.forward(0, {"seq": 1, "command": "scopes", "arguments": {"frameId": frames[0]["id"]}})  # the user clicks the shared entry
    ranks.sent.clear()
    assert debug.step("next")["success"]
    assert sorted(r for r, req in ranks.sent if req["command"] == "next") == list(range(9))  # not rank 9
    debug.forward(9, {"seq": 2, "command": "scopes", "arguments": {"frameId": frames[1]["id"]}})
    ranks.sent.clear()
    assert debug.step("continue")["success"]
    assert [(r, req["command"]) for r, req in ranks.sent] == [(9, "continue")]
