"""Small Linux process helpers used on both sides (imports nothing from distnb)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import threading
from typing import Any

__all__ = ["descendants", "pid_alive", "popen_with_parent_death", "session_pids", "set_parent_death_signal", "signal_meaning"]

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits.

    Safe to call from ``preexec_fn`` (only async-signal-safe work). Returns False where the
    platform has no prctl, in which case heartbeat loss is the only safety net.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_spawn_queue: "queue.Queue[tuple[list[str], dict[str, Any], queue.Queue[Any]]]" = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawn_loop() -> None:
    while True:
        args, kwargs, reply = _spawn_queue.get()
        try:
            reply.put(subprocess.Popen(args, **kwargs))
        except BaseException as exc:  # handed back to the caller
            reply.put(exc)


def popen_with_parent_death(args: list[str], sig: int = signal.SIGTERM, **kwargs: Any) -> "subprocess.Popen[bytes]":
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
    reply: "queue.Queue[Any]" = queue.Queue()
    _spawn_queue.put((args, {**kwargs, "preexec_fn": lambda: set_parent_death_signal(sig)}, reply))
    out = reply.get()
    if isinstance(out, BaseException):
        raise out
    return out


_SIGNAL_MEANINGS = {
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
