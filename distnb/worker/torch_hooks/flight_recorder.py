"""The rank's collective log, read from PyTorch's C++ Flight Recorder.

The Flight Recorder records every collective when it is issued — explicit ``dist.*`` calls and the
ones DDP/FSDP issue from C++ alike — at about 2 µs each, and can be read from another thread while
the main thread is blocked in a collective (gloo and NCCL waits release the GIL). Each backend writes
its own recorder (NCCL the CUDA one, gloo the other); an entry's ``state`` and ``retired`` say
whether it completed (see :func:`_completed`).

Reading is not free: the recorder converts its whole ring buffer on every dump, ~15–30 µs per entry
held (about 1 ms for 50 entries, 30–50 ms for a full 2000-entry buffer on this machine), so reads
happen on request and, while a cell runs, only when :class:`SeqWatch` saw a group's sequence number
move — a check that costs a few µs.
"""

from __future__ import annotations

import bisect
import collections
import os
import pickle
import threading
import time
from typing import Any, Callable

from distnb.wire.record_types import CollectiveEntry, CollectivesRead
from distnb.worker.torch_hooks.call_log import CallLog
from distnb.worker.torch_hooks.group_state import group_backends
from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["CellClock", "DUMPERS", "GROUPS", "SentGroups", "RecordIds", "SeqWatch", "dump_recorders", "backends_in_use", "entry_view",
           "open_nccl", "read_collectives"]


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

    def idle_since(self) -> float | None:
        """When the last cell ended; None while one runs (or before any)."""
        return self._spans[-1][2] if self._spans else None

    def cell_at(self, t: float) -> int | None:
        # Bisect the deque in place: copying it per entry made a read O(entries × cells).
        i = bisect.bisect_right(self._spans, t, key=lambda span: span[1]) - 1
        if i < 0:
            return None
        cell, t0, t1 = self._spans[i]
        return cell if t1 is None or t <= t1 else None


class SentGroups:
    """What the controller has been told of this rank's process groups. Members never change once
    a group exists, so a reply carries the groups only when the table changed since the last one
    that did (or when asked): at 1,024 ranks the world group's member list alone in every reply is
    a megabyte per round. Every reply carries ``gkey``, the table's key, so a controller that
    missed a reply with the groups (a late answer it dropped) sees it and asks again."""

    def __init__(self, key: Callable[[], int] | None = None,
                 read: Callable[[], tuple[dict[str, list[int]], dict[str, str]]] | None = None) -> None:
        self._key = key  # None: this process's own table (the functions below)
        self._read = read
        self._sent: int | None = None

    def fields(self, force: bool = False) -> CollectivesRead:
        """``gkey``, plus ``groups`` and ``descs`` when they changed since last sent (or ``force``)."""
        key = (self._key or _table_key)()
        if not force and key == self._sent:
            return {"gkey": key}
        groups, descs = (self._read or _groups)()
        self._sent = key
        return {"gkey": key, "groups": groups, "descs": descs}


def _table_key() -> int:
    """The group table's key: its group names (a group's members never change once it exists)."""
    c10d: Any = imported_module("torch.distributed.distributed_c10d")
    try:
        return hash(tuple(sorted(str(n) for n in list(c10d._world.pg_names.values()))))
    except Exception:
        return 0


#: This process's table (the control thread's pushes and replies share it).
GROUPS = SentGroups()


def _groups() -> tuple[dict[str, list[int]], dict[str, str]]:
    """Process-group name → global ranks (the Flight Recorder names groups, not members), and →
    torch's description (``mesh_dp`` for a mesh's dp groups: known as soon as the group exists,
    before any of its collectives is recorded); one walk of torch's group table for both."""
    c10d: Any = imported_module("torch.distributed.distributed_c10d")
    ranks: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    try:
        for pg, name in list(c10d._world.pg_names.items()):
            ranks[str(name)] = sorted(c10d.get_process_group_ranks(pg))
            desc = getattr(pg, "group_desc", None)
            if desc:
                descs[str(name)] = str(desc)
    except Exception:
        pass
    return ranks, descs


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
        c10d: Any = imported_module("torch.distributed.distributed_c10d")
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


#: The recorders a rank may hold, by distnb's name for them → the pickle dumper torch exposes.
#: ``ProcessGroupNCCL`` writes the CUDA instance (``FlightRecorderCUDA``); gloo (and any other
#: backend) the ``c10::Event`` one. A pool on NCCL with a gloo side group for CPU tensors has both.
DUMPERS = {"nccl": "_dump_nccl_trace", "fr": "_dump_fr_trace"}


def backends_in_use() -> set[str]:
    """The backends this rank's live process groups use ("nccl", "gloo", …)."""
    c10d: Any = imported_module("torch.distributed.distributed_c10d")
    out: set[str] = set()
    try:
        for pg in list(c10d._world.pg_map):
            out |= group_backends(c10d, pg)
    except Exception:
        pass
    return out


def _buffer_off() -> str | None:
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        if os.environ.get(var, "").strip() == "0":
            return f"{var}=0 turns the Flight Recorder off on this rank; relaunch without it (distnb sets 500 by default)"
    return None


def dump_recorders() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every recorder this rank's groups write, read: ``({recorder: dump}, {recorder: why it can't
    be read})``. The pickle form without C++ stack traces is ~3× cheaper than the JSON one (no
    symbolising, no JSON round trip); it comes from this process, so unpickling it is safe."""
    if imported_module("torch.distributed.distributed_c10d") is None:
        return {}, {"fr": "torch.distributed is not imported on this rank yet"}
    c = getattr(imported_module("torch._C"), "_distributed_c10d", None)
    if c is None:
        return {}, {"fr": "this torch has no distributed support"}
    used = backends_in_use()
    wanted = ["nccl"] if "nccl" in used else []
    if used - {"nccl"} or not used:
        wanted.append("fr")
    dumps: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    off = _buffer_off()
    for rec in wanted:
        dumper = getattr(c, DUMPERS[rec], None)
        if off is not None:
            missing[rec] = off
        elif dumper is None:
            what = "NCCL's recorder (_dump_nccl_trace)" if rec == "nccl" else "a Flight Recorder (_dump_fr_trace)"
            missing[rec] = f"this torch ({_torch_version()}) has no {what}; torch >= 2.5 records collectives"
        else:
            try:
                dumps[rec] = pickle.loads(dumper(includeCollectives=True, includeStackTraces=False, onlyActive=False))
            except Exception as exc:
                missing[rec] = f"the {rec} recorder could not be read: {type(exc).__name__}: {exc}"
    return dumps, missing


def _torch_version() -> str:
    return str(getattr(imported_module("torch"), "__version__", "?"))


def _nccl(e: dict[str, Any]) -> bool:
    return str(e.get("profiling_name", "")).startswith("nccl:")


def _completed(e: dict[str, Any]) -> bool:
    """NCCL moves an entry's ``state`` to "completed" (and retires timed-out works too, so
    ``retired`` alone proves nothing there); gloo never moves ``state`` past "scheduled" and
    retires an entry when its work completes."""
    if _nccl(e):
        return e.get("state") == "completed"
    return bool(e.get("retired")) or e.get("state") == "completed"


_TIMING = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0").lower() in ("1", "true", "yes")


def _ns(value: Any) -> float | None:
    return int(value) / 1e9 if value else None


class RecordIds:
    """distnb's ids for the entries of every recorder: one increasing sequence in order of
    creation, so the controller's cursor ("everything after id N") spans recorders whose own
    record ids each start at 0. Entries that left their ring buffer are forgotten."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], int] = {}
        self._next = 0
        self._lock = threading.Lock()
        #: Ids of gloo entries a read already waited RETIRE_WAIT for in vain (a work never waited
        #: on): the notebook's cursor stays before an open entry, so every later read would wait again.
        self.stayed_open: set[int] = set()

    def assign(self, dumps: dict[str, dict[str, Any]]) -> list[tuple[int, str, dict[str, Any]]]:
        """``(id, recorder, entry)`` for every entry of ``dumps``, oldest id first."""
        with self._lock:
            fresh = [(int(e.get("time_created_ns", 0)), rec, e) for rec, d in dumps.items() for e in d.get("entries", [])
                     if (rec, int(e["record_id"])) not in self._ids]
            for _, rec, e in sorted(fresh, key=lambda x: x[0]):
                self._ids[(rec, int(e["record_id"]))] = self._next
                self._next += 1
            out = [(self._ids[(rec, int(e["record_id"]))], rec, e) for rec, d in dumps.items() for e in d.get("entries", [])]
            if len(self._ids) > len(out) + 1000:  # keep only what the ring buffers still hold
                held = {(rec, int(e["record_id"])) for _, rec, e in out}
                self._ids = {k: v for k, v in self._ids.items() if k in held}
                self.stayed_open.intersection_update(self._ids.values())
        return sorted(out, key=lambda x: x[0])


#: The recorders are this process's singletons, and so are distnb's ids for their entries.
IDS = RecordIds()


def entry_view(did: int, rec: str, e: dict[str, Any], clock: CellClock) -> CollectiveEntry:
    """A recorder entry as the controller keeps it (JSON-able, a few hundred bytes)."""
    p2p = bool(e.get("is_p2p"))
    t = int(e.get("time_created_ns", 0)) / 1e9
    return {
        "id": did,
        "rec": rec,
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
        # When the GPU started and finished it, as the watchdog saw (NCCL with TORCH_NCCL_ENABLE_TIMING=1).
        "started": _ns(e.get("time_discovered_started_ns")),
        "ended": _ns(e.get("time_discovered_completed_ns")),
        # Not started on the GPU yet (other work before it on the stream). Only timing tells
        # "scheduled" from "started"; without it every open NCCL entry reads "scheduled".
        "queued": rec == "nccl" and e.get("state") == "scheduled" and _TIMING,
        "cell": clock.cell_at(t),
    }


def read_collectives(since: int, clock: CellClock, calls: CallLog | None = None, calls_since: int = -1,
                     ids: RecordIds = IDS, groups: bool = False) -> CollectivesRead:
    """Entries newer than id ``since`` plus every entry not yet completed (its state may change),
    from every recorder the rank's groups write, each with the arguments of the call that created
    it (``calls``), and the watched calls newer than ``calls_since`` (point-to-point and group
    creation, which the recorder does not see).

    ``now`` is this rank's wall clock at the read: the controller measures how long an entry has
    been open against it, never against its own clock (another machine's may be off by seconds).
    ``missing`` names the recorders that could not be read, and why. The groups' members come
    when they changed since last sent, or with ``groups`` (:class:`SentGroups`).
    """
    recent = calls.since(calls_since) if calls is not None else None  # before the dump: none missed between
    dumps, missing, assigned = _retired(since, clock, ids)
    if not dumps:
        out: CollectivesRead = {"unavailable": "; ".join(f"{why}" for why in missing.values()) or "no Flight Recorder could be read"}
        if recent is not None:
            out["calls"] = recent
        return out
    now = time.time()
    entries: list[CollectiveEntry] = []
    created = []
    for did, rec, e in assigned:
        if did <= since and _completed(e):
            continue
        entries.append(entry_view(did, rec, e, clock))
        created.append(int(e.get("time_created_ns", 0)))
    if calls is not None:
        calls.annotate(entries, created)
    reply: CollectivesRead = {"entries": entries, "now": now, **GROUPS.fields(groups)}
    if recent is not None:
        reply["calls"] = recent
    if missing:
        reply["missing"] = missing
    return reply


#: How long a read waits, at most, for the gloo entries of a cell that has ended to be retired.
RETIRE_WAIT = 0.2
_RETIRE_STEP = 0.01


def _retired(since: int, clock: CellClock, ids: RecordIds) -> tuple[dict[str, Any], dict[str, str], list[tuple[int, str, dict[str, Any]]]]:
    """The recorders' dumps (with what could not be read, and each entry under distnb's id), once
    the gloo entries new to the notebook, made in a cell that has since ended, are retired (or
    RETIRE_WAIT has passed). Gloo retires an entry on its own thread after the work completes, so a
    read just after the cell returned from a collective could find it "entered, not completed" —
    and the notebook would keep saying so until the next read. Only a work never waited on
    (``async_op=True``) stays open: waited for once (``RecordIds.stayed_open``)."""
    dumps, missing = dump_recorders()
    assigned = ids.assign(dumps)
    ended = clock.idle_since()

    def unretired() -> list[int]:
        return [did for did, _, e in assigned if did > since and did not in ids.stayed_open and not _completed(e) and not _nccl(e)
                and int(e.get("time_created_ns", 0)) / 1e9 <= ended] if ended is not None else []

    deadline = time.monotonic() + RETIRE_WAIT
    while (waiting := unretired()) and time.monotonic() < deadline:
        time.sleep(_RETIRE_STEP)
        dumps, missing = dump_recorders()
        assigned = ids.assign(dumps)
    ids.stayed_open.update(waiting)
    return dumps, missing, assigned


def open_nccl(limit: int = 3) -> str:
    """The NCCL collectives of this rank not completed, in words (``all_reduce #2 on group 0``),
    oldest first; ``""`` when none (or NCCL's recorder can't be read)."""
    dumps, _ = dump_recorders()
    entries = [e for e in dumps.get("nccl", {}).get("entries", []) if not _completed(e)]
    words = [f"{str(e.get('profiling_name', '?')).split(':')[-1]} #{e.get('collective_seq_id')} on group {e['process_group'][0]}"
             for e in sorted(entries, key=lambda e: int(e["record_id"]))[:limit]]
    return ", ".join(words) + (" …" if len(entries) > limit else "")
