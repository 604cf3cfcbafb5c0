"""Replace a rank's poisoned default process group with a fresh one, keeping the process."""

from __future__ import annotations

import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

from distnb.worker.torch_hooks.call_log import CallLog
from distnb.worker.torch_hooks.pasted import distnb_calls

__all__ = ["ABORT_WAIT", "REGROUP_STACKS_AFTER", "regroup"]

#: Seconds a regroup waits for the old NCCL communicators to abort before abandoning them.
ABORT_WAIT = 10.0

#: Seconds into a regroup after which the rank prints its main thread's stack (to its log).
REGROUP_STACKS_AFTER = 20.0


def _say_where(rank: int, main: int) -> None:
    """The main thread's stack, read holding the GIL (faulthandler's dump_traceback_later reads
    every thread's frames without it, while they run: see worker/process/rank.py)."""
    frame = sys._current_frames().get(main)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (no Python frame)\n"
    print(f"distnb: rank {rank}'s regroup has not finished after {REGROUP_STACKS_AFTER:.0f} s; its main thread:\n{stack}",
          file=sys.stderr, flush=True)


def regroup(rank: int, world_size: int, pg_timeout: float, device: Any, calls: CallLog, generation: int) -> dict[str, Any]:
    """Replace a poisoned default process group (a timeout, an aborted communicator) with a
    fresh one on the same rendezvous store, keeping the process and its namespace.

    NCCL: the old communicators are aborted, not destroyed (destroying one with a kernel
    stuck on it can hang), and the new group initialises eagerly on this rank's device. The
    new group lives under a store prefix of its own, so the old group's keys (a timeout-dump
    marker, say) can't reach it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from distnb.worker.torch_hooks.group_abort import abort_backends, forget_groups

    try:
        store = c10d._get_default_store()
        backend = dist.get_backend()
    except Exception as exc:
        return {"status": "error", "error": f"rank {rank} has no default process group to replace: {exc}"}
    calls.reset()  # group names and counts start over with the new group
    last_id = _newest_record_id()
    nccl = "nccl" in str(backend)
    # A regroup that hangs (a communicator that won't abort, a peer that never joins) says where.
    watch = threading.Timer(REGROUP_STACKS_AFTER, _say_where, (rank, threading.get_ident()))
    watch.daemon = True
    watch.name = "distnb-regroup-watch"
    watch.start()
    print(f"distnb: rank {rank} replacing its process groups ({'abort' if nccl else 'destroy'}, then a new group)",
          file=sys.stderr, flush=True)
    try:
        if nccl:
            if not abort_backends(ABORT_WAIT):
                print(f"distnb: rank {rank}'s old NCCL communicators did not abort within {ABORT_WAIT:.0f} s; "
                      "abandoning them", file=sys.stderr, flush=True)
            forget_groups()
        else:
            with distnb_calls():  # the pool's own destroy, not a pasted script's
                dist.destroy_process_group()
    except Exception:
        pass  # a poisoned group may fail to shut down cleanly; the new one does not need it
    kwargs: dict[str, Any] = {"device_id": device} if nccl else {}
    try:
        with distnb_calls():
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"distnb/regroup/{generation}", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
                **kwargs,
            )
    except Exception as exc:
        return {"status": "error", "error": f"rank {rank} could not build a new process group: {type(exc).__name__}: {exc}"}
    finally:
        watch.cancel()
    return {"status": "ok", "backend": backend, "last_id": last_id}


def _newest_record_id() -> int:
    """distnb's id for the newest entry of this rank's recorders, read while the old groups still
    exist (after, the recorders of groups gone are not asked): the controller ignores every entry
    up to it once the new group is made (-1: none, or no recorder could be read)."""
    from distnb.worker.torch_hooks.flight_recorder import IDS, dump_recorders

    try:
        assigned = IDS.assign(dump_recorders()[0])
    except Exception:
        return -1
    return assigned[-1][0] if assigned else -1
