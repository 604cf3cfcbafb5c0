"""The rank's end of the notebook's debugger panel: debugpy inside the rank, spoken to by the rank's
control thread, which relays DAP between it and the notebook (services/rank_debug.py).

Why in-process (``in_process_debug_adapter``): debugpy's usual adapter is a second process per rank
that outlives the rank; pydevd itself speaks DAP. It listens on 127.0.0.1, port 0 — nothing another
machine can reach — only until the control thread's connection is served; then its listening socket
is closed (pydevd would hand the session to any later local connection). The relay rides the
rank's existing, authenticated control connection, so a remote rank needs no new port.

Cells keep their ``<cell-N>`` file names (the call log, the path recorder and every report name
cells so); the panel knows a cell by the file ipykernel compiled it as (its text's hash).
:meth:`PanelLink.map_cell` tells pydevd, with a source map, that the panel's file from line L is
``<cell-N>`` from line 1 — so gutter breakpoints land in the rank's code and frames point back at
the notebook's cell. Breakpoints set before the map exist are applied when it comes (pydevd
re-applies them on every new map).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

from distnb.worker.process.debug import cell_place
from distnb.worker.process.peek import DEBUGGER_DIR, quick_handoffs
from distnb.worker.torch_hooks.call_log import STOPS

__all__ = ["PanelLink", "private_thread"]

#: debugpy's attach options for a rank: its stdout stays distnb's (no output events), child
#: processes are not followed, and only the user's code is stepped through.
ATTACH = {"justMyCode": True, "subProcess": False, "redirectOutput": False, "showReturnValue": False}


#: Cells whose place in the panel's files a rank remembers (a map is a few dozen bytes).
MAPS_KEPT = 2000


def private_thread(thread: threading.Thread) -> threading.Thread:
    """Mark one of distnb's threads as pydevd marks its own: never traced, never suspended when a
    breakpoint stops the rank (the control thread must go on answering the notebook)."""
    thread.pydev_do_not_trace = True  # type: ignore[attr-defined]
    thread.is_pydev_daemon_thread = True  # type: ignore[attr-defined]
    return thread


class PanelLink:
    """debugpy in this rank, and the loopback socket the control thread speaks DAP over."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self._buf = b""
        self.error = ""
        self.stopped: dict[int, float] = {}  # debugpy's ids of the threads it stopped → since (monotonic)
        self._main = threading.main_thread()  # kept: let_go may call no Python function to find it
        # The panel's file → (cell file, its first line there, lines): kept before debugpy starts too,
        # so a function defined in a cell run before the panel was turned on takes its breakpoints.
        self._maps: dict[str, tuple[str, int, int]] = {}
        # Whether the panel set any breakpoint or "pause on exceptions" (read off the requests
        # relayed): pydevd's tracing costs every cell 1.3-2×, so with none the main thread runs
        # untraced (benchmarks/bench_panel.py).
        self._armed: dict[str, bool] = {}
        self._tracing = False
        self._before: dict[str, Any] | None = None  # the collective the main thread stopped before (the panel's stop)

    def start(self) -> str:
        """Start debugpy once (later calls reuse it); returns why it could not, or ""."""
        if self.sock is not None:
            return ""
        if self.error:
            return self.error
        for t in threading.enumerate():
            if t.name.startswith("distnb") or t is threading.current_thread():
                private_thread(t)
        # Its warning about frozen modules would reach the notebook from every rank: cells are
        # not frozen modules, and the panel's breakpoints are in cells.
        os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        pdb: Any = sys.modules.get("pdb")
        saved = (sys.breakpointhook, getattr(pdb, "set_trace", None))
        try:
            with quick_handoffs():  # importing and starting debugpy: thousands of calls giving up the GIL
                import debugpy

                in_process = True
                try:
                    host, port = debugpy.listen(("127.0.0.1", 0), in_process_debug_adapter=True)
                except TypeError:  # debugpy before 1.8.1: its adapter process, still on loopback
                    in_process = False
                    host, port = debugpy.listen(("127.0.0.1", 0))
                self.sock = socket.create_connection((host, port), timeout=30)
                if in_process:
                    _stop_listening(self.sock)
            self.sock.setblocking(False)
            for path, (filename, first, lines) in self._maps.items():
                self._apply(path, filename, first, lines)
            self._tracing = True  # debugpy traces every thread it finds when a client connects
        except Exception as exc:  # ImportError, a refused listen: said once, in every answer
            self.error = (f"debugpy could not start in this rank ({type(exc).__name__}: {exc}); "
                          "pip install debugpy in the ranks' environment")
            return self.error
        finally:
            # breakpoint() and pdb stay distnb's console (worker/process/debug.py), panel or not.
            sys.breakpointhook = saved[0]
            if pdb is not None and saved[1] is not None:
                pdb.set_trace = saved[1]
        return ""

    def send(self, msgs: list[dict[str, Any]]) -> None:
        if self.sock is None:
            raise RuntimeError("the debugger link is not started")
        data = b""
        for msg in msgs:
            args = msg.get("arguments") or {}
            if msg.get("command") == "setBreakpoints":
                self._armed[str(args.get("source", {}).get("path"))] = bool(args.get("breakpoints"))
            elif msg.get("command") == "setExceptionBreakpoints":
                self._armed[""] = bool(args.get("filters") or args.get("exceptionOptions"))
            if msg.get("command") == "attach":
                msg = {**msg, "arguments": {**ATTACH, **msg.get("arguments", {}), "rules": _rules()}}
            body = json.dumps(msg).encode()
            data += b"Content-Length: %d\r\n\r\n" % len(body) + body
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)
        if not self._tracing and (any(self._armed.values()) or any(m.get("command") == "pause" for m in msgs)):
            self._trace_main_thread()

    def armed_files(self) -> list[str]:
        """The files the notebook set breakpoints in (the panel's, or an attached job's console's)."""
        return [path for path, armed in self._armed.items() if armed and path not in ("", "collectives")]

    def _trace_main_thread(self) -> None:
        """A breakpoint (or a pause) arrived while the main thread runs untraced: trace it from
        here on, from this thread (pydevd's own way of tracing threads it did not start; it marks
        the frames running now itself when breakpoints change)."""
        pydevd = sys.modules.get("pydevd")
        main = threading.main_thread().ident
        if pydevd is None or main is None:
            return
        try:
            import pydevd_tracing

            py_db = pydevd.get_global_debugger()
            if _monitoring():
                py_db.enable_tracing(apply_to_all_threads=True)  # 3.12+: sys.monitoring reaches every thread
            else:
                pydevd_tracing.set_trace_to_threads(py_db.trace_dispatch, thread_idents=[main], create_dummy_thread=False)
            py_db.set_tracing_for_untraced_contexts()
            self._tracing = True
        except Exception as exc:  # the next cell starts traced (before_cell) whatever happens here
            print(f"distnb: the debugger panel's breakpoint applies from the next cell ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """The whole messages debugpy has sent so far, and whether the link is still open."""
        if self.sock is None:
            return [], False
        open_ = True
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                open_ = False
                self.sock.close()
                self.sock = None
                break
            self._buf += chunk
        msgs = []
        while (end := self._buf.find(b"\r\n\r\n")) >= 0:
            length = int(self._buf[:end].split(b":", 1)[1])
            if len(self._buf) < end + 4 + length:
                break
            msg = json.loads(self._buf[end + 4 : end + 4 + length])
            msg.pop("pydevd_cmd_id", None)
            msgs.append(msg)
            self._track(msg)
            self._buf = self._buf[end + 4 + length :]
        return msgs, open_

    def collective_stops(self, on: bool) -> None:
        """The panel's "before each collective" (control thread): the main thread stops in the
        panel before each collective call it makes, nothing issued, until it is turned off."""
        STOPS.panel_hook = self._stop_before
        STOPS.every = on
        self._armed["collectives"] = on  # stepping on from such a stop needs the thread traced
        if on and not self._tracing and self.sock is not None:
            self._trace_main_thread()

    def _stop_before(self, info: dict[str, Any], frame: Any) -> None:
        """From call_log's wrapper, on the main thread: stop in the panel's debugger at the cell's
        frame, on the line making the call (the collective not issued yet)."""
        pydevd = sys.modules.get("pydevd")
        if self.sock is None or pydevd is None:
            return
        from _pydevd_bundle.pydevd_comm_constants import CMD_SET_BREAK

        py_db, thread = pydevd.get_global_debugger(), threading.current_thread()
        self._before = info  # told with the stop (``_track``, on the control thread)
        try:
            py_db.set_suspend(thread, CMD_SET_BREAK)
            py_db.do_wait_suspend(thread, frame, "line", None)
        finally:
            self._before = None

    def _track(self, msg: dict[str, Any]) -> None:
        body = msg.get("body") or {}
        if msg.get("event") == "stopped":
            self.stopped.setdefault(body.get("threadId", 0), time.monotonic())
            if self._before is not None:
                msg["body"] = {**body, "distnbBefore": self._before}
        elif msg.get("event") == "continued":
            if body.get("allThreadsContinued"):
                self.stopped.clear()
            self.stopped.pop(body.get("threadId", 0), None)

    def paused(self) -> dict[str, Any] | None:
        """Like the pdb console's pause (worker/process/debug.py): {kind, where, since} while debugpy holds
        the rank stopped — a rank paused in the panel is not hung, nor are those waiting for it."""
        if not self.stopped:
            return None
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        while frame is not None and not frame.f_code.co_filename.startswith("<cell-"):
            frame = frame.f_back
        where = cell_place(frame, frame.f_lineno) if frame is not None else {}
        return {"kind": "panel", "where": where, "since": min(self.stopped.values())}

    def before_cell(self) -> None:
        """From the main thread, as a cell starts: traced by debugpy only while the panel has a
        breakpoint or pauses on exceptions. (A breakpoint set while a cell runs untraced is
        applied by pydevd to the frames running then, and fully from the next cell.)"""
        armed = any(self._armed.values())
        if self.sock is None or armed == self._tracing or (pydevd := sys.modules.get("pydevd")) is None:
            return
        py_db = pydevd.get_global_debugger()
        if armed:
            py_db.enable_tracing()
        elif not _monitoring():
            py_db.disable_tracing()
        # With sys.monitoring (3.12+) an unarmed panel costs nothing: pydevd asks for no events
        # while it has no breakpoint. Its disable_tracing would mark this thread untraced, and no
        # call from another thread can mark it traced again: a breakpoint set mid-cell would
        # never stop it.
        self._tracing = armed

    def let_go(self) -> None:
        """From the SIGINT handler, on the main thread, before the interrupt is raised through
        debugpy's wait: mark the thread running. Raised while debugpy holds it suspended, the
        interrupt would leave it so, and with sys.monitoring (3.12+) debugpy holds the thread
        again at the next function return — in distnb's own code, never ending the cell. Only
        attribute reads and writes here: a Python call's return would be that event."""
        if not self.stopped:
            return
        info = getattr(self._main, "additional_info", None)
        if info is not None and getattr(info, "pydev_state", None) == _STATE_SUSPEND:
            info.pydev_step_cmd = -1
            info.pydev_state = _STATE_RUN

    def untrace(self) -> bool:
        """From the control thread, once the debugger let go of the main thread (a console on a live
        job's rank left, services/job_console.py): stop tracing it, as it ran before the pause. A
        traced thread runs Python calls about 10× slower, even with no breakpoint (measured on a
        loop of small calls, 3.11 and 3.13). False while the thread is still held (try again)."""
        pydevd = sys.modules.get("pydevd")
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if pydevd is None or self.stopped or not self._tracing:
            return not self.stopped
        while frame is not None:
            if DEBUGGER_DIR in frame.f_code.co_filename:
                return False  # still leaving the debugger's wait
            frame = frame.f_back
        try:
            if _monitoring():
                from _pydevd_sys_monitoring import pydevd_sys_monitoring

                # Freeing the tool leaves the events it set on each code object until 3.14 (about
                # 25% slower calls, measured on 3.13): those it knows are cleared first.
                monitoring: Any = vars(sys)["monitoring"]  # 3.12+, as _monitoring() says (mypy checks as 3.11)
                for name in ("_pydevd_sys_monitoring._pydevd_sys_monitoring_cython", "_pydevd_sys_monitoring._pydevd_sys_monitoring"):
                    for code in list(getattr(sys.modules.get(name), "_code_to_func_code_info_cache", {})):
                        monitoring.set_local_events(monitoring.DEBUGGER_ID, code, 0)
                pydevd_sys_monitoring.stop_monitoring(all_threads=True)  # no tool, no events: a later pause starts it again
            else:
                _untrace_threads()
        except Exception as exc:  # pydevd's internals: a newer debugpy may lack them
            print(f"distnb: the debugger's tracing could not be removed ({type(exc).__name__}: {exc}); this rank runs traced, "
                  "about 10x slower in Python code, until it ends", file=sys.stderr, flush=True)
        self._tracing = False  # tried once: a later pause traces the main thread again
        return True

    def after_cell(self) -> None:
        """From the main thread, as a cell ends. An interrupt raised through debugpy's wait leaves
        debugpy believing the thread suspended: it would hold the next traced cell at its first
        line without a word. The cell is over, so nothing of it is held now."""
        self.stopped.clear()
        if self.sock is None or "pydevd" not in sys.modules:
            return
        with contextlib.suppress(Exception):  # pydevd's internals: a newer debugpy may lack them
            from _pydevd_bundle.pydevd_additional_thread_info import set_additional_thread_info
            from _pydevd_bundle.pydevd_thread_lifecycle import internal_run_thread

            internal_run_thread(threading.current_thread(), set_additional_thread_info)

    def map_cell(self, filename: str, source: dict[str, Any], lines: int) -> None:
        """From the main thread, before cell ``filename`` runs: the panel's file ``source["path"]``
        from line ``source["line"]`` is this cell's code from line 1."""
        path, first = str(source["path"]), int(source["line"])
        self._maps.pop(path, None)  # re-inserted last: the oldest go first
        self._maps[path] = (filename, first, lines)
        while len(self._maps) > MAPS_KEPT:
            del self._maps[next(iter(self._maps))]
        if self.sock is not None:
            self._apply(path, filename, first, lines)

    @staticmethod
    def _apply(path: str, filename: str, first: int, lines: int) -> None:
        pydevd = sys.modules.get("pydevd")
        if pydevd is None or lines <= 0:
            return
        from _pydevd_bundle.pydevd_api import PyDevdAPI  # vendored by debugpy, importable once it runs

        entry = PyDevdAPI.SourceMappingEntry(first, first + lines - 1, 1, filename)
        PyDevdAPI().set_source_mapping(pydevd.get_global_debugger(), path, [entry])


#: pydevd's thread states (``_pydevd_bundle.pydevd_constants``): not imported, as let_go may
#: call nothing.
_STATE_RUN, _STATE_SUSPEND = 1, 2


def _untrace_threads() -> None:
    """Before 3.12: pydevd traces every thread of the job (and those it starts, through a patched
    ``start_new_thread`` and ``threading.settrace``). A thread's trace function can only be removed
    by that thread: each is given one that removes itself at its next call, and the frames running
    now are cleared here."""
    import pydevd_tracing
    from _pydev_bundle.pydev_monkey import undo_patch_thread_modules

    threading.settrace(None)  # type: ignore[arg-type,unused-ignore]  # typeshed takes a function only in some versions
    undo_patch_thread_modules()
    ours = {t.ident for t in threading.enumerate() if getattr(t, "pydev_do_not_trace", False)}
    idents = [i for i in sys._current_frames() if i not in ours]
    if pydevd_tracing.set_trace_to_threads(_untrace_self, thread_idents=idents, create_dummy_thread=False) != 0:
        raise RuntimeError("pydevd's helper could not set the threads' trace functions")
    # After the swap: a frame entered since gets no trace (the thread's own function removes itself).
    for ident, top in sys._current_frames().items():
        at: FrameType | None = None if ident in ours else top
        while at is not None:
            at.f_trace = None
            at = at.f_back


def _untrace_self(frame: Any, event: str, arg: Any) -> None:
    sys.settrace(None)


def _monitoring() -> bool:
    """Whether pydevd traces with sys.monitoring (Python 3.12+) rather than sys.settrace."""
    tracing = sys.modules.get("pydevd_tracing")
    return bool(getattr(tracing, "PYDEVD_USE_SYS_MONITORING", False))


def _stop_listening(mine: socket.socket) -> None:
    """Once pydevd serves this connection, close its listening socket: it would take any later
    connection from this machine (another user's too) in place of ours."""
    py_db = sys.modules["pydevd"].get_global_debugger()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        served = getattr(getattr(py_db, "reader", None), "sock", None)
        with contextlib.suppress(OSError):
            if served is not None and served.getpeername() == mine.getsockname():
                break
        time.sleep(0.01)
    waiter = getattr(py_db, "_waiting_for_connection_thread", None)
    if waiter is not None:
        waiter.do_kill_pydev_thread()


def _rules() -> list[dict[str, Any]]:
    """distnb's own frames are not the user's: the panel never steps into them or shows them."""
    return [{"path": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "include": False}]  # distnb/
