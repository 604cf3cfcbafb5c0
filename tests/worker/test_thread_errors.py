"""A rank's other threads' uncaught exceptions, kept for the verdict (worker/recorders/thread_errors.py):
the thread, the error and its innermost notebook line; Python's own report still printed; never a
SystemExit, never the main thread's; a bounded number between two cells."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest

from distnb.wire.cell_code import CELL_PREFIX, cell_filename
from distnb.worker.recorders.thread_errors import ThreadErrors


@pytest.fixture
def kept() -> Iterator[Callable[[], tuple[ThreadErrors, list[Any]]]]:
    """Installs the hook when the test body calls it: pytest before 9 sets its own
    threading.excepthook around each test's call, over any a fixture installed."""
    before = threading.excepthook

    def install() -> tuple[ThreadErrors, list[Any]]:
        printed: list[Any] = []
        threading.excepthook = printed.append  # stands for the hook installed before distnb's (it prints)
        errors = ThreadErrors(CELL_PREFIX, lambda: 7)
        errors.install()
        return errors, printed

    try:
        yield install
    finally:
        threading.excepthook = before


def _run_in_thread(code: str, name: str = "loader") -> None:
    ns: dict[str, Any] = {}
    exec(compile(code, cell_filename(3), "exec"), ns)
    thread = threading.Thread(target=ns["work"], name=name)
    thread.start()
    thread.join(10)


def test_a_thread_that_raises_is_kept_with_its_cell_line_and_still_printed(kept) -> None:
    errors, printed = kept()
    _run_in_thread("def work():\n    x = 1\n    raise ValueError('bad shard index ' + 'x' * 1000)\n")
    [error] = errors.peek()
    assert (error["thread"], error["ename"], error["cell"], error["line"], error["func"], error["during"]) == \
        ("loader", "ValueError", 3, 3, "work", 7)
    assert error["evalue"].startswith("bad shard index x") and len(error["evalue"]) == 300
    assert len(printed) == 1 and printed[0].exc_type is ValueError, "the previous hook no longer reports it"
    assert errors.take() == [error] and errors.take() == []


def test_system_exit_is_not_an_error_and_the_count_is_bounded(kept) -> None:
    errors, printed = kept()
    _run_in_thread("import sys\ndef work():\n    sys.exit(0)\n")
    assert errors.peek() == []
    for i in range(20):
        _run_in_thread("def work():\n    raise KeyError(1)\n", name=f"t{i}")
    assert len(errors.take()) == 16 and len(printed) == 21


def test_an_error_outside_the_notebook_is_kept_without_a_line(kept) -> None:
    errors, _ = kept()
    thread = threading.Thread(target=lambda: 1 / 0, name="bg")
    thread.start()
    thread.join(10)
    [error] = errors.take()
    assert (error["ename"], error["cell"], error["line"], error["func"]) == ("ZeroDivisionError", None, None, "")


def test_distnbs_own_threads_are_not_the_programs(kept) -> None:
    errors, printed = kept()
    thread = threading.Thread(target=lambda: 1 / 0, name="distnb-peek")
    thread.start()
    thread.join(10)
    assert errors.take() == [] and len(printed) == 1
