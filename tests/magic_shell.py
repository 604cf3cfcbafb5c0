"""A real IPython shell with distnb's magics loaded, capturing what they print: shared by the
magics tests and the multi-node tests that drive ``%dist_launch --hosts`` (a helper beside
conftest.py, so either imports it whatever ran first)."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator

import pytest

import distnb
from distnb.jobs import pools


def process_shell() -> Any:
    """This test process's one IPython shell (IPython's own test shell): every test that drives
    magics in-process takes this one, whichever file a pytest-xdist worker ran first — IPython
    keeps one shell per process, and a second of another class cannot be made."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or get_ipython()


class Shell:
    """An InteractiveShell with distnb loaded; captures what the magics print."""

    def __init__(self) -> None:
        self.ip = process_shell()
        if "on_ranks" not in self.ip.magics_manager.magics["cell"]:
            self.ip.run_line_magic("load_ext", "distnb")

        self.pools: list[distnb.Pool] = []  # every pool these tests launched, for teardown
        self.stopped_pids: list[int] = []

    @contextlib.contextmanager
    def launched(self, args: str) -> Iterator[Shell]:
        """The magics over a pool ``%dist_launch ARGS`` starts for them; whatever the tests did
        (failed half-way, relaunched, unloaded the extension), every pool they started is shut
        down after, its PIDs kept in ``stopped_pids`` for the caller to check."""
        # A shared pool another module restarted last is "current" (start() makes it so): the magics
        # launch their own, which %dist_launch refuses while another is ready. The shared pool
        # stays tracked by its owner.
        pools.set_current(None)
        try:
            self.line("dist_launch", args)
            yield self
        finally:
            if "on_ranks" not in self.ip.magics_manager.magics["cell"]:
                self.ip.run_line_magic("load_ext", "distnb")
            self.stopped_pids = sorted({p for pool in self.pools for p in pool.pids()})
            for pool in self.pools:
                pool.shutdown()
            pools.set_current(None)

    def line(self, name: str, args: str = "") -> tuple[object, str, str]:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                value = self.ip.run_line_magic(name, args)
        finally:
            current = pools.current_or_none()
            if current is not None and current not in self.pools:
                self.pools.append(current)
        return value, out.getvalue(), err.getvalue()

    def cell(self, args: str, code: str) -> tuple[str, str]:
        out, err = io.StringIO(), io.StringIO()
        with self.as_cell(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self.ip.run_cell_magic("on_ranks", args, code)
        return out.getvalue(), err.getvalue()

    @contextlib.contextmanager
    def as_cell(self) -> Iterator[int]:
        """Run a magic as IPython runs a cell: numbered In[n] by the ExecutionResult it makes first
        (what distnb reads), the next cell the next In[n]. Yields the In[n]."""
        from IPython.core.interactiveshell import ExecutionResult

        result = ExecutionResult(None)
        result.execution_count = number = self.ip.execution_count
        self.ip.displayhook.exec_result = result
        try:
            yield number
        finally:
            self.ip.displayhook.exec_result = None
            self.ip.execution_count += 1

    def failing(self, name: str, args: str = "", code: str | None = None) -> tuple[str, str, distnb.CellFailed]:
        """Run a magic that must fail a cell (``%%name`` when ``code`` is given, else ``%name``): it
        prints its report, then raises CellFailed. Returns what it printed and the error."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(distnb.CellFailed) as failed:
            with self.as_cell():
                if code is None:
                    self.ip.run_line_magic(name, args)
                else:
                    self.ip.run_cell_magic(name, args, code)
        return out.getvalue(), err.getvalue(), failed.value
