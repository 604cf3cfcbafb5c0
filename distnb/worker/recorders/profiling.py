"""``%%on_ranks --profile``: run a cell under ``torch.profiler`` and bring back what the
controller needs — time in collectives, the top ops, and the Chrome trace (compressed).

The trace's timestamps are wall-clock µs after ``baseTimeNanoseconds`` (Kineto's convention), so
the controller can put every rank on its own clock with the offsets it already measures.
"""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from typing import Any, Callable

from distnb.wire.record_types import CellOutcome
from distnb.worker.torch_hooks.c10d_groups import default_store

__all__ = ["run_profiled", "align", "TRACE_CAP", "ALIGN_WAIT"]

#: Compressed trace bytes sent back in the cell's reply; a larger trace stays in a file on the
#: rank's machine and only its path comes back.
TRACE_CAP = 8 << 20
_COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
#: The longest a rank waits for the cell's other ranks to have started their profilers. Starting
#: one costs each rank a different time (0.1-1 s on loaded CPUs, ~11 s for a CUDA build without a
#: GPU): unaligned, that skew would be read as waiting for peers at the cell's first collective.
ALIGN_WAIT = 120.0


def run_profiled(run: Callable[[], CellOutcome], peers: int = 1, key: str = "", top: int = 15) -> CellOutcome:
    """``run()`` (the cell) under the profiler; its reply gains ``profile``. With ``peers`` > 1
    the cell starts once all ``peers`` ranks of the cell have their profilers running (:func:`align`)."""
    import torch
    from torch import profiler as tp

    activities = [tp.ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(tp.ProfilerActivity.CUDA)
    with tp.profile(activities=activities) as prof:
        aligned = align(key, peers, ALIGN_WAIT) if peers > 1 else True
        reply = run()
    try:
        reply["profile"] = {**_summary(prof, top), "aligned": aligned}
    except Exception as exc:  # the cell's own result matters more than its profile
        reply["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    return reply


def align(key: str, peers: int, wait: float, store: Any = None) -> bool:
    """Wait until ``peers`` ranks have reached ``key`` on the job's store (the default group's
    rendezvous store unless given); False when there is none or ``wait`` seconds pass first.

    A poll, not ``store.wait``: a rank blocked inside the store's C++ wait would not see the
    Ctrl-C that interrupts the cell until the wait ended."""
    store = store if store is not None else default_store()
    if store is None:  # no default group (the cell destroyed it): run unaligned
        return False
    try:
        store.add(key, 1)
        deadline = time.monotonic() + wait
        while store.add(key, 0) < peers:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    except (RuntimeError, OSError):  # the store is gone (its host rank died): the cell says so itself
        return False
    return True


def _summary(prof: Any, top: int) -> dict[str, Any]:
    comm = 0.0
    device_comm = 0.0
    for e in prof.events():
        if e.name.startswith(_COMM_PREFIXES) and e.cpu_parent is None:
            comm += e.cpu_time_total / 1e6
            device_comm += getattr(e, "device_time_total", 0.0) / 1e6
    ops = []
    for k in sorted(prof.key_averages(), key=lambda k: k.self_cpu_time_total, reverse=True)[:top]:
        ops.append({"name": k.key, "count": int(k.count), "self_s": k.self_cpu_time_total / 1e6,
                    "total_s": k.cpu_time_total / 1e6, "device_s": getattr(k, "device_time_total", 0.0) / 1e6})
    fd, path = tempfile.mkstemp(prefix="distnb-trace-", suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path, "rb") as f:
        packed = zlib.compress(f.read(), 3)
    out: dict[str, Any] = {"collective_s": comm, "device_collective_s": device_comm, "ops": ops}
    if len(packed) <= TRACE_CAP:
        out["trace"] = packed
        os.unlink(path)
    else:
        out["trace_path"] = path  # too big to send: left on this machine
    return out
