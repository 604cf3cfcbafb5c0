"""How busy the rank's main thread has been lately: the share of one CPU it used between two looks.

A rank that runs Python code while the others wait for it in a collective is either slow (it
computes: its main thread uses the CPU) or stuck outside torch.distributed (a sleep, a lock, a
queue, I/O: it uses none). Its stack alone can't tell the two apart; its CPU time can. The control
thread reads it from /proc (the kernel's counters: no lock of the user's, no signal) each time it is
asked for stacks — the live watch asks about once a second while a cell runs.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["MainCpu"]

#: A share measured over less than this is noise (the kernel counts in ticks of 10 ms).
MIN_WINDOW = 0.3


class MainCpu:
    """The main thread's CPU share since the previous look (at least :data:`MIN_WINDOW` apart)."""

    def __init__(self) -> None:
        tid = threading.main_thread().native_id
        self._path = f"/proc/self/task/{tid}/stat"
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, float] | None = None
        self.share: float | None = None

    def _cpu_seconds(self) -> float | None:
        try:
            with open(self._path, "rb") as f:
                stat = f.read()
        except OSError:  # not Linux, or no /proc: unknown
            return None
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime (fields 14, 15)

    def look(self) -> float | None:
        """The share of one CPU the main thread used since the last look that counted (None until
        two looks lie :data:`MIN_WINDOW` apart)."""
        now, cpu = time.monotonic(), self._cpu_seconds()
        if cpu is None:
            return None
        if self._last is None:
            self._last = (now, cpu)
        elif now - self._last[0] >= MIN_WINDOW:
            self.share = max(0.0, cpu - self._last[1]) / (now - self._last[0])
            self._last = (now, cpu)
        return self.share
