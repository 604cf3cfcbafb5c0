"""Which lines of the notebook's own code a cell ran on this rank, how often, and where each
decision was first taken: the evidence for "why did this rank do something else".

Only the notebook's code objects (``<cell-N>`` files: the cell and functions defined in earlier
cells) are watched. What is kept is a table of *transitions* — line ``a`` followed by line ``b``
in the same frame — each with how often it happened, how many times ``a`` had run when it first
did (the iteration), and the line event number at that moment. Ranks run the same lines in the
same order until their first differing decision, so those event numbers are comparable across
ranks up to it: the earliest transition that ranks disagree on is that decision
(:mod:`distnb.analysis.verdicts.paths`).

How it watches, by Python version:

* 3.12 and newer: ``sys.monitoring`` LINE events enabled only on the notebook's code objects
  (``set_local_events``), so every other frame — torch's, the standard library's — runs at full
  speed. A PY_START callback finds the notebook's functions defined in earlier cells (or before
  recording began) the first time they run, and turns itself off (``DISABLE``) for every other
  code object at its first call: each of those costs one callback, once.
* 3.11 and older: ``sys.settrace`` with a global function that declines every frame but the
  notebook's. Each Python call still reaches it (a C-to-Python call), which is what costs on code
  that makes many small Python calls: ``benchmarks/bench_paths.py`` measures it.

A debugger (pdb, the notebook's own) or a coverage tool owns ``sys.settrace`` while it runs:
recording then steps aside for that cell and says so, rather than fight it.
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType
from typing import Any, Callable

__all__ = ["LEFT", "PathRecorder", "MONITORING", "record_paths"]

#: The "line" a frame goes to when it returns.
LEFT = -1
#: sys.monitoring exists (3.12+).
MONITORING = hasattr(sys, "monitoring")
#: Transitions kept per cell: a cell generating code on the fly must not grow a rank's reply without bound.
MAX_TRANSITIONS = 20_000


def record_paths(asked: bool | None) -> bool:
    """Record this cell's paths? As asked (``%%on_ranks --paths``); by default where it is cheap
    (3.12+), or everywhere with ``DISTNB_PATHS=1`` (``=0``: never by default)."""
    if asked is not None:
        return bool(asked)
    setting = os.environ.get("DISTNB_PATHS", "")
    return setting == "1" or (setting != "0" and MONITORING)


class PathRecorder:
    """Records the transitions of notebook code while a cell runs on the main thread."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._prefix_len = len(prefix)
        # (file, from line, to line) -> [count, count of the from line when first taken, event number]
        self.transitions: dict[tuple[str, int, int], list[int]] = {}
        self._lines: dict[tuple[str, int], int] = {}
        self._last: dict[Any, int] = {}  # frame (3.11) or code object (3.12+) -> its last line
        self._events = 0
        self.skipped = ""  # why this cell was not recorded
        self.on = False
        self._codes: set[CodeType] = set()  # the notebook's code objects seen so far (3.12+)
        self._tool: int | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, codes: list[CodeType] = ()) -> None:  # type: ignore[assignment]
        """Begin recording a cell; ``codes``: its code objects (functions inside them are found)."""
        self.transitions, self._lines, self._last, self._events, self.skipped = {}, {}, {}, 0, ""
        if MONITORING:
            self._start_monitoring(codes)
            return
        if sys.gettrace() is not None:
            self.skipped = "another tracer (a debugger or coverage) was active"
            return
        sys.settrace(self._global)
        self.on = True

    def stop(self) -> dict[str, Any] | None:
        """End recording; the cell's record (None when nothing was recorded)."""
        if self.on:
            if MONITORING:
                self._stop_monitoring()
            elif sys.gettrace() == self._global:  # bound methods are equal, never identical
                sys.settrace(None)
            self.on = False
        return self.snapshot()

    def snapshot(self) -> dict[str, Any] | None:
        """The record so far (the control thread reads it while a cell hangs)."""
        if self.skipped:
            return {"skipped": self.skipped}
        if not self.transitions:
            return None
        # dict.copy() is one step under the GIL: safe while the main thread adds to it.
        rows = [[f, a, b, *v] for (f, a, b), v in self.transitions.copy().items()]
        return {"transitions": rows, "events": self._events, "full": len(rows) >= MAX_TRANSITIONS}

    # -- the 3.11 tracer --------------------------------------------------------------------------
    def _global(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if frame.f_code.co_filename[: self._prefix_len] == self._prefix:
            return self._local
        return None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            self._line(frame.f_code.co_filename, frame, frame.f_lineno)
        elif event == "return":
            self._leave(frame.f_code.co_filename, frame)
        return self._local

    # -- the 3.12+ monitor ------------------------------------------------------------------------
    def _start_monitoring(self, codes: list[CodeType]) -> None:
        mon = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        if self._tool is None:
            for tool in (5, 4, 3):  # ids 0-2 and 5 are named for debuggers, coverage, profilers; 3 and 4 are free
                if mon.get_tool(tool) is None:
                    mon.use_tool_id(tool, "distnb paths")
                    mon.register_callback(tool, mon.events.LINE, self._on_line)
                    mon.register_callback(tool, mon.events.PY_RETURN, self._on_return)
                    mon.register_callback(tool, mon.events.PY_START, self._on_start)
                    self._tool = tool
                    break
            else:
                self.skipped = "every sys.monitoring tool id is taken"
                return
        for code in codes:
            self._add_code(code)
        events = mon.events.LINE | mon.events.PY_RETURN
        for code in self._codes:
            mon.set_local_events(self._tool, code, events)
        mon.set_events(self._tool, mon.events.PY_START)
        self.on = True

    def _add_code(self, code: CodeType) -> None:
        if code in self._codes or not code.co_filename.startswith(self._prefix):
            return
        self._codes.add(code)
        for const in code.co_consts:
            if isinstance(const, CodeType):
                self._add_code(const)

    def _stop_monitoring(self) -> None:
        # The tool id goes back between cells: ids are few (a debugger, coverage and a profiler
        # have theirs), and a recorder that is let go must not keep one.
        mon = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        mon.set_events(self._tool, 0)
        for code in self._codes:
            mon.set_local_events(self._tool, code, 0)
        mon.free_tool_id(self._tool)
        self._tool = None

    def _on_start(self, code: CodeType, offset: int) -> Any:
        """A function starts: the notebook's (defined in an earlier cell) is watched from now on;
        any other is never reported again (DISABLE: this code object's PY_START is switched off)."""
        mon = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        if not code.co_filename.startswith(self._prefix):
            return mon.DISABLE
        if code not in self._codes:
            self._add_code(code)
            mon.set_local_events(self._tool, code, mon.events.LINE | mon.events.PY_RETURN)
        return None

    def _on_line(self, code: CodeType, line: int) -> None:
        # The frame is not passed; the code object stands for it (recursion in notebook code
        # interleaves its frames' transitions, a rare case that costs only accuracy there).
        self._line(code.co_filename, code, line)

    def _on_return(self, code: CodeType, offset: int, value: Any) -> None:
        self._leave(code.co_filename, code)

    # -- both -------------------------------------------------------------------------------------
    def _leave(self, filename: str, where: Any) -> None:
        """The frame returns (or ends by an exception): its last line, then out (line ``LEFT``) —
        a loop that ends a frame has no line after it, and its way out is a decision too."""
        prev = self._last.pop(where, None)
        if prev is not None:
            self._take(filename, prev, LEFT)

    def _line(self, filename: str, where: Any, line: int) -> None:
        self._events += 1
        here = (filename, line)
        self._lines[here] = self._lines.get(here, 0) + 1
        prev = self._last.get(where, 0)  # 0: entered the frame
        self._last[where] = line
        self._take(filename, prev, line)

    def _take(self, filename: str, prev: int, to: int) -> None:
        """Count the transition; its first taking keeps how often ``prev`` had run, and when."""
        key = (filename, prev, to)
        seen = self.transitions.get(key)
        if seen is not None:
            seen[0] += 1
        elif len(self.transitions) < MAX_TRANSITIONS:
            self.transitions[key] = [1, self._lines.get((filename, prev), 0), self._events]
