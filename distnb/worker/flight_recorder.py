"""The rank's collective log, read from PyTorch's C++ Flight Recorder.

The Flight Recorder records every collective when it is issued — explicit ``dist.*`` calls and the
ones DDP/FSDP issue from C++ alike — at about 2 µs each, and can be read from another thread while
the main thread is blocked in a collective (gloo and NCCL waits release the GIL). An entry that is
not ``retired`` was entered but has not completed.

Reading is not free: the recorder converts its whole ring buffer on every dump, ~15–30 µs per entry
held (about 1 ms for 50 entries, 30–50 ms for a full 2000-entry buffer on this machine), so reads
happen on request and, while a cell runs, only when :class:`SeqWatch` saw a group's sequence number
move — a check that costs a few µs.
"""

from __future__ import annotations

import bisect
import collections
import json
import pickle
import time
from typing import Any

from distnb.worker.call_log import CallLog

__all__ = ["CellClock", "SeqWatch", "read_collectives"]


class CellClock:
    """Wall-clock spans of the cells this rank ran, to attribute collectives to cells.

    One deque of ``(cell, start, end)``: the main thread appends while the control thread looks
    entries up, and a single structure can't be seen half-updated.
    """

    def __init__(self, keep: int = 2000) -> None:
        self._spans: collections.deque[tuple[int, float, float | None]] = collections.deque(maxlen=keep)

    def start(self, cell: int, t: float) -> None:
        self._spans.append((cell, t, None))

    def end(self, t: float) -> None:
        if self._spans:
            cell, t0, _ = self._spans[-1]
            self._spans[-1] = (cell, t0, t)

    def cell_at(self, t: float) -> int | None:
        # Bisect the deque in place: copying it per entry made a read O(entries × cells).
        i = bisect.bisect_right(self._spans, t, key=lambda span: span[1]) - 1
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


class SeqWatch:
    """Has any process group issued a collective since the last look? Each group's own sequence
    number answers that in ~1–2 µs per group, against milliseconds for a Flight Recorder dump."""

    def __init__(self) -> None:
        self.usable = True

    def snapshot(self) -> tuple[tuple[str, int], ...] | None:
        """``(group name, sequence number)`` per live group; None before torch.distributed is up or
        where the backend can't tell (the caller then relies on the controller's polling)."""
        if not self.usable:
            return None
        import sys

        c10d = sys.modules.get("torch.distributed.distributed_c10d")  # never import torch from here
        if c10d is None:
            return None
        try:
            # list() copies the dict in one step under the GIL, so a concurrent new_group is safe.
            groups = list(c10d._world.pg_names.items())
            return tuple(sorted((str(name), int(pg._get_sequence_number_for_group())) for pg, name in groups))
        except (AttributeError, NotImplementedError):
            self.usable = False  # this torch or backend has no per-group counter
            return None
        except Exception:
            return None  # e.g. a group being destroyed right now: look again next time


def _dump() -> dict[str, Any]:
    """The recorder's contents. The pickle form without C++ stack traces is ~3× cheaper than the
    JSON one (no symbolising, no JSON round trip); it comes from this process, so unpickling it is
    as safe as the JSON."""
    from torch._C import _distributed_c10d as c

    if hasattr(c, "_dump_fr_trace"):
        return pickle.loads(c._dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    return json.loads(getattr(c, "_dump_fr_trace_json")())  # noqa: B009 - absent from torch's stubs


def _completed(e: dict[str, Any]) -> bool:
    """NCCL moves an entry's ``state`` to "completed" (and retires timed-out works too, so
    ``retired`` alone proves nothing there); gloo never moves ``state`` past "scheduled" and
    retires an entry when its work completes."""
    if str(e.get("profiling_name", "")).startswith("nccl:"):
        return e.get("state") == "completed"
    return bool(e.get("retired")) or e.get("state") == "completed"


def read_collectives(since: int, clock: CellClock, calls: CallLog | None = None, calls_since: int = -1) -> dict[str, Any]:
    """Entries newer than record ``since`` plus every entry not yet retired (its state may change),
    each with the arguments of the call that created it (``calls``), and the watched calls newer
    than ``calls_since`` (point-to-point and group creation, which the recorder does not see).

    ``now`` is this rank's wall clock at the read: the controller measures how long an entry has
    been open against it, never against its own clock (another machine's may be off by seconds).
    """
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:  # a torch built without distributed support
        c10d = None  # type: ignore[assignment]
    extra: dict[str, Any] = {"calls": calls.since(calls_since)} if calls is not None else {}
    if not hasattr(c10d, "_dump_fr_trace_json"):  # present since torch 2.5
        return {**extra, "unavailable": "this torch has no Flight Recorder (_dump_fr_trace_json); upgrade to torch >= 2.5"}
    try:
        dump = _dump()
    except Exception as exc:
        return {**extra, "unavailable": f"the Flight Recorder could not be read: {exc}"}
    now = time.time()
    entries = []
    created = []
    for e in dump.get("entries", []):
        rid = int(e["record_id"])
        if rid <= since and e.get("retired", True):
            continue
        p2p = bool(e.get("is_p2p"))
        created.append(int(e.get("time_created_ns", 0)))
        t = created[-1] / 1e9
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
                "done": _completed(e),
                "state": str(e.get("state", "")),
                "cell": clock.cell_at(t),
            }
        )
    if calls is not None:
        calls.annotate(entries, created)
    return {"entries": entries, "groups": _groups(), "now": now, **extra}
