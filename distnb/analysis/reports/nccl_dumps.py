"""NCCL's own evidence after a collective timeout: the Flight Recorder dumps its watchdog writes,
and the watchdog's words in a dead rank's stderr (blame by the dumps' sequence numbers is
``analysis/agreement/sequence_numbers.py``).

At a timeout, NCCL's watchdog aborts the communicator; distnb's settings (``launcher.
nccl_environment``) keep the rank alive and have every rank dump its recorder into the pool's run
folder (``<run dir>/nccl_trace_rank_<rank>``). After the abort every entry reads "completed", so
states no longer tell who never came — sequence numbers still do: the rank that timed out first is
a victim that waited, and the ranks whose last collective on the group is older never arrived.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
from typing import Any

__all__ = ["read_dumps", "watchdog_cause"]

_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+).*?ran for (\d+) milliseconds")


def read_dumps(run_dir: str, newer_than: float = 0.0, prefix: str = "nccl_trace_rank_") -> dict[int, dict[str, Any]]:
    """The Flight Recorder dumps NCCL's watchdog wrote at a timeout, by rank: those written after
    ``newer_than`` (wall clock; an earlier timeout's dumps stay in the folder), unreadable ones
    skipped (a rank may have died mid-write)."""
    out: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(run_dir, prefix + "*")):
        tail = path[len(os.path.join(run_dir, prefix)) :]
        try:
            if not tail.isdigit() or os.path.getmtime(path) < newer_than:
                continue
        except OSError:
            continue
        try:
            with open(path, "rb") as f:
                out[int(tail)] = pickle.load(f)  # written by the pool's own ranks
        except Exception:
            continue
    return out


def watchdog_cause(stderr: str) -> str:
    """``NCCL's watchdog ended it: ALLREDUCE #2 ran 8045 ms past …``, from a dead rank's stderr;
    ``""`` when the watchdog said nothing."""
    m = _WATCHDOG.search(stderr)
    if m is None:
        return ""
    return (f"NCCL's watchdog ended it: collective #{m.group(1)} ({m.group(2).lower()}) ran {int(m.group(3)) / 1000:.1f} s, past the "
            "group timeout, and TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down (distnb sets 2, which keeps it: was it overridden?)")
