"""The rank's stop before a collective, in this process: a watched call made from a cell's code
pauses pdb at the cell's line before the call is issued (``nc``, the console's hold), a call that
would wait for a rank that left raises instead, and the control thread's HOLD says where the main
thread is. The call wrapper is call_log's own, around a stand-in for the torch function."""

from __future__ import annotations

import bdb
import linecache
from collections.abc import Iterator
from typing import Any

import pytest

from distnb.wire.cell_code import cell_filename
from distnb.worker.process.debug import Hooks, Prompter, RankPdb, hold_request
from distnb.worker.torch_hooks import call_log
from distnb.worker.torch_hooks.call_log import STOPS, CallLog, LeftCell, needs


class Tensor:
    def __init__(self, *shape: int) -> None:
        self.shape, self.dtype = shape, "torch.float32"


def all_reduce(tensor: Any, op: Any = "SUM", group: Any = None, async_op: bool = False) -> None:
    issued.append(tensor)


issued: list[Any] = []


class Notebook:
    """The notebook's side of the prompter: the requests it got, and the lines it answers."""

    def __init__(self, *lines: str) -> None:
        self.lines, self.requests = list(lines), []  # type: list[str], list[dict[str, Any]]

    def send(self, request: dict[str, Any]) -> None:
        self.requests.append(request)

    def receive(self, request_id: int) -> Any:
        return {"t": "stdin_reply", "id": request_id, "text": self.lines.pop(0)}


@pytest.fixture
def cell() -> Iterator[tuple[Any, dict[str, Any]]]:
    """A cell's code calling the wrapped all_reduce, and the namespace it runs in; STOPS left clean."""
    log = CallLog("<cell-")
    source = "x = 42\nt = Tensor(4)\nreduce(t)\ny = x + 1\n"
    code = compile(source, cell_filename(9), "exec")
    linecache.cache[cell_filename(9)] = (len(source), None, source.splitlines(True), cell_filename(9))  # as the executor does
    ns = {"Tensor": Tensor, "reduce": call_log._wrap(log, "all_reduce", all_reduce)}
    issued.clear()
    yield code, ns
    STOPS.clear()
    STOPS.hook, STOPS.calling = None, None
    linecache.cache.pop(cell_filename(9), None)


def test_nc_pauses_at_the_cells_line_before_the_call_is_issued(cell: tuple[Any, dict[str, Any]]) -> None:
    code, ns = cell
    notebook = Notebook("p x", "p len(issued_now())", "c")
    hooks = Hooks(Prompter(notebook.send, notebook.receive, lambda: 9))
    STOPS.hook, STOPS.hold = hooks.before_collective, "nc"
    ns["issued_now"] = lambda: list(issued)
    try:
        exec(code, ns)
    finally:
        hooks.end_cell()
    first = notebook.requests[0]
    assert first["prompt"] == "(Pdb before all_reduce) " and first["where"]["line"] == 3 and first["where"]["code"] == "reduce(t)"
    assert first["where"]["before"] == {"op": "all_reduce", "group": "?", "members": None, "desc": None, "args": {"op": "SUM"},
                                        "sizes": [[4]], "dtypes": ["Float"], "cell": 9, "line": 3, "func": "<module>", "why": "nc"}
    assert "-> reduce(t)" in first["output"]
    assert notebook.requests[1]["output"] == "42\n" and notebook.requests[2]["output"] == "0\n"  # paused: nothing issued yet
    assert len(issued) == 1 and ns["y"] == 43 and STOPS.hold == "" and STOPS.calling is None


def test_quit_at_the_stop_raises_there_and_issues_nothing(cell: tuple[Any, dict[str, Any]]) -> None:
    code, ns = cell
    notebook = Notebook("q")
    hooks = Hooks(Prompter(notebook.send, notebook.receive, lambda: 9))
    STOPS.hook, STOPS.hold = hooks.before_collective, "nc"
    with pytest.raises(bdb.BdbQuit):
        exec(code, ns)
    hooks.end_cell()
    assert issued == [] and STOPS.calling is None


def test_a_call_that_needs_a_rank_that_left_raises_instead_of_waiting(cell: tuple[Any, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    code, ns = cell
    STOPS.gone, STOPS.why = frozenset({1}), "quit from the debugger (q)"
    with pytest.raises(LeftCell):
        exec(code, ns)
    assert issued == [] and STOPS.calling is None
    assert "stopped before all_reduce on group ? rather than wait for rank 1, which left this cell (quit from the debugger (q))" in capsys.readouterr().err
    # Whom a call needs: the group's members (unknown: assume it does), a send's peer, every rank for new_group.
    assert needs("send", None, {"dst": 2}, frozenset({1})) is False and needs("recv", None, {"src": 1}, frozenset({1})) is True
    assert needs("new_group", None, {"ranks": [0, 2]}, frozenset({1})) is True and needs("barrier", None, {}, frozenset({1})) is True


def test_hold_request_sets_the_stop_only_for_a_running_rank_of_that_cell() -> None:
    prompter = Prompter(lambda _: None, lambda _: {}, lambda: 5)  # type: ignore[arg-type, return-value]
    hooks = Hooks(prompter)
    try:
        assert hold_request(hooks, {"t": "hold", "id": "1", "cell": 4, "mode": "hold"}) == {"state": "finished"}
        assert STOPS.hold == ""
        assert hold_request(hooks, {"t": "hold", "id": "1", "cell": 5, "mode": "hold"}) == {"state": "running", "inside": ""}
        assert STOPS.hold == "hold"
        STOPS.calling = ("all_reduce", None, {"op": "SUM"})
        reply = hold_request(hooks, {"t": "hold", "id": "2", "cell": 5, "mode": "release", "ranks": [3], "why": "q"})
        assert reply == {"state": "inside", "inside": "all_reduce", "needs": True} and STOPS.gone == {3}
        prompter.paused = {"kind": "pdb"}
        STOPS.clear()
        assert hold_request(hooks, {"t": "hold", "id": "3", "cell": 5, "mode": "hold"})["state"] == "paused" and STOPS.hold == ""
    finally:
        STOPS.clear()
        STOPS.calling = None


def test_pdb_nc_arms_the_stop_or_says_why_it_cannot() -> None:
    debugger = RankPdb(Prompter(lambda _: None, lambda _: {}, lambda: 5))  # type: ignore[arg-type, return-value]
    debugger.reset()  # as at a prompt
    try:
        STOPS.watching = False
        assert debugger.do_nc("") is None and STOPS.hold == ""
        assert "nc needs distnb's call log, which DISTNB_CALL_LOG=0 turned off" in debugger.out.getvalue()
        STOPS.watching = True
        assert debugger.do_nc("") and STOPS.hold == "nc"
    finally:
        STOPS.clear()
        STOPS.watching = False
