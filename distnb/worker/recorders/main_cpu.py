"""How busy the rank's main thread has been lately: the share of the time between two looks it
ran, or waited for a CPU it was taken from.

A rank that runs Python code while the others wait for it in a collective is either slow (it
computes: its main thread wants the CPU) or stuck outside torch.distributed (a sleep, a lock, a
queue, I/O: it wants none). Its stack alone can't tell the two apart; the kernel's counters can,
read from /proc (no lock of the user's, no signal) each time the control thread is asked for
stacks — the live watch asks about once a second while a cell runs.

The time on a CPU alone depends on the machine's load: a thread computing on a 2-core machine
shared with five others gets 40% of a CPU and waits for one the other 60%. /proc's ``schedstat``
counts that wait too. But a thread that sleeps and wakes (a loop polling a flag every 20 ms) also
waits for a CPU after each wake-up, and on such a machine that wait alone came to 7–21% of the
time (measured here): the machine's wait, not a wish to compute. So the wait counts in the share
of the times the thread's CPU was taken from it (preempted), not of those it gave it up itself
(``status``' context switches). Where schedstat is missing (a kernel without scheduler
statistics) the CPU time alone stands in.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

__all__ = ["MainCpu", "ThreadTimes", "busy_share", "thread_times"]

#: A share measured over less than this is noise (the kernel counts in ticks of 10 ms).
MIN_WINDOW = 0.3


@dataclass(frozen=True)
class ThreadTimes:
    """What the kernel has counted of one thread so far."""

    on_cpu: float  # seconds it ran
    waiting: float  # seconds it was ready to run and waited for a CPU (0 where unknown)
    gave_up: int  # times it gave the CPU up itself: a sleep, a lock, I/O (voluntary switches)
    preempted: int  # times the CPU was taken from it (involuntary switches)


def thread_times(pid: int | str, tid: int) -> ThreadTimes | None:
    """Thread ``tid`` of process ``pid`` (``"self"``: this one) as /proc counts it; None without /proc."""
    base = f"/proc/{pid}/task/{tid}"
    switches = {b"voluntary_ctxt_switches:": 0, b"nonvoluntary_ctxt_switches:": 0}
    try:
        with open(f"{base}/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b"\t")
                if key in switches:
                    switches[key] = int(value)
    except (OSError, ValueError):
        pass
    gave_up, preempted = switches[b"voluntary_ctxt_switches:"], switches[b"nonvoluntary_ctxt_switches:"]
    try:
        with open(f"{base}/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return ThreadTimes(int(on_cpu) / 1e9, int(waiting) / 1e9, gave_up, preempted)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{base}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # not Linux, or no /proc: unknown
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return ThreadTimes((int(fields[11]) + int(fields[12])) / _TICK, 0.0, gave_up, preempted)  # utime, stime (fields 14, 15)


def busy_share(before: ThreadTimes, after: ThreadTimes, seconds: float) -> float:
    """The share of ``seconds`` the thread computed: its time on a CPU, and of its wait for one
    the part that followed preemption (a thread never switched out either ran all along or slept
    all along: its wait counts whole)."""
    waited = max(0.0, after.waiting - before.waiting)
    gave_up, preempted = max(0, after.gave_up - before.gave_up), max(0, after.preempted - before.preempted)
    if gave_up + preempted:
        waited *= preempted / (gave_up + preempted)
    return min(1.0, max(0.0, after.on_cpu - before.on_cpu + waited) / max(seconds, 1e-3))


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class MainCpu:
    """The main thread's busy share since the previous look (at least :data:`MIN_WINDOW` apart)."""

    def __init__(self) -> None:
        self._tid = threading.main_thread().native_id or 0
        self._last: tuple[float, ThreadTimes] | None = None
        self.share: float | None = None

    def look(self) -> float | None:
        """The share of the time the main thread computed since the last look that counted
        (:func:`busy_share`; None until two looks lie :data:`MIN_WINDOW` apart)."""
        now, times = time.monotonic(), thread_times("self", self._tid)
        if times is None:
            return None
        if self._last is None:
            self._last = (now, times)
        elif now - self._last[0] >= MIN_WINDOW:
            self.share = busy_share(self._last[1], times, now - self._last[0])
            self._last = (now, times)
        return self.share
