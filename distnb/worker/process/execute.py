"""Runs notebook cells in a rank's persistent namespace with IPython-like semantics."""

from __future__ import annotations

import bdb
import cmd
import itertools
import linecache
import os
import pdb
import re
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, Callable

from distnb.wire.black_box import BlackBox
from distnb.wire.cell_code import CELL_PREFIX, CompiledCell, cell_filename, compile_cell
from distnb.wire.record_types import CellError, CellOutcome
from distnb.worker.process.debug import DebugInterrupt, Hooks, quit_error
from distnb.worker.process.panel_link import PanelLink
from distnb.worker.process.zygote import heavy_modules
from distnb.worker.recorders.memory_sampler import MemorySampler
from distnb.worker.recorders.paths import PathRecorder
from distnb.worker.recorders.thread_errors import ThreadErrors
from distnb.worker.torch_hooks.call_log import CallLog
from distnb.worker.torch_hooks.compile_record import CompileRecorder
from distnb.worker.torch_hooks.flight_recorder import CellClock
from distnb.worker.torch_hooks.group_holders import StaleHolders
from distnb.worker.torch_hooks.group_state import group_errors, live_groups, sync_state

__all__ = ["Executor", "mimebundle"]

_TEXT_CAP = 64 * 1024
_KEEP_SOURCES = 1000
# distnb's own frames (e.g. the SIGINT handler that raises KeyboardInterrupt) are hidden from tracebacks.
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # distnb/
# pdb's and bdb's frames between a cell's line and the BdbQuit its ``q`` raises there.
_DEBUGGER_FILES = {bdb.__file__, pdb.__file__, cmd.__file__}


def _cap(text: str) -> str:
    if len(text) <= _TEXT_CAP:
        return text
    return text[:_TEXT_CAP] + f"\n… [{len(text) - _TEXT_CAP:,} more characters not shown]"


def mimebundle(obj: Any) -> dict[str, str]:
    """A JSON-able MIME bundle for ``obj``; never raises and never ships huge payloads."""
    bundle: dict[str, str] = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method):
        try:
            data = method()
            if isinstance(data, tuple):
                data = data[0]
            for mime, value in (data or {}).items():
                if isinstance(value, str):
                    bundle[mime] = _cap(value)
        except Exception:
            pass
    for mime, attr in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"), ("image/svg+xml", "_repr_svg_")):
        method = getattr(obj, attr, None)
        if mime not in bundle and callable(method) and not isinstance(obj, type):
            try:
                value = method()
                if isinstance(value, str):
                    bundle[mime] = _cap(value)
            except Exception:
                pass
    try:
        text = repr(obj)
    except Exception as exc:
        text = f"<{type(obj).__name__} object; repr() failed: {exc!r}>"
    bundle["text/plain"] = _cap(text)
    return bundle


class Executor:
    """Owns the rank's namespace and executes cells in it (always on the main thread)."""

    def __init__(self, namespace: dict[str, Any], send_display: Callable[[int, dict[str, str]], None], memory: MemorySampler | None = None) -> None:
        self.ns = namespace
        self.memory = memory or MemorySampler()
        self.clock = CellClock()
        self.calls = CallLog(CELL_PREFIX, black_box=BlackBox.from_environ(), running=lambda: self.cell)
        self.paths = PathRecorder(CELL_PREFIX)
        self.compiles = CompileRecorder()
        self.threads = ThreadErrors(CELL_PREFIX, lambda: self.cell)
        self.threads.install()
        self.stale = StaleHolders()  # what held the groups the last regroup closed
        self._send_display = send_display
        self.cell: int | None = None
        self.started = 0.0
        # An interrupt for a cell that has not started yet (it raced ahead of the cell's EXEC).
        self.lock = threading.Lock()
        self.interrupt_cell: int | None = None
        self.sigints = 0  # KeyboardInterrupts raised by the SIGINT handler
        self.busy = ""  # what the main thread does for distnb outside a cell ("distnb's check")
        self.debug: Hooks | None = None  # breakpoint(), input() and post-mortems answered from the notebook
        self.panel = PanelLink()  # debugpy for the notebook's debugger panel, started when it asks
        self.last_traceback: TracebackType | None = None  # of the last cell that raised, for %dist_debug
        self.ns.setdefault("__name__", "__main__")
        self.ns["display"] = self.display

    def display(self, *objs: Any) -> None:
        """``display()`` on a rank: the object's rich forms are forwarded to the notebook."""
        for obj in objs:
            self._send_display(self.cell if self.cell is not None else -1, mimebundle(obj))

    def run(self, cell_id: int, code: str, post_mortem: bool = False, body: Callable[[], None] | None = None,
            compiled: CompiledCell | None = None, paths: bool = False, source: dict[str, Any] | None = None) -> CellOutcome:
        """Run ``code`` as cell ``cell_id``; with ``post_mortem``, an exception opens the debugger
        at its frame (the namespace alive) before the cell reports it. ``body`` runs instead of
        code (distnb's own work in a cell's clothes: interruptible, reported like one).
        ``compiled`` is ``code`` compiled by the notebook (see distnb.wire.cell_code); ``paths``
        records which of the notebook's lines ran (worker/recorders/paths.py); ``source`` is where the code
        stands in the notebook, for the debugger panel's breakpoints (worker/process/panel_link.py)."""
        filename = cell_filename(cell_id)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        if source is not None:
            self.panel.map_cell(filename, source, code.count("\n") + 1)
        self.panel.before_cell()
        # Keep the sources of recent cells only: a long session must not grow without bound.
        linecache.cache.pop(cell_filename(cell_id - _KEEP_SOURCES), None)
        reply: CellOutcome = {"status": "ok", "value": None, "error": None}
        self.memory.start()
        self.calls.digests.clear()  # this cell's calls only
        failed_before = group_errors()
        modules_before = len(sys.modules)
        self.clock.start(cell_id, time.time())
        self.started = time.monotonic()
        try:
            with self.lock:
                self.cell = cell_id
                pending, self.interrupt_cell = self.interrupt_cell == cell_id, None
            if self.debug is not None:
                self.debug.prompter.begin_cell()
            if pending:
                raise KeyboardInterrupt
            try:
                if body is not None:
                    value = body()
                else:
                    cell = compiled or compile_cell(code, filename)
                    self.compiles.start(graphs=paths)
                    if paths:
                        self.paths.start([c for c in cell if c is not None])
                    value = self._exec(cell)
            finally:
                # First: an interrupt can end a cell debugpy held, and debugpy would hold the
                # thread again at the first event of distnb's own code below (3.12's
                # sys.monitoring reports the recorders' returns).
                self.panel.after_cell()
                if self.paths.on:
                    reply["paths"] = self.paths.stop()
                if self.compiles.on:
                    reply["compiles"] = self.compiles.stop()
                if self.debug is not None:
                    self.debug.end_cell()  # before any of distnb's own code runs: no stepping into it
            if value is not None:
                self.ns["_"] = value
                reply["value"] = mimebundle(value)
        except (KeyboardInterrupt, DebugInterrupt):
            reply["status"] = "interrupted"
            etype, evalue, tb = sys.exc_info()
            reply["error"] = self._error_info(KeyboardInterrupt, KeyboardInterrupt(), tb, filename)
        except BaseException:  # SystemExit too: a cell must never end the rank silently
            reply["status"] = "error"
            etype, evalue, tb = sys.exc_info()
            if evalue is not None and not quit_error(evalue) and body is None:
                # Not an out-of-memory error's: its frames hold the very tensors that filled the device.
                self.last_traceback = None if "OutOfMemoryError" in type(evalue).__name__ else _from_cell(tb) or tb
                if post_mortem and self.debug is not None:
                    self._post_mortem(tb)
            error = reply["error"] = self._error_info(etype, evalue, tb, filename)
            stale = self.stale.still_held(self.ns) if _CLOSED_GROUP.search(str(evalue)) else {}
            if stale:
                error["stale"] = stale
        finally:
            self.cell = None  # first: from here on a late SIGINT is ignored
            self.panel.after_cell()  # again, for an interrupt that landed before the cell's code ran
            reply["duration"] = time.monotonic() - self.started
            threads = self.threads.take()
            if threads:
                reply["threads"] = threads
            reply["memory"] = self.memory.stop()
            if len(sys.modules) > modules_before:  # new entries come last: sys.modules is a dict
                imported = heavy_modules(itertools.islice(sys.modules, modules_before, None))
                if imported:
                    reply["imported"] = imported
            self.clock.end(time.time())
            groups = live_groups()
            reply["sync"] = sync_state(self.calls, groups)
        failed = {g: e for g, e in group_errors(groups).items() if g not in failed_before}
        if failed and reply["status"] == "ok":
            reply["status"] = "error"
            reply["error"] = _group_failure(failed)
        return reply

    def _exec(self, cell: CompiledCell) -> Any:
        """Run the cell's statements; the value of its last expression, if it ends with one."""
        exec(cell.body, self.ns)
        return eval(cell.last, self.ns) if cell.last is not None else None

    def _post_mortem(self, tb: TracebackType | None) -> None:
        assert self.debug is not None
        try:
            self.debug.post_mortem(tb)
        except (KeyboardInterrupt, DebugInterrupt, bdb.BdbQuit):
            pass  # the error is the cell's outcome whatever happened in the debugger

    def debug_last(self, cell_id: int) -> CellOutcome:
        """``%dist_debug``: as cell ``cell_id``, the debugger at the frame of the last error."""
        tb = self.last_traceback

        def body() -> None:
            if tb is None:
                raise LookupError("no cell has raised on this rank since it started, so there is nothing to debug "
                                  "post-mortem; %%on_ranks --pdb stops at the next error instead.")
            assert self.debug is not None
            self.debug.post_mortem(tb)

        return self.run(cell_id, "", body=body)

    @staticmethod
    def _error_info(etype: type[BaseException] | None, evalue: BaseException | None, tb: TracebackType | None, filename: str) -> CellError:
        first = _from_cell(tb)  # without distnb's own frames
        te = traceback.TracebackException(etype, evalue, first)  # type: ignore[arg-type]
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if not f.filename.startswith(_PKG_DIR) and f.filename not in _DEBUGGER_FILES])
        lines = list(te.format())
        line = None
        walker = first
        while walker is not None:
            if walker.tb_frame.f_code.co_filename == filename:
                line = walker.tb_lineno
            walker = walker.tb_next
        if line is None and isinstance(evalue, SyntaxError) and evalue.filename == filename:
            line = evalue.lineno
        try:
            text = str(evalue)
        except Exception:
            text = "<str() of the exception failed>"
        if quit_error(evalue or Exception()):
            text = "quit from the debugger (q): the cell stopped there on this rank"
        if isinstance(evalue, SystemExit):
            text = f"SystemExit({evalue.code!r}) was raised in the cell; the rank keeps running"
            lines.append(f"(distnb caught {text.split(' was')[0]}: the rank keeps running.)\n")
        return {
            "ename": etype.__name__ if etype else "Error",
            "evalue": text if len(text) <= 4000 else text[:4000] + " …",
            "traceback": _cap("".join(lines)),
            "line": line,
        }


def _from_cell(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the cell's own frame on: the debugger's ``up`` stops at the cell."""
    first = tb
    while first is not None and not first.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        first = first.tb_next
    return first


#: A collective on a group that was closed under it (gloo's and NCCL's words).
_CLOSED_GROUP = re.compile(r"Connection (closed|reset) by peer|Broken pipe|communicator was aborted|process group .*(destroyed|abort)|"
                           r"ProcessGroup.*(shut ?down|abort)", re.IGNORECASE)


def _group_failure(failed: dict[str, str]) -> CellError:
    """The cell's error when NCCL gave up on a group while it ran: the host syncs that waited for
    the aborted collectives returned without raising, and their values are garbage."""
    names = ", ".join(f"group {g} ({e.lower().replace('_', ' ')})" for g, e in sorted(failed.items()))
    return {
        "ename": "DistBackendError",
        "evalue": f"NCCL aborted the communicator of {names} during this cell: "
                  + ("a collective did not complete within --pg-timeout (Watchdog caught collective operation timeout). "
                     if "TIMEOUT" in failed.values() else "a communication error (a peer failed, or the network). ")
                  + "Values from collectives on it since are garbage, and the group is unusable: %dist_regroup "
                  "(pool.regroup()) builds a new one and keeps every rank's namespace.",
        "traceback": "",
        "line": None,
    }
