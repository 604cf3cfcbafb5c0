"""Where the ranks of a job without distnb's control thread are, read from outside: their Python
stacks through py-spy (``py-spy dump --json``: it reads the process's memory, pausing it for the
milliseconds of one read so the frames are not torn), and what its main thread did with the CPU over a short window
(/proc: blocked, spinning, stopped).

Reading twice, a window apart, tells a wait from a moment: a rank whose main thread stood in the
same frames at both reads and did not wake in between (its voluntary context switches, from
/proc) has waited there at least that long. Same frames alone prove nothing: a training loop
passes the same all_reduce line hundreds of times a second, and each pass wakes its thread. A
thread that spins (a whole CPU, never sleeping) in the same frames stands still too."""

from __future__ import annotations

import json
import linecache
import time
from dataclasses import dataclass

from distnb import _processes
from distnb.analysis.verdicts.stacks import Frame, ThreadStack
from distnb.services.native_stacks import py_spy_runs
from distnb.worker.recorders.main_cpu import busy_share, thread_times

__all__ = ["OUTSIDE_TIMEOUT", "Sample", "Seen", "look_from_outside"]

#: How long py-spy may take for every rank together (a Python-only dump takes ~50 ms a rank here;
#: a machine busy with the job itself is slower).
OUTSIDE_TIMEOUT = 15.0


@dataclass
class Sample:
    """One read of one rank: its threads (main first), or why there are none."""

    threads: list[ThreadStack]
    error: str = ""


@dataclass
class Seen:
    """What a look over a window saw of one rank."""

    rank: int
    pid: int
    threads: list[ThreadStack]
    error: str  # why there is no stack ("" when there is one)
    still: bool  # the main thread's frames were the same at both reads
    cpu: float | None  # the share of the window its main thread computed (main_cpu.busy_share)
    state: str | None  # stopped, traced, uninterruptible: why it can't run Python (None: it can)
    window: float  # seconds between the two reads


def _threads(dump: str, pid: int) -> list[ThreadStack]:
    threads = []
    for t in json.loads(dump):
        # py-spy lists frames innermost first; a ThreadStack keeps them outermost first.
        frames = [Frame(f["filename"], int(f.get("line") or 0), f["name"], linecache.getline(f["filename"], int(f.get("line") or 0)))
                  for f in reversed(t.get("frames") or [])]
        main = t.get("os_thread_id") == pid
        threads.append(ThreadStack(t.get("thread_name") or hex(int(t.get("thread_id") or 0)), main, frames, program=True))
    if threads and not any(t.main for t in threads):
        threads[-1].main = True  # py-spy gave no OS thread ids: the first thread started is listed last
    threads.sort(key=lambda t: not t.main)
    return threads


def _read(pids: dict[int, int], timeout: float) -> dict[int, Sample]:
    out = {}
    for r, (gave, text) in py_spy_runs(pids, ["--json"], timeout).items():
        if not gave:
            out[r] = Sample([], text)
            continue
        try:
            out[r] = Sample(_threads(text, pids[r]))
        except (ValueError, KeyError, TypeError) as exc:
            out[r] = Sample([], f"py-spy's answer could not be read ({type(exc).__name__}: {exc})")
    return out


#: At most this many wake-ups of the main thread over the window still count as standing still
#: (a timed wait that rechecks a flag now and then).
_STILL_WAKEUPS = 2
#: A main thread busy (main_cpu.busy_share) this share of the window spins: it never sleeps to wake.
_SPINNING = 0.9


def _where(sample: Sample) -> tuple[tuple[str, int, str], ...]:
    main = next((t for t in sample.threads if t.main), None)
    return tuple((f.filename, f.lineno, f.name) for f in main.frames) if main else ()


def look_from_outside(pids: dict[int, int], window: float = 1.0, timeout: float = OUTSIDE_TIMEOUT) -> dict[int, Seen]:
    """Each rank (``{rank: pid}``) read twice, ``window`` seconds apart: its stacks at the second
    read, whether its main thread stood still between them, and its CPU over the window."""
    t0 = time.monotonic()
    first = _read(pids, timeout)
    # Counted after the first read: py-spy's own pause of the thread is not one of its waits.
    before = {r: thread_times(pid, pid) for r, pid in pids.items()}
    time.sleep(max(0.0, window - (time.monotonic() - t0)))
    span = max(time.monotonic() - t0, 1e-3)
    after = {r: thread_times(pid, pid) for r, pid in pids.items()}
    second = _read(pids, timeout)
    seen = {}
    for r, pid in pids.items():
        b0, b1 = before[r], after[r]
        cpu = busy_share(b0, b1, span) if b0 is not None and b1 is not None else None
        slept = b0 is None or b1 is None or b1.gave_up - b0.gave_up <= _STILL_WAKEUPS
        a, b = first[r], second[r]
        still = bool(b.threads) and _where(a) == _where(b) and (slept or (cpu or 0.0) >= _SPINNING)
        seen[r] = Seen(r, pid, b.threads, b.error, still, cpu, _processes.process_state(pid), span)
    return seen
