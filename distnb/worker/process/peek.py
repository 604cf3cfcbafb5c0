"""A look into a rank's main thread from its control thread: the frames it stands in now, and an
expression evaluated in one of them (``%dist_debug`` on an attached job, ``services/job_console.py``).

This is how a rank of a live job is debugged without being stopped: a rank hung in a collective
sits in native code, where no debugger can pause it (debugpy's pause lands only at the next Python
line), but its frames stand still, so its locals can be read from here. The expression runs on a
thread of its own, bounded by :data:`EVAL_TIMEOUT`, so one that waits (a collective, a lock the main
thread holds) never takes the control thread, and the rank's attachability, with it; it goes on in
the background, said so. Writes to a frame's locals reach it on Python 3.13 (PEP 667) only.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import pprint
import sys
import sysconfig
import threading
import traceback
from types import FrameType
from typing import Any, Callable, Iterator

from distnb.wire.protocol import Peek
from distnb.wire.record_types import PeekFrame, PeekRead

__all__ = ["DEBUGGER_DIR", "EVAL_TIMEOUT", "SWITCH_INTERVAL", "VALUE_CHARS", "peek", "quick_handoffs"]

#: Seconds an expression may run in the rank before the answer says it goes on in the background.
EVAL_TIMEOUT = 10.0
#: A value's text is cut here: a repr of a large object would make every answer slow.
VALUE_CHARS = 4000
#: The GIL's switch interval while a look is answered or debugpy starts (seconds; Python's default is 0.005).
SWITCH_INTERVAL = 0.0002
#: Lines ``source`` shows around the frame's line (pdb's ``list``: 11).
AROUND = 5

_DISTNB = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Not the user's code: the standard library, installed packages, distnb, the debugger.
_NOT_USER = tuple({os.path.join(os.path.realpath(p), "") for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                                    sysconfig.get_paths()["platlib"], _DISTNB)})
#: A debugger's frames (debugpy vendors pydevd): from the first of them in, the thread is held
#: where the user paused it.
DEBUGGER_DIR = f"{os.sep}debugpy{os.sep}"
#: distnb's wrappers around the job's calls (the call log's): never shown.
_WRAPPERS = os.path.join(_DISTNB, "worker", "")


def peek(msg: Peek) -> PeekRead:
    """Answer one look (``msg["what"]``) at the main thread's frames as they stand."""
    with quick_handoffs():
        return _peek(msg)


@contextlib.contextmanager
def quick_handoffs() -> Iterator[None]:
    """A short switch interval (the process's: every thread's, for as long as this lasts) for work
    beside a busy main thread. Each time this thread gives up the GIL (a file read, a socket call, a
    thread start), a main thread running pure Python (a live job's training loop) keeps it a whole
    switch interval (5 ms by default) before handing it back: starting debugpy took over a minute
    so, measured, instead of a second."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _peek(msg: Peek) -> PeekRead:
    frames = _main_frames()
    shown = [PeekFrame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, linecache.getline(f.f_code.co_filename, f.f_lineno).strip(),
                       _is_user(f.f_code.co_filename)) for f in frames]
    read: PeekRead = {"frames": shown}
    what = msg["what"]
    if what == "frames":
        return read
    index = msg.get("frame", len(frames) - 1)
    want = msg.get("want")
    if want and 0 <= index < len(frames) and _names(frames[index]) != tuple(want):
        # The rank ran on since the notebook read its frames: the same function's innermost frame, if still there.
        index = next((i for i in range(len(frames) - 1, -1, -1) if _names(frames[i]) == tuple(want)), -1)
        if index < 0:
            read["error"] = f"{want[1]} ({want[0]}) has returned since: `where` shows the frames now"
            return read
    if not frames or not 0 <= index < len(frames):
        read["error"] = f"no frame {index}: the main thread has {len(frames)} now"
        return read
    read["frame"] = index
    frame = frames[index]
    if what == "source":
        read["source"] = _lines(frame.f_code.co_filename, frame.f_lineno - AROUND, frame.f_lineno + AROUND)
    elif what == "function":
        try:
            lines, first = inspect.getsourcelines(frame.f_code)
            read["source"] = [(first + i, text.rstrip("\n")) for i, text in enumerate(lines)]
        except (OSError, TypeError) as exc:
            read["error"] = f"no source for {frame.f_code.co_name}: {exc}"
    elif what in ("eval", "exec", "pretty", "args", "locals"):
        read.update(_bounded(lambda: _value(frame, msg.get("expr", ""), what)))
    else:
        read["error"] = f"unknown look {what!r}"
    return read


def _names(frame: FrameType) -> tuple[str, str]:
    return frame.f_code.co_filename, frame.f_code.co_name


def _main_frames() -> list[FrameType]:
    """The main thread's frames, outermost first: up to where a debugger holding it paused took
    over (its frames, and the standard library's it waits in), without distnb's own wrappers."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    out: list[FrameType] = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    out.reverse()
    held = next((i for i, f in enumerate(out) if DEBUGGER_DIR in f.f_code.co_filename), len(out))
    return [f for f in out[:held] if not f.f_code.co_filename.startswith(_WRAPPERS)]


def _is_user(filename: str) -> bool:
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not os.path.realpath(filename).startswith(_NOT_USER)


def _lines(filename: str, first: int, last: int) -> list[tuple[int, str]]:
    return [(n, linecache.getline(filename, n).rstrip("\n")) for n in range(max(1, first), last + 1)
            if linecache.getline(filename, n) or n <= first]


def _value(frame: FrameType, expr: str, mode: str) -> str:
    """What a look asks of ``frame``: its arguments, its locals, or ``expr`` run in it."""
    if mode in ("args", "locals"):
        local = frame.f_locals
        if mode == "locals":
            return "\n".join(f"{n} = {_cut(_safe_repr(v))}" for n, v in sorted(local.items())) or "(no locals)"
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        return "\n".join(f"{n} = {_cut(_safe_repr(local[n]))}" for n in names if n in local) or "(no arguments)"
    try:
        code = compile(expr, "<%dist_debug>", "eval")
    except SyntaxError:
        if mode != "exec":
            raise
        # A statement (pdb's ``!x = 1``): run, no value. Its prints go to the rank's stdout.
        exec(compile(expr, "<%dist_debug>", "exec"), frame.f_globals, frame.f_locals)
        return ""
    value = eval(code, frame.f_globals, frame.f_locals)
    return _cut(pprint.pformat(value) if mode == "pretty" else _safe_repr(value))


def _bounded(work: Callable[[], str]) -> PeekRead:
    """``work`` on a thread of its own, bounded by EVAL_TIMEOUT: a repr or an expression that waits
    (a CUDA tensor behind a stalled stream, a lock the main thread holds) never holds this one."""
    out: PeekRead = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:  # the user's expression: its error is the answer
            out["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()

    worker = threading.Thread(target=run, name="distnb-peek", daemon=True)
    # Never traced or suspended by a debugger holding the rank: it reads the paused frames.
    worker.pydev_do_not_trace = True  # type: ignore[attr-defined]
    worker.is_pydev_daemon_thread = True  # type: ignore[attr-defined]
    worker.start()
    worker.join(EVAL_TIMEOUT)
    if worker.is_alive():
        return {"error": f"still running after {EVAL_TIMEOUT:g} s; it goes on in the rank in the background "
                         "(a call that waits: a collective, a CUDA copy, a lock the main thread holds?)"}
    return out


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}: {exc}>"


def _cut(text: str) -> str:
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + f" … ({len(text):,} characters)"
