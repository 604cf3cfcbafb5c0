"""distnb's background threads in a rank, and the rank's exit.

A daemon thread that is inside torch's C++ code (a Flight Recorder dump, which symbolizes its
stack traces and can take seconds on a busy machine; a group's sequence number) when the job's
script ends is the one way distnb could kill the rank it watches: the interpreter finalizes,
the thread returns from C++ wanting the GIL, CPython ends it with ``pthread_exit``, and the
forced unwind through pybind11's ``noexcept`` GIL guard calls ``std::terminate`` — "terminate
called without an active exception", SIGABRT, and torchrun reports the job failed.

So every such piece of work runs under :func:`torch_work`, and at exit (``atexit``: before
finalization, while daemon threads still run) :func:`close` waits for the one in flight and lets
no new one start. ``atexit`` runs its handlers last-registered first; this one is registered when
this module is first imported, before the job's own, so it runs after them: their work may
still ask distnb for nothing more.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Iterator

__all__ = ["EXIT_WAIT", "close", "closing", "torch_work"]

#: How long the exit waits for a read in flight (a Flight Recorder dump on a busy machine takes
#: seconds). Past it the rank exits anyway: a job is never held at its end by distnb for long.
EXIT_WAIT = 20.0

_lock = threading.Lock()
_closed = threading.Event()


@contextlib.contextmanager
def torch_work() -> Iterator[bool]:
    """Hold off the rank's exit while the body runs; yields False once the rank is exiting (the
    body must then do nothing: its thread should end)."""
    with _lock:
        yield not _closed.is_set()


def closing() -> bool:
    """Whether the rank has begun to exit."""
    return _closed.is_set()


def close(timeout: float = EXIT_WAIT) -> bool:
    """Let no new piece of work start, and wait up to ``timeout`` for the one in flight; whether
    it ended in time."""
    _closed.set()
    if _lock.acquire(timeout=timeout):
        _lock.release()
        return True
    return False


atexit.register(close)
