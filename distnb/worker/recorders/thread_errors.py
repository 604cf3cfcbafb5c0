"""Uncaught exceptions of a rank's other threads, kept for the cell they happened in.

A thread that raises ends there: Python prints its traceback to stderr (``threading.excepthook``)
and the main thread goes on, so a collective that thread was to make never comes and the other
ranks wait for it. The verdict can name the thread and its error only if someone kept them: this
hook does, chained in front of the one installed before it (which still prints), and it never
raises — it runs on the user's thread, as the thread dies.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from distnb.wire.record_types import ThreadError

__all__ = ["ThreadErrors"]

#: A thread error's message is kept to this many characters (a repr of a tensor can be megabytes).
_MESSAGE = 300
#: Errors kept between two cells at most: a thread raising in a loop must not grow the rank's memory.
_KEPT = 16


class ThreadErrors:
    """``threading.excepthook``, chained: each uncaught exception of a thread other than the main
    one is kept with the thread's name and its innermost line in a notebook cell."""

    def __init__(self, prefix: str, cell: Callable[[], int | None]) -> None:
        self._prefix = prefix  # the notebook cells' file names start so (distnb.wire.cell_code.CELL_PREFIX)
        self._cell = cell  # the cell running now, if any
        self._lock = threading.Lock()
        self._errors: list[ThreadError] = []
        self._previous: Callable[[Any], object] | None = None

    def install(self) -> None:
        self._previous = threading.excepthook
        threading.excepthook = self._hook

    def take(self) -> list[ThreadError]:
        """The errors kept since the last take (a cell's end), and forget them."""
        with self._lock:
            taken, self._errors = self._errors, []
        return taken

    def peek(self) -> list[ThreadError]:
        """The errors kept so far (a running cell's, for a live diagnosis)."""
        with self._lock:
            return list(self._errors)

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        try:
            self._keep(args)
        except Exception:  # noqa: S110 - a record lost, never the thread's own report
            pass
        (self._previous or threading.__excepthook__)(args)

    def _keep(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.thread is threading.main_thread():
            return  # Python ignores a thread's SystemExit; the main thread's error is the cell's own
        if args.thread is not None and args.thread.name.startswith("distnb-"):
            return  # distnb's own (each says its failure itself): no thread of the user's program
        cell = line = None
        func = ""
        tb = args.exc_traceback
        while tb is not None:  # the innermost frame in a notebook cell: where the user's code raised
            name = tb.tb_frame.f_code.co_filename
            if name.startswith(self._prefix):
                cell, line, func = int(name[len(self._prefix):-1]), tb.tb_lineno, tb.tb_frame.f_code.co_name
            tb = tb.tb_next
        error: ThreadError = {"thread": args.thread.name if args.thread is not None else "?", "ename": args.exc_type.__name__,
                              "evalue": str(args.exc_value)[:_MESSAGE], "cell": cell, "line": line, "func": func,
                              "during": self._cell()}
        with self._lock:
            if len(self._errors) < _KEPT:
                self._errors.append(error)
