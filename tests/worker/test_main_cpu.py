"""The main thread's busy share as the control thread reads it (worker/recorders/main_cpu.py): a
thread that computes reads busy whatever the machine's load, one asleep reads idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from distnb.analysis.verdicts.flow_rules import BUSY_CPU, IDLE_CPU
from distnb.worker.recorders.main_cpu import MIN_WINDOW, MainCpu


def _looked_from_another_thread(busy: bool, nap: float = 0.05) -> tuple[float | None, float]:
    """The share another thread reads over a window of the main thread's work, and the share
    the main thread itself measured it used (its own thread_time over the same wall time).

    The looker takes its second look while the main thread still works, as a rank's control thread
    does: a main thread that had stopped to wait for the looker (a join) would be read idle for the
    time the looker, on a loaded machine, waits for a CPU to wake on."""
    cpu = MainCpu()
    got: list[float | None] = []
    started, done = threading.Event(), threading.Event()

    def look() -> None:
        cpu.look()
        started.set()
        time.sleep(MIN_WINDOW * 3)
        got.append(cpu.look())
        done.set()

    t = threading.Thread(target=look)
    t.start()
    started.wait(30)
    wall0, cpu0 = time.monotonic(), time.thread_time()
    while not done.is_set() and time.monotonic() - wall0 < 60:
        if busy:
            sum(range(1000))
        else:
            time.sleep(nap)
    own = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
    t.join(30)
    return got[0], own


def test_a_computing_thread_reads_busy_and_a_sleeping_one_idle() -> None:
    busy, own = _looked_from_another_thread(busy=True)
    # Its time on a CPU (own) is part of it: the rest it waited for a CPU, on a loaded machine.
    # Well above what a verdict calls busy, not near 1.0: CI runs other work beside this suite.
    assert busy is not None and busy >= 2 * BUSY_CPU and busy >= own - 0.1, (busy, own)
    idle, _ = _looked_from_another_thread(busy=False)
    assert idle is not None and idle < 0.05, idle  # asleep: wants no CPU, whatever the load


def test_the_busy_share_holds_on_a_machine_busier_than_its_cores() -> None:
    """Three more busy processes than this machine has cores: the computing thread gets a fraction
    of a CPU, and still reads busy (the kernel counts its wait for one) — well above the share at
    which a verdict calls a rank busy, and above its time on a CPU alone. Not near 1.0: in a
    process with other Python threads (a rank's, this suite's pools) each GIL hand-off is a switch
    the thread made itself, and the wait that follows it counts only in the share of preemptions
    (CI read 0.76, its time on a CPU 0.33)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 2) + 3)]
    try:
        busy, own = _looked_from_another_thread(busy=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert busy is not None and busy >= 2 * BUSY_CPU and busy > own, (busy, own)


def test_a_thread_that_polls_and_sleeps_reads_idle_on_a_machine_busier_than_its_cores() -> None:
    """A loop that checks a flag and sleeps 20 ms waits for a CPU after every wake-up on a loaded
    machine: that wait is the machine's, not the thread's wish to compute (it asked for none)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 2) + 3)]
    try:
        idle, own = _looked_from_another_thread(busy=False, nap=0.02)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert idle is not None and idle <= IDLE_CPU, (idle, own)


def test_no_share_before_two_looks_a_window_apart() -> None:
    cpu = MainCpu()
    assert cpu.look() is None and cpu.look() is None  # the second within MIN_WINDOW of the first
