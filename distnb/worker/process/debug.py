"""A rank's debugger and stdin: ``breakpoint()``, ``pdb.set_trace()``, post-mortems and ``input()``
in a cell, answered from the notebook.

The main thread runs the cell; while it waits for a line it owns its socket to the notebook (no
other request reaches a rank in a cell). A request for a line leaves through the events pipe, like
a ``display()``, so it reaches the notebook after everything the cell printed before it; the line
comes back on the main thread's own socket as a STDIN_REPLY. pdb writes into a buffer that goes
with the next request: each command's answer arrives whole, and ranks' answers can be compared.

The debugger also stops *before a collective* (worker/torch_hooks/call_log.py's ``STOPS``): pdb's ``nc``
continues to just before the rank's next watched torch.distributed call, and the control thread's
HOLD does the same for a rank the console holds (:func:`hold_request`), or makes a call that would
wait for ranks that left the cell raise instead. The prompt then says which call is next
(``(Pdb before all_reduce)``) and the request carries it (``where["before"]``), nothing issued yet.
"""

from __future__ import annotations

import bdb
import builtins
import io
import itertools
import linecache
import os
import pdb
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Callable

from distnb.wire.protocol import Hold, Msg, StdinReply
from distnb.worker.torch_hooks.call_log import STOPS, c10d_calls, needs

__all__ = ["DebugInterrupt", "Hooks", "Prompter", "RankPdb", "cell_place", "hold_request", "install", "quit_error"]

#: Lines of source either side of the paused line sent with each prompt.
CONTEXT = 2
#: Characters of one pdb answer sent to the notebook (``pp`` of a huge object); the rest is counted.
ANSWER_CAP = 256 * 1024


class DebugInterrupt(BaseException):
    """An interrupt that reached a rank paused in pdb. pdb's command loop swallows
    KeyboardInterrupt (it cancels a command), so the interrupt travels as this instead and
    the executor reports the cell as interrupted."""


class Prompter:
    """Asks the notebook for lines on behalf of the cell running on the main thread.

    ``send`` hands a request to the notebook (in order with the cell's output); ``receive``
    blocks for the answer to request ``id``. ``cell`` tells which cell is running (None: none).
    """

    def __init__(self, send: Callable[[dict[str, Any]], None], receive: Callable[[int], StdinReply],
                 cell: Callable[[], int | None]) -> None:
        self._send, self._receive, self._cell = send, receive, cell
        self._ids = itertools.count(1)
        self.detached = False  # the notebook said: ignore this cell's remaining breakpoints
        self.paused: dict[str, Any] | None = None  # what the rank waits for, for %dist_stacks and the hang watch
        self.mode = "breakpoint"

    def begin_cell(self) -> None:
        self.detached, self.mode = False, "breakpoint"
        STOPS.clear()  # a stop asked for in an earlier cell is not this one's

    def current_cell(self) -> int | None:
        return self._cell()

    def usable(self) -> str:
        """``""`` when a line can be asked for now, else why not."""
        if threading.current_thread() is not threading.main_thread():
            return "only the thread running the cell can read from the notebook"
        if self._cell() is None:
            return "no cell is running on this rank"
        return ""

    def ask(self, kind: str, prompt: str, output: str = "", where: dict[str, Any] | None = None) -> StdinReply:
        cell = self._cell()
        request_id = next(self._ids)
        request = {"t": Msg.STDIN_REQUEST, "id": request_id, "cell": cell, "kind": kind, "prompt": prompt,
                   "output": output, "where": where, "mode": self.mode}
        self.paused = {"kind": kind, "where": where, "since": time.monotonic()}
        try:
            self._send(request)
            return self._receive(request_id)
        finally:
            self.paused = None

    # -- input() and sys.stdin -------------------------------------------------------------------
    def input(self, prompt: object = "") -> str:
        why = self.usable()
        if why:
            raise EOFError(f"input() on this rank can't be answered: {why}.")
        sys.stdout.flush()
        answer = self.ask("input", str(prompt))
        if answer.get("eof"):
            raise EOFError(f"input() got no answer: {answer.get('why') or 'the notebook has no input box here'}.")
        return str(answer.get("text", ""))


class _Stdin(io.TextIOBase):
    """``sys.stdin`` of a rank: a read asks the notebook for a line (as ``input()`` does)."""

    def __init__(self, prompter: Prompter) -> None:
        self._prompter = prompter

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        try:
            return self._prompter.input("") + "\n"
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        return self.readline()


class _PdbIn(io.TextIOBase):
    """pdb's stdin: its prompt and everything it wrote since the last command go to the notebook."""

    def __init__(self, debugger: RankPdb) -> None:
        self._pdb = debugger

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return self._pdb.next_command()


def _cell_module(frame: FrameType) -> bool:
    return frame.f_code.co_name == "<module>" and frame.f_code.co_filename.startswith("<cell-")


def cell_place(frame: FrameType, lineno: int) -> dict[str, Any]:
    """Where a paused rank stands, as the notebook shows it: file, line, function, cell, code, the lines around."""
    filename = frame.f_code.co_filename
    lines = linecache.getlines(filename, frame.f_globals)
    cell = int(filename[6:-1]) if filename.startswith("<cell-") and filename[6:-1].isdigit() else None
    context = [(n, lines[n - 1].rstrip("\n")) for n in range(max(1, lineno - CONTEXT), min(len(lines), lineno + CONTEXT) + 1)]
    return {"file": filename, "line": lineno, "func": frame.f_code.co_name, "cell": cell,
            "code": lines[lineno - 1].strip() if 0 < lineno <= len(lines) else "", "context": context}


class RankPdb(pdb.Pdb):
    """pdb reading its commands from the notebook. Never installs its own SIGINT handler (the
    rank's turns a notebook interrupt into one), skips distnb's frames when stepping, and stops
    tracing when the cell ends (the executor calls :meth:`end`)."""

    def __init__(self, prompter: Prompter) -> None:
        self.out = io.StringIO()
        stdin: Any = _PdbIn(self)  # a readline() is all pdb uses of it
        super().__init__(stdin=stdin, stdout=self.out, skip=["distnb.*", "zmq.*"], nosigint=True, readrc=False)
        self.prompter = prompter
        self.before: dict[str, Any] | None = None  # the collective the rank is paused before (nothing issued)

    def do_nc(self, arg: str) -> bool | None:
        """nc
        Continue until just before this rank's next torch.distributed collective (distnb): the
        rank pauses there, nothing issued, and the console shows every paused rank's next one
        side by side. (``p nc`` prints a variable named nc.)"""
        if not STOPS.watching:
            self.message("*** nc needs distnb's call log, which DISTNB_CALL_LOG=0 turned off: nothing can stop before a collective.")
            return None
        STOPS.hold = "nc"
        return self.do_continue(arg)

    def stop_before(self, frame: FrameType, info: dict[str, Any]) -> None:
        """Pause at ``frame`` (the cell's line calling the collective ``info`` names) before the
        call is issued. Tracing starts only after the prompt, as the command asks (a step, a next),
        so pdb's own frames are never traced; ``c`` and ``nc`` leave it off."""
        self.before, self.prompt = info, f"(Pdb before {info['op']}) "
        try:
            self.reset()
            outer: FrameType | None = frame
            while outer is not None:  # as bdb's set_trace: every frame from the cell's outwards
                outer.f_trace = self.trace_dispatch
                self.botframe = outer
                outer = outer.f_back
            self.interaction(frame, None)
        finally:
            self.before, self.prompt = None, "(Pdb) "
        if self.quitting:
            raise bdb.BdbQuit
        if self.breaks or not (self.stopframe is self.botframe and self.stoplineno == -1):
            sys.settrace(self.trace_dispatch)  # a stepping command (or breakpoints): trace from here on

    # A cell runs as two code objects, its statements then its last expression (for its value):
    # stepping from one into the other must look like going to the next line, not a return and a call.
    def user_call(self, frame: FrameType, argument_list: Any) -> None:
        if not _cell_module(frame):
            super().user_call(frame, argument_list)

    def user_return(self, frame: FrameType, return_value: Any) -> None:
        if not _cell_module(frame):
            super().user_return(frame, return_value)

    def next_command(self) -> str:
        text, prompt = self.out.getvalue(), self.prompt
        self.out.seek(0)
        self.out.truncate()
        if text.endswith(prompt):
            text = text[: -len(prompt)]
        if len(text) > ANSWER_CAP:
            text = text[:ANSWER_CAP] + f"\n… [{len(text) - ANSWER_CAP:,} more characters not shown]\n"
        where = cell_place(*self.stack[self.curindex]) if self.stack else None
        if where is not None and self.before is not None:
            where["before"] = self.before
        try:
            answer = self.prompter.ask("pdb", prompt, text, where)
        except KeyboardInterrupt:
            raise DebugInterrupt from None
        if answer.get("detach") or answer.get("eof"):
            self.prompter.detached = True
            self.clear_all_breaks()
            return "continue\n"
        return str(answer.get("text", "")) + "\n"


class Hooks:
    """What a rank replaces so that a cell's debugger and stdin reach the notebook."""

    def __init__(self, prompter: Prompter) -> None:
        self.prompter = prompter
        self.active: RankPdb | None = None

    def _usable(self, what: str) -> bool:
        why = self.prompter.usable()
        if why:
            print(f"distnb: {what} ignored: {why}.", file=sys.stderr, flush=True)
        return not why and not self.prompter.detached

    def set_trace(self, frame: FrameType | None = None, **_: Any) -> None:
        if os.environ.get("PYTHONBREAKPOINT") == "0" or not self._usable("breakpoint()"):
            return
        self.active = self.active or RankPdb(self.prompter)
        self.active.set_trace(frame or sys._getframe(1))

    def breakpoint(self, *args: Any, **kwargs: Any) -> None:
        self.set_trace(sys._getframe(1))

    def post_mortem(self, tb: TracebackType | None = None) -> None:
        tb = tb or sys.exc_info()[2] or getattr(sys, "last_traceback", None)
        if tb is None:
            raise ValueError("a traceback to debug is needed: call post_mortem() inside an except block.")
        if not self._usable("post_mortem()"):
            return
        debugger = RankPdb(self.prompter)
        self.prompter.mode = "post_mortem"
        try:
            debugger.reset()
            debugger.interaction(None, tb)
        finally:
            self.prompter.mode = "breakpoint"

    def before_collective(self, info: dict[str, Any], frame: FrameType) -> None:
        """The main thread is about to issue the collective ``info`` names, from ``frame``'s line:
        pause there (pdb's ``nc``, or the console's hold unless this rank was detached)."""
        if self.prompter.usable() or (info["why"] == "hold" and self.prompter.detached):
            return
        self.active = self.active or RankPdb(self.prompter)
        self.active.stop_before(frame, info)

    def end_cell(self) -> None:
        """The cell's code has returned: no more tracing (the rest is distnb's)."""
        STOPS.clear()
        if self.active is not None:
            sys.settrace(None)
            self.active = None


def hold_request(hooks: Hooks | None, msg: Hold) -> dict[str, Any]:
    """The control thread's HOLD: for the running cell, pause before the next collective ("hold",
    only a rank still running: one paused is the user's) or raise before one that needs ranks that
    left ("release"); says where the main thread is, read after the flag is set (see StopFlags)."""
    cell = hooks.prompter.current_cell() if hooks is not None else None
    if hooks is None or cell is None or cell != msg.get("cell"):
        return {"state": "finished"}
    paused = hooks.prompter.paused is not None
    if msg.get("mode") == "release":
        STOPS.why = str(msg.get("why", ""))
        STOPS.gone = STOPS.gone | frozenset(int(r) for r in msg.get("ranks", []))
    elif msg.get("mode") == "hold" and not paused and not hooks.prompter.detached:
        STOPS.hold = STOPS.hold or "hold"
    calling = STOPS.calling
    inside = calling[0] if calling is not None else next(iter(c10d_calls()), "")  # a collective the call log does not wrap
    reply: dict[str, Any] = {"state": "paused" if paused else "inside" if inside else "running", "inside": inside}
    if calling is not None and STOPS.gone:
        reply["needs"] = needs(*calling, STOPS.gone)  # the call it is in waits for a rank that left
    return reply


def quit_error(evalue: BaseException) -> bool:
    """Did the user quit pdb (``q``) in this cell?"""
    return isinstance(evalue, bdb.BdbQuit)


def install(prompter: Prompter) -> Hooks:
    """Route ``breakpoint()``, ``pdb.set_trace``/``post_mortem``/``pm``, ``input()`` and
    ``sys.stdin`` of this process to the notebook."""
    hooks = Hooks(prompter)
    STOPS.hook = hooks.before_collective
    sys.breakpointhook = hooks.breakpoint
    pdb.set_trace = hooks.set_trace
    pdb.post_mortem = hooks.post_mortem  # type: ignore[assignment]
    pdb.pm = lambda: hooks.post_mortem(getattr(sys, "last_traceback", None))
    builtins.input = prompter.input
    sys.stdin = _Stdin(prompter)
    return hooks
