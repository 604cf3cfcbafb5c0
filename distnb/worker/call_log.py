"""What the Flight Recorder does not record: the arguments ranks must agree on, point-to-point
calls and group creation.

The recorder keeps each collective's op, shapes and dtypes, but not ``src``/``dst`` or the reduce
op; gloo does not record ``send``/``recv`` at all, and no backend records ``new_group``. A
mismatch in any of these hangs or silently corrupts a run, so the rank wraps the few
``torch.distributed`` functions that take them (the module attributes, which is what ``dist.x``
and torch's own internal calls resolve) and keeps a bounded log of their calls. A wrapper costs
~2 µs per call; collectives issued from C++ (DDP's buckets) pass by untouched, and carry no such
arguments.

A call's record is matched to the Flight Recorder entry it created by time: the entry is created
while the call runs, in its group (both clocks are this process's wall clock, in ns).
"""

from __future__ import annotations

import bisect
import collections
import functools
import inspect
import itertools
import sys
import threading
import time
from typing import Any, Callable

from distnb.worker.patching import wrap_c10d

__all__ = ["CallLog", "install"]

#: Function → the arguments kept (those that must agree across the ranks of a collective, or name
#: the peer of a point-to-point call).
WATCHED: dict[str, tuple[str, ...]] = {
    "all_reduce": ("op",),
    "broadcast": ("src", "group_src"),
    "reduce": ("dst", "group_dst", "op"),
    "gather": ("dst", "group_dst"),
    "scatter": ("src", "group_src"),
    "reduce_scatter": ("op",),
    "reduce_scatter_tensor": ("op",),
    "send": ("dst", "group_dst", "tag"),
    "recv": ("src", "group_src", "tag"),
    "isend": ("dst", "group_dst", "tag"),
    "irecv": ("src", "group_src", "tag"),
    "new_group": ("ranks",),
    # Kept for their group and cell line alone: on NCCL a group's first collective waits in the
    # call while the communicator connects, before the recorder has an entry for it — the call
    # log is then the only record of which group the rank entered (a mesh dimension mix-up).
    "all_gather": (),
    "all_gather_into_tensor": (),
    "all_gather_single": (),
    "reduce_scatter_single": (),
    "all_to_all": (),
    "all_to_all_single": (),
    "barrier": (),
}
P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
_ASYNC = {"isend", "irecv"}
_KEEP = 4000
_inside = threading.local()


def _plain(value: Any) -> Any:
    """Arguments as JSON-able values: a ReduceOp by its name, rank lists as lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, range, set)):
        return sorted(int(v) for v in value) if isinstance(value, set) else [int(v) for v in value]
    name = getattr(value, "name", None)  # RedOpType
    if isinstance(name, str):
        return name
    return str(value).rsplit(".", 1)[-1]


def _caller(prefix: str) -> tuple[int | None, int | None, str]:
    """The innermost cell frame calling torch.distributed: (cell, line, function)."""
    frame: Any = sys._getframe(3)
    depth = 0
    while frame is not None and depth < 48:
        name = frame.f_code.co_filename
        if name.startswith(prefix):
            return int(name[len(prefix) : -1]), frame.f_lineno, frame.f_code.co_name
        frame, depth = frame.f_back, depth + 1
    return None, None, ""


class CallLog:
    """The recent watched calls of this rank, newest last; safe to read from the control thread."""

    def __init__(self, cell_prefix: str, keep: int = _KEEP) -> None:
        self._prefix = cell_prefix  # cells' code objects are named ``<prefix>N>``
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._works: dict[int, Any] = {}  # open isend/irecv record → its Work
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self.installed = False
        # Point-to-point calls per group name since the last reset (never trimmed).
        self.p2p_counts: collections.Counter[str] = collections.Counter()

    def begin(self, fn: str, group: Any, args: dict[str, Any]) -> dict[str, Any]:
        cell, line, func = _caller(self._prefix)
        rec: dict[str, Any] = {
            "n": next(self._next), "op": fn, "group": _group_name(group), "args": args,
            "t": time.time_ns(), "end": None, "cell": cell, "line": line, "func": func,
        }
        if fn == "new_group":
            rec["count"] = _group_count()
        elif fn in P2P:
            self.p2p_counts[rec["group"]] += 1
        self._records.append(rec)
        return rec

    def end(self, rec: dict[str, Any], work: Any = None) -> None:
        if work is not None and rec["op"] in _ASYNC:
            with self._lock:
                self._works[rec["n"]] = work  # open until the work completes (checked on read)
            return
        if rec["op"] == "new_group" and work is not None:
            made = _group_name(work)  # a rank outside the group gets no group: "?"
            if made != "?":
                rec["made"] = made
        rec["end"] = time.time_ns()

    def reset(self) -> None:
        """A new process group generation (regroup): group names and counts start over."""
        with self._lock:
            self._records.clear()
            self._works.clear()
            self.p2p_counts.clear()

    def since(self, n: int) -> list[dict[str, Any]]:
        """Records newer than ``n`` plus every one still open (it may have ended since)."""
        self._poll_works()
        return [dict(r) for r in list(self._records) if r["n"] > n or r["end"] is None]

    def _poll_works(self) -> None:
        with self._lock:
            works = list(self._works.items())
        for n, work in works:
            try:
                done = work.is_completed()
            except Exception:
                done = True  # a work that can't say is not worth waiting on
            if done:
                with self._lock:
                    self._works.pop(n, None)
                rec = next((r for r in reversed(self._records) if r["n"] == n), None)
                if rec is not None:
                    rec["end"] = time.time_ns()

    def annotate(self, entries: list[dict[str, Any]], created_ns: list[int]) -> None:
        """Give each Flight Recorder entry the arguments of the call that created it."""
        by_group: dict[str, list[dict[str, Any]]] = {}
        for r in list(self._records):
            if r["op"] not in P2P and r["op"] != "new_group":
                by_group.setdefault(r["group"], []).append(r)
        for e, t in zip(entries, created_ns):
            recs = by_group.get(e["group"])
            if not recs:
                continue
            i = bisect.bisect_right(recs, t, key=lambda r: r["t"]) - 1
            if i >= 0 and (recs[i]["end"] is None or t <= recs[i]["end"]):
                rec = recs[i]
                e["args"] = {k: v for k, v in rec["args"].items() if v is not None}
                if rec["line"] is not None:
                    e["line"], e["func"], e["call_cell"] = rec["line"], rec["func"], rec["cell"]


def _group_name(group: Any) -> str:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return "?"
    try:
        pg = group if group is not None else c10d._world.default_pg
        return str(c10d._world.pg_names.get(pg, "?"))
    except Exception:
        return "?"


def _group_count() -> int | None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return int(c10d._world.group_count)  # type: ignore[union-attr]
    except Exception:
        return None


def _wrap(log: CallLog, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn).parameters
    params = list(sig)
    # Defaults filled in: ``all_reduce(x)`` and ``all_reduce(x, op=SUM)`` are the same call.
    keep = [(k, params.index(k), None if sig[k].default is inspect.Parameter.empty else sig[k].default)
            for k in WATCHED[name] if k in params]
    group_at = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # e.g. send → isend in torch itself: the user's call is the record
            return fn(*args, **kwargs)
        try:
            got = {k: _plain(args[i] if i < len(args) else kwargs.get(k, d)) for k, i, d in keep}
            group = args[group_at] if group_at is not None and group_at < len(args) else kwargs.get("group")
            rec = log.begin(name, group, got)
        except Exception:  # recording must never break the user's call
            return fn(*args, **kwargs)
        work = None
        _inside.call = True
        try:
            work = fn(*args, **kwargs)
            return work
        finally:
            _inside.call = False
            log.end(rec, work)

    return call


def install(log: CallLog) -> None:
    """Wrap the watched functions in ``torch.distributed`` and its ``distributed_c10d`` module
    (both bindings: ``dist.x`` reads the first, torch's own internal calls the second)."""
    wrap_c10d(WATCHED, lambda name, fn: _wrap(log, name, fn), "__distnb_wrapped__")
    log.installed = True
