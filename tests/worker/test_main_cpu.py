"""The main thread's CPU share as the control thread reads it (worker/recorders/main_cpu.py)."""

from __future__ import annotations

import threading
import time

from distnb.worker.recorders.main_cpu import MIN_WINDOW, MainCpu


def _looked_from_another_thread(busy: bool) -> tuple[float | None, float]:
    """The share another thread reads over a window of the main thread's work, and the share
    the main thread itself measured it used (its own thread_time over the same wall time)."""
    cpu = MainCpu()
    got: list[float | None] = []
    started, done = threading.Event(), threading.Event()

    def look() -> None:
        cpu.look()
        started.set()
        done.wait(30)
        got.append(cpu.look())

    t = threading.Thread(target=look)
    t.start()
    started.wait(30)
    wall0, cpu0 = time.monotonic(), time.thread_time()
    while time.monotonic() - wall0 < MIN_WINDOW * 3:
        if busy:
            sum(range(1000))
        else:
            time.sleep(0.05)
    own = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
    done.set()
    t.join(30)
    return got[0], own


def test_the_share_read_from_another_thread_is_what_the_main_thread_used() -> None:
    # Against the main thread's own measure, not a fixed bound: on a loaded machine a busy
    # thread gets less than a CPU, and the reading must say so too.
    busy, own = _looked_from_another_thread(busy=True)
    assert busy is not None and abs(busy - own) < 0.15 + 0.1 * own, (busy, own)
    idle, _ = _looked_from_another_thread(busy=False)
    assert idle is not None and idle < 0.05, idle  # asleep: no CPU, whatever the load


def test_no_share_before_two_looks_a_window_apart() -> None:
    cpu = MainCpu()
    assert cpu.look() is None and cpu.look() is None  # the second within MIN_WINDOW of the first
