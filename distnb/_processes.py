"""Small Linux process helpers used on both sides (imports nothing from distnb)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator, MutableSet
from typing import Any, NamedTuple

__all__ = [
    "KnownProcesses",
    "ProcEntry",
    "descendants",
    "pid_alive",
    "popen_with_parent_death",
    "process_table",
    "same_process",
    "session_pids",
    "set_parent_death_signal",
    "signal_main_thread",
    "signal_meaning",
    "signal_process",
    "start_time",
]

_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits.

    Safe to call from ``preexec_fn`` (only async-signal-safe work). Returns False where the
    platform has no prctl, in which case heartbeat loss is the only safety net.
    """
    try:
        return _libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


#: tgkill's system call number, by machine (Linux has no libc wrapper before glibc 2.30).
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131, "ppc64le": 250, "s390x": 241}


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (on Linux its thread id is its pid).

    ``os.kill`` lets the kernel hand the signal to any thread of the process; a faulthandler dump
    must run on the thread whose stack it reads (see worker/process/rank.py). Falls back to
    ``os.kill`` where tgkill can't be called."""
    number = _SYS_TGKILL.get(os.uname().machine)
    if number is not None:
        try:
            if _libc().syscall(number, pid, pid, int(sig)) == 0:
                return
            if ctypes.get_errno() == 3:  # ESRCH: gone
                raise ProcessLookupError(pid)
        except (OSError, AttributeError):
            pass
    os.kill(pid, sig)


_spawn_queue: queue.Queue[tuple[list[str], dict[str, Any], queue.Queue[Any]]] = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawn_loop() -> None:
    while True:
        args, kwargs, reply = _spawn_queue.get()
        try:
            reply.put(subprocess.Popen(args, **kwargs))
        except BaseException as exc:  # handed back to the caller
            reply.put(exc)


def popen_with_parent_death(args: list[str], sig: int = signal.SIGTERM, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` whose child gets ``sig`` when this process dies.

    The kernel sends the parent-death signal when the *thread* that forked exits, not the
    process; so children are forked from one thread that lives as long as the process, and a
    pool started from a short-lived thread is not killed when that thread ends.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_loop, name="distnb-spawner", daemon=True)
            _spawner.start()
    reply: queue.Queue[Any] = queue.Queue()
    _spawn_queue.put((args, {**kwargs, "preexec_fn": lambda: set_parent_death_signal(sig)}, reply))
    out = reply.get()
    if isinstance(out, BaseException):
        raise out
    return out


_SIGNAL_MEANINGS: dict[int, str] = {
    signal.SIGKILL: "killed (SIGKILL: kill -9, or the kernel's OOM killer)",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGABRT: "aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors)",
    signal.SIGSEGV: "segmentation fault (SIGSEGV: invalid memory access in native code)",
    signal.SIGBUS: "bus error (SIGBUS: bad memory access, often /dev/shm full)",
    signal.SIGFPE: "floating point exception (SIGFPE)",
    signal.SIGILL: "illegal instruction (SIGILL)",
    signal.SIGINT: "interrupted (SIGINT)",
    signal.SIGHUP: "hang-up (SIGHUP)",
    signal.SIGPIPE: "broken pipe (SIGPIPE)",
}


def signal_meaning(returncode: int | None) -> str:
    """Plain words for a process's return code (negative = killed by a signal)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return _SIGNAL_MEANINGS.get(sig, f"killed by {name}")
    if returncode == 0:
        return "exited normally (code 0)"
    if returncode > 128 and returncode - 128 in _SIGNAL_MEANINGS:
        return f"exit code {returncode} (shell convention for {_SIGNAL_MEANINGS[returncode - 128]})"
    return f"exited with code {returncode}"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state letter follows the command name, which is in parentheses and may hold spaces.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, session, …), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces and ")": split after the last ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields if len(fields) > 19 else None


_STATES = {
    b"T": "stopped (SIGSTOP, Ctrl-Z or a job-control signal); SIGCONT resumes it",
    b"t": "stopped by a debugger (ptrace)",
    b"D": "in uninterruptible sleep in the kernel (disk or network file system I/O, or a driver call)",
}


def process_state(pid: int) -> str | None:
    """Why a live process can't run Python at all, from its /proc state: stopped, traced, or in
    uninterruptible sleep; None for a process that can run (or is gone)."""
    fields = _stat_fields(pid)
    return _STATES.get(fields[0]) if fields is not None else None


# Field 22 of /proc/PID/stat (1-based, counting pid and comm) is the start time in clock ticks
# since boot; in the fields after the command name (which start at field 3) it is index 19.
_START = 22 - 3


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), zombies included; None if there is no such process.

    A PID number is reused once its process is reaped; the pair (pid, start time) is not, so it
    names one process for as long as the machine is up.
    """
    fields = _stat_fields(pid)
    return int(fields[_START]) if fields is not None else None


def _kib_field(path: str, key: bytes) -> int | None:
    """A ``Key:  123 kB`` line of a /proc file, in bytes; None when the file or line is missing."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_of(pid: int) -> int | None:
    """The process's resident memory (bytes), None if it is gone."""
    return _kib_field(f"/proc/{pid}/status", b"VmRSS:")


def memory_available() -> int | None:
    """What this machine can still give processes without swapping (MemAvailable, bytes)."""
    return _kib_field("/proc/meminfo", b"MemAvailable:")


def same_process(pid: int, started: int | None) -> bool:
    """True while the process that had start time ``started`` still runs as ``pid`` (not a zombie)."""
    if started is None:
        return False
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != b"Z" and int(fields[_START]) == started


def signal_process(pid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``started``.

    Returns whether the signal was sent. With a pidfd (Linux >= 5.3) there is no window at all:
    the pidfd pins the process that held the number when it was opened, the start time is checked
    after opening it, and a signal through it can only reach that process. Without one, the check
    and ``kill`` are microseconds apart, against a PID space that would have to wrap around in between.
    """
    if started is None:
        return False
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is not None and send is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            fd = -1  # e.g. a seccomp filter refusing pidfd_open: fall back to kill
        if fd >= 0:
            try:
                if start_time(pid) != started:
                    return False
                send(fd, sig)
                return True
            except ProcessLookupError:
                return False
            finally:
                os.close(fd)
    if start_time(pid) != started:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class ProcEntry(NamedTuple):
    ppid: int
    sid: int
    start: int


def process_table() -> dict[int, ProcEntry]:
    """Every live (non-zombie) process: its parent, session and start time, from one /proc scan."""
    out: dict[int, ProcEntry] = {}
    for pid, fields in _proc_stats():
        if len(fields) > _START:
            out[pid] = ProcEntry(int(fields[1]), int(fields[3]), int(fields[_START]))
    return out


class KnownProcesses(MutableSet[int]):
    """A set of PIDs that remembers which process each one named: its start time, read when added.

    Membership and iteration are by PID number (so ``set`` operations keep working); ``alive()``
    and :func:`signal_process` with ``started(pid)`` only ever reach the original processes, never
    an unrelated one that got the number after ours was reaped.
    """

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self._started: dict[int, int | None] = {}
        for pid in pids:
            self.add(pid)

    def add(self, pid: int, started: int | None = None) -> None:
        """Remember ``pid``; its start time is read now unless given (None when it is already gone:
        such an entry is never signalled, since whatever holds the number later is not ours)."""
        if started is None and pid in self._started:
            return  # first sighting wins: a later read could already be of a reused number
        self._started[pid] = started if started is not None else start_time(pid)

    def update(self, pids: dict[int, int] | Iterable[int]) -> None:
        """Add many: a ``{pid: start time}`` dict (from :func:`process_table`) or plain PIDs."""
        if isinstance(pids, dict):
            for pid, started in pids.items():
                self.add(pid, started)
        else:
            for pid in pids:
                self.add(pid)

    def discard(self, pid: int) -> None:
        self._started.pop(pid, None)

    def started(self, pid: int) -> int | None:
        return self._started.get(pid)

    def items(self) -> list[tuple[int, int | None]]:
        return list(self._started.items())

    def alive(self) -> list[int]:
        """The PIDs whose original process still runs, sorted."""
        # A copy first: the controller's I/O thread adds PIDs while other threads ask.
        return sorted(pid for pid, started in list(self._started.items()) if same_process(pid, started))

    def is_alive(self, pid: int) -> bool:
        return same_process(pid, self._started.get(pid))

    def __contains__(self, pid: object) -> bool:
        return pid in self._started

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._started))

    def __len__(self) -> int:
        return len(self._started)

    def __repr__(self) -> str:
        return f"KnownProcesses({self._started!r})"


def _proc_stats() -> list[tuple[int, list[bytes]]]:
    """(pid, stat fields after the command name) for every live process: state, ppid, pgrp, session…"""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after its last ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 3 and fields[0] != b"Z":
            out.append((int(name), fields))
    return out


def listening_ports() -> set[int]:
    """TCP ports some process on this machine listens on (IPv4 and IPv6), from /proc/net: what a
    pool's controller leaves open, for the leak checks."""
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:  # no IPv6 on this machine
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":  # TCP_LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    return [pid for pid, fields in _proc_stats() if int(fields[3]) == sid]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for child, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
