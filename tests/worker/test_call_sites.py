"""Where a watched call came from when a function an earlier cell defined makes it: the call's own
line (in that cell) and the cell that issued it, with the line of it that called the function —
the verdicts judge the call as the issuing cell's, and read an ``if`` on the rank at either line."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from distnb.wire.record_types import called_in
from distnb.worker.torch_hooks.call_log import CallLog


@pytest.fixture
def c10d(monkeypatch: pytest.MonkeyPatch) -> None:
    module = ModuleType("torch.distributed.distributed_c10d")
    module._world = SimpleNamespace(group_count=1, pg_names={}, default_pg=None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", module)


def _torch_side(log: CallLog) -> Any:
    return log.begin("all_reduce", None, {})  # as the wrapper around torch's function calls it


def via(log: CallLog) -> Any:
    return _torch_side(log)


def run_cells(log: CallLog, *cells: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"via": via, "log": log}
    for n, code in enumerate(cells, 1):
        exec(compile(code, f"<cell-{n}>", "exec"), ns)
    return ns


@pytest.mark.usefixtures("c10d")
@pytest.mark.parametrize("running", [True, False], ids=["the executor says", "the outermost cell frame says"])
def test_a_call_in_an_earlier_cells_function_is_issued_by_the_cell_that_called_it(running: bool) -> None:
    log = CallLog("<cell-", running=(lambda: 3) if running else None)
    ns = run_cells(log, "def step():\n    x = 1\n    return via(log)\n", "def outer():\n    return step()\n",
                   "y = 0\nif True:\n    rec = outer()\n")
    rec = ns["rec"]
    assert (rec["cell"], rec["line"], rec["func"]) == (1, 3, "step")  # the call's own line
    assert (rec.get("in_cell"), rec.get("in_line")) == (3, 3)  # the running cell's line that led there
    assert called_in(rec) == 3


@pytest.mark.usefixtures("c10d")
def test_a_call_in_the_running_cell_carries_no_second_site() -> None:
    log = CallLog("<cell-", running=lambda: 1)
    rec = run_cells(log, "z = 2\nrec = via(log)\n")["rec"]
    assert (rec["cell"], rec["line"]) == (1, 2) and "in_cell" not in rec and "in_line" not in rec and called_in(rec) == 1


@pytest.mark.usefixtures("c10d")
def test_a_thread_calling_after_its_cell_names_the_running_cell_without_a_line() -> None:
    # The executor's cell is another one now (the thread's function was defined in cell 1): issued
    # in the running cell, no line of it on this stack.
    log = CallLog("<cell-", running=lambda: 7)
    rec = run_cells(log, "def work():\n    return via(log)\nrec = work()\n")["rec"]
    assert (rec["cell"], rec["line"], rec.get("in_cell"), rec.get("in_line")) == (1, 2, 7, None)
