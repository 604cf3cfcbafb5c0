"""gloo's transport threads at rest: a timer slack that lets an idle group sleep.

Every gloo device runs a loop thread that calls ``epoll_wait`` with a hard-coded 10 ms timeout
(``gloo/transport/tcp/loop.cc``), only to look at its stop flag: 100 wake-ups a second per group
per rank, ~20 ms of CPU a second for an idle 8-rank pool on 2 cores, four fifths of all it used.
I/O wakes the loop at once whatever the timeout, so the timer's precision buys nothing.

Linux lets a thread's timers fire late by its *timer slack* (``PR_SET_TIMERSLACK``; ``epoll_wait``
honours it), and a new thread inherits its creator's slack. So a gloo group is created with a
large slack on the creating thread, which gets its own back at once: only the threads the group
starts keep it, the loop thread and the group's worker threads, whose waits all end by a notify,
never by their timeouts.

The one price: gloo closes each connection by waiting for a loop tick, so destroying a group at 8
ranks takes ~0.85 s instead of ~0.09 s. Where the process may set another thread's slack
(``CAP_SYS_NICE``: root, most containers), the loops get the default back for the destroy.

``DISTNB_GLOO_TIMER_SLACK_MS`` (default 100; 0 turns this off) is the slack.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import sys
from typing import Any, Callable, Iterator

from distnb.worker.torch_hooks.patching import wrap_c10d

__all__ = ["DEFAULT_SLACK_NS", "slack_ns", "gloo_creation", "install"]

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30
#: The kernel's default timer slack (50 µs).
DEFAULT_SLACK_NS = 50_000
#: gloo names its loop thread so (``/proc/self/task/*/comm``).
_LOOP_THREAD = "gloo_tcp_loop"

_prctl: Callable[..., int] | None = None
if sys.platform == "linux":
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def slack_ns() -> int:
    """The slack for gloo's threads, from ``DISTNB_GLOO_TIMER_SLACK_MS`` (0: leave them be)."""
    raw = os.environ.get("DISTNB_GLOO_TIMER_SLACK_MS", "100")
    try:
        ms = float(raw)
    except ValueError:
        print(f"distnb: DISTNB_GLOO_TIMER_SLACK_MS={raw!r} is not a number of milliseconds; using 100.",
              file=sys.stderr, flush=True)
        ms = 100.0
    return max(0, int(ms * 1_000_000))


@contextlib.contextmanager
def _thread_slack(ns: int) -> Iterator[None]:
    """This thread's timer slack is ``ns`` inside, its own again after."""
    if _prctl is None or ns <= 0:
        yield
        return
    own = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)
    try:
        yield
    finally:
        _prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(own if own > 0 else DEFAULT_SLACK_NS), 0, 0, 0)


def _is_gloo(backend: Any) -> bool:
    """Whether a group made with ``backend`` (None: the default group's) is gloo's alone."""
    if backend is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        backend = dist.get_backend()
    return str(backend).lower() == "gloo"


#: Threads gloo started while creating a group, when its loop thread has no name of its own
#: (torch before 2.12): the destroy's prompt ticks reach them by these ids.
_started: set[str] = set()


def gloo_creation(backend: Any) -> contextlib.AbstractContextManager[None]:
    """Wrap the creation of a process group: a gloo group's threads get the idle slack.

    NCCL's are left alone: its proxy and watchdog threads are not known to wait only on events."""
    return _gloo_creation() if _is_gloo(backend) else contextlib.nullcontext()


@contextlib.contextmanager
def _gloo_creation() -> Iterator[None]:
    before = _tasks()
    with _thread_slack(slack_ns()):
        yield
    _started.update(_tasks() - before)


def _tasks() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def _loop_threads() -> list[str]:
    """gloo's loop threads by their name; where torch's gloo leaves them unnamed, the threads
    gloo group creations started that still run."""
    out, alive = [], _tasks()
    for tid in alive:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _LOOP_THREAD:
                    out.append(tid)
        except OSError:
            continue  # the thread ended meanwhile
    _started.intersection_update(alive)
    return out or sorted(_started)


def _set_loops(ns: int) -> None:
    for tid in _loop_threads():
        try:
            with open(f"/proc/{tid}/timerslack_ns", "w") as f:
                f.write(str(ns))
        except OSError:
            return  # not permitted (no CAP_SYS_NICE): the destroy is slower, nothing worse


@contextlib.contextmanager
def _prompt_loops() -> Iterator[None]:
    """gloo's loops tick promptly inside (a destroy waits a tick per connection); the loops still
    running after it sleep again."""
    ns = slack_ns()
    if _prctl is None or ns <= 0:
        yield
        return
    _set_loops(DEFAULT_SLACK_NS)
    try:
        yield
    finally:
        _set_loops(ns)


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if name == "destroy_process_group":
        def call(*args: Any, **kwargs: Any) -> Any:
            with _prompt_loops():
                return original(*args, **kwargs)
    else:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                backend = signature.bind_partial(*args, **kwargs).arguments.get("backend")
            except TypeError:  # a wrong call: torch's own words for it, below
                backend = None
            if name == "init_process_group" and backend is None:
                backend = "gloo" if not _cuda_default() else None
            with gloo_creation(backend):
                return original(*args, **kwargs)

    functools.update_wrapper(call, original)
    return call


def _cuda_default() -> bool:
    """``init_process_group()`` without a backend picks NCCL beside gloo where CUDA is there."""
    import torch

    return bool(torch.cuda.is_available())


#: What creates or destroys a group, wrapped where torch and the user find them.
_WRAPPED = ("init_process_group", "new_group", "split_group", "destroy_process_group")
_MARK = "__distnb_gloo_idle__"


def install() -> None:
    """Give the gloo groups a cell makes (``new_group``, ``init_process_group`` after a
    ``destroy_process_group``, a ``DeviceMesh``'s dimensions) the same idle slack, and their
    destroys prompt loops."""
    if _prctl is None or slack_ns() <= 0:
        return
    wrap_c10d(_WRAPPED, _wrap, _MARK)
    _wrap_imported()


def _wrap_imported() -> None:
    """The modules of torch.distributed that imported a creation function by name before distnb
    wrapped it call the original past the wrapper: ``device_mesh`` (``from distributed_c10d import
    new_group``), loaded with ``torch.distributed`` itself, makes every mesh dimension's group so,
    and each of those gloo loops woke 100 times a second (measured after an FSDP2 + TP cell). Theirs
    get the slack alone (the call log is not put on calls torch makes for itself)."""
    from torch.distributed import distributed_c10d as c10d

    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("torch.distributed.") or module is c10d:
            continue
        for name in _WRAPPED:
            fn = (getattr(module, "__dict__", None) or {}).get(name)
            if not callable(fn) or getattr(fn, "__module__", None) != c10d.__name__ or hasattr(fn, _MARK):
                continue
            try:
                wrapped = _wrap(name, fn)
                setattr(wrapped, _MARK, fn)
                setattr(module, name, wrapped)
            except Exception:  # an odd binding keeps torch's own: its groups idle at the default slack, nothing worse
                continue
