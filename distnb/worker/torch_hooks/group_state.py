"""What a rank can say cheaply about its process groups at the end of every cell: how many
collectives it has issued on each, how many groups it has created, and which groups NCCL's
watchdog has given up on.

The counts are compared across ranks by the controller (``distnb/sync_check.py``) the moment a
cell finishes everywhere: a rank-conditional collective that every rank got past (NCCL returns at
enqueue, gloo's ``async_op=True`` too) shows as one rank ahead, before anything hangs. Reading
them costs a few µs; nothing here touches a device, and torch is imported only once
torch.distributed already is.
"""

from __future__ import annotations

from typing import Any

from distnb.wire.record_types import SyncState
from distnb.worker.torch_hooks.call_log import CallLog
from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["Groups", "group_backends", "group_errors", "live_groups", "sync_state"]


def _c10d() -> Any:
    return imported_module("torch.distributed.distributed_c10d")


def group_backends(c10d: Any, pg: Any) -> set[str]:
    """The backends of one process group: "nccl", "gloo", or several for a per-device spec such
    as "cpu:gloo,cuda:nccl"."""
    entry = c10d._world.pg_map.get(pg)
    return {part.rsplit(":", 1)[-1] for part in str(entry[0]).lower().split(",")} if entry is not None else set()


Groups = list[tuple[Any, str, bool]]


def live_groups() -> Groups | None:
    """``(group, name, uses NCCL)`` for every live group, or None before torch.distributed is
    imported. Read once at a cell's end for both :func:`sync_state` and :func:`group_errors`: on a
    machine whose caches the ranks share, each extra pass over torch's tables shows."""
    c10d = _c10d()
    try:
        return None if c10d is None else _groups(c10d)
    except Exception:  # a group being destroyed under us: each reader tries on its own
        return None


def _groups(c10d: Any) -> Groups:
    pg_map = c10d._world.pg_map
    out = []
    for pg, name in list(c10d._world.pg_names.items()):
        entry = pg_map.get(pg)
        out.append((pg, str(name), entry is not None and "nccl" in str(entry[0]).lower()))
    return out


def sync_state(calls: CallLog, groups: Groups | None = None) -> SyncState | None:
    """``{"seqs": {group name: collectives issued}, "created": groups created}``, or None before
    torch.distributed is up.

    A group's sequence number counts its collectives; gloo's counts point-to-point calls too (NCCL
    keeps those apart), so the calls distnb saw are taken out there — a send on one rank and a recv
    on another are not a desync. The groups made with ``use_local_synchronization`` (only their
    members create those, under hashed names) are left out of "created": torch's counter skips
    them up to 2.13 and counts them from 2.14 (CallLog.creations_in_step).
    """
    c10d = _c10d()
    if c10d is None:
        return None
    try:
        p2p = calls.p2p_counts
        seqs = {name: int(pg._get_sequence_number_for_group()) - (0 if nccl else p2p.get(name, 0))
                for pg, name, nccl in (_groups(c10d) if groups is None else groups)}
        created = calls.creations_in_step()
        if created is None:
            return None
        return {"seqs": seqs, "created": created, "digests": dict(calls.digests)}
    except Exception:  # no group yet, a group being destroyed, a backend without a counter
        return None


def group_errors(groups: Groups | None = None) -> dict[str, str]:
    """NCCL groups whose communicator failed (a collective timed out, a peer's error): group name →
    the error type. distnb runs NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so the watchdog
    aborts the communicator and the rank lives on — but a host sync after the abort returns
    garbage without raising; the cell is made to raise instead (``Executor``)."""
    c10d = _c10d()
    if c10d is None:
        return {}
    out: dict[str, str] = {}
    try:
        nccl = [(pg, name) for pg, name, is_nccl in (_groups(c10d) if groups is None else groups) if is_nccl]
        if not nccl:
            return out
        import torch

        cuda = torch.device("cuda")
        for pg, name in nccl:
            get_error = getattr(pg._get_backend(cuda), "get_error", None)
            if get_error is None:
                continue  # a torch without it: the collective log still shows the group's state
            error = get_error()
            if getattr(error, "name", "SUCCESS") != "SUCCESS":
                out[name] = str(error.name)
    except Exception:
        pass
    return out
