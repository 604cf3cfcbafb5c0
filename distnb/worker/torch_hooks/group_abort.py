"""Abort a rank's NCCL communicators without risking the rank.

``torch.distributed.distributed_c10d._abort_process_group()`` aborts every backend and then
forgets the groups on the Python side. The abort itself can block: seen on an H100 (torch 2.11,
NCCL 2.28) on the rank whose peer had timed out, while NCCL's watchdog was still busy with the
Flight Recorder dump that the timeout triggered — and a regroup waiting on it never ends. So the
backends are aborted on a helper thread, waited for a bounded time, and the Python-side cleanup
(the same steps torch takes) is done by the caller either way: a late abort then touches only the
old, abandoned communicators, never the new group.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ESCALATE_AFTER", "abort_backends", "forget_groups"]

#: Seconds an interrupted cell may stay put (its KeyboardInterrupt not raised: the main thread
#: waits in C++ for a collective's peers) before distnb aborts the rank's NCCL communicators, or
#: shuts down its gloo connections, so the cell can stop (worker/process/control.py).
ESCALATE_AFTER = 2.0


#: Groups whose abort outlived its wait: kept here for the life of the process, so that the helper
#: thread still aborting them never holds their last reference (see abort_backends).
_abandoned: list[Any] = []


def abort_backends(timeout: float) -> bool:
    """Abort every process group's backend (NCCL inside one group call, as torch does: aborts of
    several communicators must not deadlock each other); True if that finished in ``timeout``.

    The helper thread never holds the last reference to a group: a group's destructor releases the
    GIL, and a daemon thread that takes it back while the interpreter finalizes is ended by
    ``pthread_exit`` inside a ``noexcept`` destructor — ``std::terminate``, the rank killed by
    SIGABRT at its exit (seen on torch 2.11: the thread's last act, dropping its target, dropped
    the groups the main thread had just forgotten). So the groups travel in a list the caller
    empties once the thread is done with them; a wait that runs out leaves them to
    ``_abandoned``. (Not the exit guard's lock: the control thread, which calls this, holds it.)"""
    from torch.distributed import distributed_c10d as c10d

    held: list[Any] = [sorted(c10d._world.pg_names, key=lambda pg: c10d._world.pg_names[pg], reverse=True), c10d._world.default_pg]
    done = threading.Event()

    def run() -> None:
        try:
            _abort(held[0], held[1])
        except Exception:
            pass  # an already-aborted communicator may complain; it is gone either way
        finally:
            done.set()

    threading.Thread(target=run, name="distnb-abort", daemon=True).start()
    finished = done.wait(timeout)
    if not finished:
        _abandoned.append(list(held))
    held.clear()
    return finished


def _abort(groups: list[Any], default: Any) -> None:
    import torch
    from torch.distributed import distributed_c10d as c10d

    nccl = None
    try:
        if default is not None and c10d.is_nccl_available():
            backend = default._get_backend(torch.device("cuda"))
            nccl = backend if isinstance(backend, c10d.ProcessGroupNCCL) else None
    except RuntimeError:
        nccl = None
    if nccl is not None:
        nccl._group_start()
    for pg in groups:
        pg.abort()
    if nccl is not None:
        nccl._group_end()


def forget_groups() -> None:
    """Forget every process group on the Python side, as ``_abort_process_group`` does after its
    abort (the group counter too, so the new groups get the names the other ranks give theirs)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
