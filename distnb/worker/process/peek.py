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
from typing import Any, Iterator

from distnb.wire.protocol import Peek
from distnb.wire.records import PeekFrame, PeekRead

__all__ = ["EVAL_TIMEOUT", "SWITCH_INTERVAL", "VALUE_CHARS", "peek", "quick_handoffs"]

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
_NOT_USER = tuple({os.path.realpath(p) for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                 sysconfig.get_paths()["platlib"], _DISTNB)})
#: A debugger's frames: from the first of them in, the thread is held where the user paused it.
_DEBUGGER = ("pydevd", "debugpy")
#: distnb's wrappers around the job's calls (the call log's): never shown.
_WRAPPERS = os.path.join("distnb", "worker")


def peek(msg: Peek) -> PeekRead:
    """Answer one look (``msg["what"]``) at the main thread's frames as they stand."""
    with quick_handoffs():
        return _peek(msg)


@contextlib.contextmanager
def quick_handoffs() -> Iterator[None]:
    """A short switch interval for this thread's work beside a busy main thread. Each time it gives
    up the GIL (a file read, a socket call, a thread start), a main thread running pure Python (a
    live job's training loop) keeps it a whole switch interval (5 ms by default) before handing it
    back: starting debugpy took over a minute so, measured, instead of a second."""
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
    if not frames or not 0 <= index < len(frames):
        read["error"] = f"no frame {index}: the main thread has {len(frames)} now"
        return read
    frame = frames[index]
    if what == "source":
        read["source"] = _lines(frame.f_code.co_filename, frame.f_lineno - AROUND, frame.f_lineno + AROUND)
    elif what == "function":
        try:
            lines, first = inspect.getsourcelines(frame.f_code)
            read["source"] = [(first + i, text.rstrip("\n")) for i, text in enumerate(lines)]
        except (OSError, TypeError) as exc:
            read["error"] = f"no source for {frame.f_code.co_name}: {exc}"
    elif what == "args":
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        local = frame.f_locals
        read["value"] = "\n".join(f"{n} = {_cut(repr(local[n]))}" for n in names if n in local) or "(no arguments)"
    elif what == "locals":
        read["value"] = "\n".join(f"{n} = {_cut(_safe_repr(v))}" for n, v in sorted(frame.f_locals.items())) or "(no locals)"
    elif what in ("eval", "exec", "pretty"):
        read.update(_run(frame, msg.get("expr", ""), what))
    else:
        read["error"] = f"unknown look {what!r}"
    return read


def _main_frames() -> list[FrameType]:
    """The main thread's frames, outermost first: up to where a debugger holding it paused took
    over (its frames, and the standard library's it waits in), without distnb's own wrappers."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    out: list[FrameType] = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    out.reverse()
    held = next((i for i, f in enumerate(out) if any(part in f.f_code.co_filename for part in _DEBUGGER)), len(out))
    return [f for f in out[:held] if _WRAPPERS not in f.f_code.co_filename]


def _is_user(filename: str) -> bool:
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not os.path.realpath(filename).startswith(_NOT_USER)


def _lines(filename: str, first: int, last: int) -> list[tuple[int, str]]:
    return [(n, linecache.getline(filename, n).rstrip("\n")) for n in range(max(1, first), last + 1)
            if linecache.getline(filename, n) or n <= first]


def _run(frame: FrameType, expr: str, mode: str) -> PeekRead:
    """Evaluate ``expr`` in ``frame`` on a thread of its own, bounded by EVAL_TIMEOUT."""
    out: PeekRead = {}

    def work() -> None:
        try:
            try:
                code = compile(expr, "<%dist_debug>", "eval")
            except SyntaxError:
                if mode != "exec":
                    raise
                # A statement (pdb's ``!x = 1``): run, no value. Its prints go to the rank's stdout.
                exec(compile(expr, "<%dist_debug>", "exec"), frame.f_globals, frame.f_locals)
                out["value"] = ""
                return
            value = eval(code, frame.f_globals, frame.f_locals)
            out["value"] = _cut(pprint.pformat(value) if mode == "pretty" else _safe_repr(value))
        except BaseException as exc:  # the user's expression: its error is the answer
            out["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()

    worker = threading.Thread(target=work, name="distnb-peek", daemon=True)
    # Never traced or suspended by a debugger holding the rank: it reads the paused frames.
    worker.pydev_do_not_trace = True  # type: ignore[attr-defined]
    worker.is_pydev_daemon_thread = True  # type: ignore[attr-defined]
    worker.start()
    worker.join(EVAL_TIMEOUT)
    if worker.is_alive():
        return {"error": f"still running after {EVAL_TIMEOUT:g} s; it goes on in the rank in the background "
                         "(a call that waits: a collective, a lock the main thread holds?)"}
    return out


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}: {exc}>"


def _cut(text: str) -> str:
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + f" … ({len(text):,} characters)"
