"""The rank's collective log, read from PyTorch's C++ Flight Recorder.

The Flight Recorder records every collective when it is issued — explicit ``dist.*`` calls and the
ones DDP/FSDP issue from C++ alike — at about 2 µs each, and can be read from another thread while
the main thread is blocked in a collective (gloo and NCCL waits release the GIL). An entry that is
not ``retired`` was entered but has not completed. Reading costs ~0.2–0.5 ms, so it happens only on
request, never per cell.
"""

from __future__ import annotations

import bisect
import collections
import json
from typing import Any

__all__ = ["CellClock", "read_collectives"]


class CellClock:
    """Wall-clock spans of the cells this rank ran, to attribute collectives to cells."""

    def __init__(self, keep: int = 2000) -> None:
        self._starts: collections.deque[float] = collections.deque(maxlen=keep)
        self._spans: collections.deque[tuple[int, float, float | None]] = collections.deque(maxlen=keep)

    def start(self, cell: int, t: float) -> None:
        self._starts.append(t)
        self._spans.append((cell, t, None))

    def end(self, t: float) -> None:
        if self._spans:
            cell, t0, _ = self._spans[-1]
            self._spans[-1] = (cell, t0, t)

    def cell_at(self, t: float) -> int | None:
        i = bisect.bisect_right(list(self._starts), t) - 1
        if i < 0:
            return None
        cell, t0, t1 = self._spans[i]
        return cell if t1 is None or t <= t1 else None


def _groups() -> dict[str, list[int]]:
    """Process-group name → global ranks (the Flight Recorder names groups, not members)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out: dict[str, list[int]] = {}
    try:
        for pg, name in list(c10d._world.pg_names.items()):
            out[str(name)] = sorted(dist.get_process_group_ranks(pg))
    except Exception:
        pass
    return out


def read_collectives(since: int, clock: CellClock) -> dict[str, Any]:
    """Entries newer than record ``since`` plus every entry not yet retired (its state may change)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return {"unavailable": "this torch has no Flight Recorder (_dump_fr_trace_json); upgrade to torch >= 2.5"}
    try:
        dump = json.loads(_dump_fr_trace_json())
    except Exception as exc:
        return {"unavailable": f"the Flight Recorder could not be read: {exc}"}
    entries = []
    for e in dump.get("entries", []):
        rid = int(e["record_id"])
        if rid <= since and e.get("retired", True):
            continue
        p2p = bool(e.get("is_p2p"))
        t = int(e.get("time_created_ns", 0)) / 1e9
        entries.append(
            {
                "id": rid,
                "group": str(e["process_group"][0]),
                "desc": str(e["process_group"][1]),
                "seq": int(e["p2p_seq_id"] if p2p else e["collective_seq_id"]),
                "p2p": p2p,
                "op": str(e.get("profiling_name", "?")).split(":")[-1],
                "sizes": [list(s) for s in e.get("input_sizes", [])],
                "dtypes": list(e.get("input_dtypes", [])),
                "t": t,
                "done": bool(e.get("retired")),
                "cell": clock.cell_at(t),
            }
        )
    return {"entries": entries, "groups": _groups()}
