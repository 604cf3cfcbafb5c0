"""Exceptions distnb caught in its own code and survived: counted and kept, never shown in a cell.

A best-effort part of the notebook side (the live diagnosis while a cell runs, the diagnosis of
ranks still running at a cell's timeout, the I/O thread's handlers) must not fail the user's
cell, and its exception text is not the user's business either: "could not diagnose: int()
argument must be …" in a saved notebook reads as a verdict. It is a bug in distnb, so it goes
where a bug report starts: ``%dist_status`` says how many there were and the last one's first and
last lines, and ``Pool.internal_errors.last`` holds its whole traceback.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

__all__ = ["InternalErrors"]

#: Distinct failure sites logged at ERROR (once each); repeats only at DEBUG, so a handler that
#: fails on every tick can't flood the notebook with one traceback a second.
LOGGED_SITES_MAX = 64


class InternalErrors:
    """Call :meth:`caught` inside an ``except`` block: the exception being handled is counted and
    kept. ``log``: a logger told of each new failure site once at ERROR (the I/O thread's, whose
    failures may stop a pool from hearing its ranks), else None (kept only)."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._log = log
        self._lock = threading.Lock()  # the I/O thread and the notebook's thread both report
        self.count = 0
        #: The last one as text: when (local HH:MM:SS), what was being done, and the traceback.
        self.last: str | None = None
        self._sites: set[tuple[str, str, int]] = set()

    def caught(self, what: str) -> None:
        text = traceback.format_exc()
        tb = traceback.extract_tb(sys.exc_info()[2])
        site = (what, tb[-1].filename, tb[-1].lineno or 0) if tb else (what, "", 0)
        with self._lock:
            self.count += 1
            self.last = f"{time.strftime('%H:%M:%S')} in {what}:\n{text}"
            new = site not in self._sites and len(self._sites) < LOGGED_SITES_MAX
            if new:
                self._sites.add(site)
        if self._log is not None:
            if new:
                self._log.error("distnb: error in %s (the pool keeps running; pool status shows the last one):\n%s", what, text.rstrip())
            else:
                self._log.debug("distnb: error in %s again:\n%s", what, text.rstrip())
