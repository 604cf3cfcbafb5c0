"""What the Flight Recorder does not record: the arguments ranks must agree on, point-to-point
calls and group creation.

The recorder keeps each collective's op, shapes and dtypes, but not ``src``/``dst`` or the reduce
op; gloo does not record ``send``/``recv`` at all, and no backend records ``new_group``. A
mismatch in any of these hangs or silently corrupts a run, so the rank wraps the few
``torch.distributed`` functions that take them (the module attributes, which is what ``dist.x``
and torch's own internal calls resolve) and keeps a bounded log of their calls. A wrapper costs
tens of µs per call (docs/performance.md); collectives issued from C++ (DDP's buckets) pass by untouched, and carry no such
arguments.

A call's record is matched to the Flight Recorder entry it created by time: the entry is created
while the call runs, in its group (both clocks are this process's wall clock, in ns).

The wrapper is also where the rank's debugger stops *before* a collective (:data:`STOPS`): pdb's
``nc`` and the console's hold (``%%on_ranks --pdb``) pause the main thread at the innermost cell
frame calling it, nothing issued yet; and once a rank has left the cell from its debugger, a call
that would wait for it raises instead (:class:`LeftCell`).
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
import zlib
from typing import Any, Callable, NamedTuple

from distnb.wire.black_box import BlackBox
from distnb.wire.record_types import P2P_OPS, CallRecord, CollectiveEntry
from distnb.worker.torch_hooks.c10d_groups import description, global_rank, group_count, group_name, members, next_seq, not_a_member
from distnb.worker.torch_hooks.patching import wrap_c10d

__all__ = ["STOPS", "CallLog", "LeftCell", "StopFlags", "c10d_calls", "install", "needs"]

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
    "new_group": ("ranks", "use_local_synchronization"),
    # Kept for their group and cell line alone: on NCCL a group's first collective waits in the
    # call while the communicator connects, before the recorder has an entry for it — the call
    # log is then the only record of which group the rank entered (a mesh dimension mix-up).
    "all_gather": (),
    "all_gather_into_tensor": (),
    "all_gather_single": (),
    "reduce_scatter_single": (),
    "all_to_all": (),
    # Split sizes differ across ranks by design; what sender and receiver say must agree.
    "all_to_all_single": ("output_split_sizes", "input_split_sizes"),
    "barrier": (),
}
#: Arguments that differ across ranks by design (checked sender against receiver instead).
_PER_RANK = {"input_split_sizes", "output_split_sizes"}
#: Ops whose input tensors exist on the root alone: their shapes differ across ranks by design.
_ROOT_ONLY = {"scatter", "gather", "all_to_all_single", "all_to_all"}
_ASYNC = {"isend", "irecv"}
_KEEP = 4000
_inside = threading.local()
_MAIN = threading.main_thread().ident
#: The parameter holding a call's input tensor(s), the first found: the shapes a stop shows.
_INPUTS = ("tensor", "input_tensor", "input", "input_list", "input_tensor_list")
#: torch's dtypes by the names its Flight Recorder gives them, so a stop reads as an entry does.
_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
           "int32": "Int", "uint8": "Byte", "bool": "Bool", "int8": "Char", "int16": "Short"}


class LeftCell(KeyboardInterrupt):
    """Raised before a watched call that would wait for ranks that left the cell from their
    debugger (``q``, or the end of a post-mortem): the cell reports it as interrupted, never as an
    error of its own (and ``--pdb`` does not open on it)."""


class StopFlags:
    """What the main thread does just before its next watched call. ``hold`` (why: "nc", "hold")
    pauses it in the debugger there; ``gone`` ranks left the cell, so a call that needs one raises.
    Set by pdb's ``nc`` or the control thread, cleared at each cell's start and end.

    ``calling`` is the watched call the main thread is in (name, group, arguments), set *before*
    the flags are read: a control thread that sets a flag and then reads ``calling`` either sees the
    call (and interrupts it) or knows the main thread will read the flag first.
    """

    def __init__(self) -> None:
        self.hold = ""
        self.gone: frozenset[int] = frozenset()
        self.why = ""  # who left and how, for the words of a LeftCell
        self.calling: tuple[str, Any, dict[str, Any]] | None = None
        self.watching = False  # the calls are wrapped (DISTNB_CALL_LOG=0: not, and nothing can stop before one)
        #: Pauses the main thread in its debugger: ``hook(info, cell_frame)`` (worker/process/debug.py).
        self.hook: Callable[[dict[str, Any], Any], None] | None = None
        #: The debugger panel's "before each collective" (worker/process/panel_link.py): ``every`` stops
        #: before each watched call, in the panel's debugger (``panel_hook``), until turned off.
        self.every = False
        self.panel_hook: Callable[[dict[str, Any], Any], None] | None = None

    def clear(self) -> None:
        self.hold, self.gone, self.why = "", frozenset(), ""


STOPS = StopFlags()


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


class Caller(NamedTuple):
    """Where a watched call came from in the cells: the innermost cell frame (the call's own
    line, perhaps in a function an earlier cell defined) and the outermost (the line of the
    running cell's code that led there)."""

    cell: int | None
    line: int | None
    func: str
    outer_cell: int | None
    outer_line: int | None


def _caller(prefix: str) -> Caller:
    """The cell frames of the calling thread's stack around a torch.distributed call."""
    frame: Any = sys._getframe(3)
    inner: Any = None
    outer: Any = None
    depth = 0
    while frame is not None and depth < 256:
        if frame.f_code.co_filename.startswith(prefix):
            inner = inner or frame
            outer = frame
        elif inner is None and depth >= 48:
            break  # deep in a library with no cell frame yet: not from a cell
        frame, depth = frame.f_back, depth + 1
    if inner is None:
        return Caller(None, None, "", None, None)

    def cell_of(f: Any) -> int:
        return int(f.f_code.co_filename[len(prefix) : -1])

    return Caller(cell_of(inner), inner.f_lineno, inner.f_code.co_name, cell_of(outer), outer.f_lineno)


class CallLog:
    """The recent watched calls of this rank, newest last; safe to read from the control thread."""

    def __init__(self, cell_prefix: str, keep: int = _KEEP, black_box: BlackBox | None = None,
                 running: Callable[[], int | None] | None = None) -> None:
        self._prefix = cell_prefix  # cells' code objects are named ``<prefix>N>``
        # The cell running now, whoever calls (a thread's call is issued in it too); None: the
        # outermost cell frame of the calling thread says.
        self._running = running
        # Where each call is also written as it begins, for the supervisor to read if the rank
        # dies inside it (wire/black_box.py); None outside a pool (an attached job).
        self.black_box = black_box
        self._records: collections.deque[CallRecord] = collections.deque(maxlen=keep)
        self._works: dict[int, Any] = {}  # open isend/irecv record → its Work
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self.installed = False
        # Point-to-point calls per group name since the last reset (never trimmed).
        self.p2p_counts: collections.Counter[str] = collections.Counter()
        # Per group, a digest of this cell's watched collective calls (op, the arguments that must
        # match, input shapes and dtypes): ranks that made as many collectives on a group but with
        # other arguments show it at the cell's end, though nothing hung (a reduce op, a shape).
        self.digests: dict[str, int] = {}
        # torch's group counter less the counts groups made with use_local_synchronization took:
        # only their members make those, so they must not count in the step every rank keeps.
        # torch 2.13 and older skip them in its counter; 2.14 and newer count them (on members only).
        self._local_counts = 0
        self._last_count = 0

    def creations_in_step(self) -> int | None:
        """The groups this rank made that every rank must make too: torch's counter less the
        local ones (None before torch.distributed is up)."""
        count = group_count()
        if count is None:
            return None
        if count < self._last_count:  # destroy_process_group started torch's counter over
            self._local_counts = 0
        self._last_count = count
        return count - self._local_counts

    def begin(self, fn: str, group: Any, args: dict[str, Any], inputs: Any = None) -> CallRecord:
        where = _caller(self._prefix)
        rec: CallRecord = {
            "n": next(self._next), "op": fn, "group": group_name(group), "args": args,
            "t": time.time_ns(), "end": None, "cell": where.cell, "line": where.line, "func": where.func,
        }
        running = self._running() if self._running is not None else where.outer_cell
        if running is not None and running != where.cell:
            # A function an earlier cell defined, called from this one: issued in this cell, at
            # the line of it that called the function.
            rec["in_cell"] = running
            if where.outer_cell == running and where.outer_line is not None:
                rec["in_line"] = where.outer_line
        if fn != "new_group" and not_a_member(group):
            rec["skipped"] = True
        if fn == "new_group":
            in_step = self.creations_in_step()  # read for a local one too: it notes torch's counter before the call
            if args.get("use_local_synchronization"):
                rec["count"], rec["local"] = None, True
            else:
                rec["count"] = in_step
        elif fn in P2P_OPS:
            self.p2p_counts[rec["group"]] += 1
            side = "dst" if P2P_OPS[fn] == "send" else "src"
            if args.get(side) is None and args.get(f"group_{side}") is not None:
                # Named by its rank in the group (pipelining's stages do): the global rank, which
                # the other side's call names, matches the pair.
                args[side] = global_rank(group, args[f"group_{side}"])
            # No recorder sees a send's or receive's tensor on gloo: its shape, which sender and
            # receiver must agree on, is kept here (a few µs).
            shapes = _shapes(inputs)
            if shapes:
                rec["sizes"], rec["dtypes"] = shapes["sizes"], shapes["dtypes"]
        else:
            kept = sorted((k, v) for k, v in args.items() if k not in _PER_RANK and v is not None)
            shapes = _shapes(inputs) if fn not in _ROOT_ONLY else {}
            name = rec["group"]
            # crc32, not hash(): the digest is compared across processes, whose str hashes differ.
            self.digests[name] = zlib.crc32(repr((self.digests.get(name), fn, kept, shapes)).encode())
        if self.black_box is not None:
            # A collective as the recorder's entry would say, had the rank lived to push it: its
            # shapes and its number in the group's sequence (torch's counter before the call issues it).
            collective = fn != "new_group" and fn not in P2P_OPS
            self.black_box.write(rec, shapes if collective else None, next_seq(group) if collective else None)
        self._records.append(rec)
        return rec

    def end(self, rec: CallRecord, work: Any = None) -> None:
        if work is not None and rec["op"] in _ASYNC:
            with self._lock:
                self._works[rec["n"]] = work  # open until the work completes (checked on read)
            return
        if self.black_box is not None:
            self.black_box.ended(rec["n"])
        if rec["op"] == "new_group":
            if rec.get("local") and (count := group_count()) is not None:
                self._local_counts += max(0, count - self._last_count)  # what this torch's counter took for it
                self._last_count = count
            made = group_name(work) if work is not None else "?"  # a rank outside the group gets no group: "?"
            if made != "?":
                rec["made"] = made
        rec["end"] = time.time_ns()

    def reset(self) -> None:
        """A new process group generation (regroup): group names and counts start over."""
        with self._lock:
            self._records.clear()
            self._works.clear()
            self.p2p_counts.clear()
            self.digests.clear()

    def since(self, n: int) -> list[CallRecord]:
        """Records newer than ``n`` plus every one still open (it may have ended since)."""
        self._poll_works()
        return [r.copy() for r in list(self._records) if r["n"] > n or r["end"] is None]

    def newest(self) -> int:
        """The number of the newest call recorded (0: none): a cheap "did a call start?" for a
        watcher on another thread (``worker/process/job_records.py``)."""
        records = self._records
        try:
            return records[-1]["n"] if records else 0
        except IndexError:  # emptied between the two reads (a reset)
            return 0

    def open_p2p(self) -> list[CallRecord]:
        """The point-to-point calls not completed (a blocking send/recv in progress, an
        isend/irecv whose work has not completed): what a main thread stuck in ``work.wait()``
        waits for, where no recorder and no torch.distributed frame says so."""
        self._poll_works()
        return [r.copy() for r in list(self._records) if r["op"] in P2P_OPS and r["end"] is None]

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

    def annotate(self, entries: list[CollectiveEntry], created_ns: list[int]) -> None:
        """Give each Flight Recorder entry the arguments of the call that created it."""
        by_group: dict[str, list[CallRecord]] = {}
        for r in list(self._records):
            if r["op"] not in P2P_OPS and r["op"] != "new_group":
                by_group.setdefault(r["group"], []).append(r)
        for e, t in zip(entries, created_ns):
            recs = by_group.get(e["group"])
            if not recs:
                continue
            i = bisect.bisect_right(recs, t, key=lambda r: r["t"]) - 1
            end = recs[i]["end"] if i >= 0 else None
            if i >= 0 and (end is None or t <= end):
                rec = recs[i]
                e["args"] = {k: v for k, v in rec["args"].items() if v is not None}
                if rec["line"] is not None:
                    e["line"], e["func"], e["call_cell"] = rec["line"], rec["func"], rec["cell"]
                    if rec.get("in_line") is not None:
                        e["in_line"] = rec["in_line"]


def _wrap(log: CallLog, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn).parameters
    params = list(sig)
    # Defaults filled in: ``all_reduce(x)`` and ``all_reduce(x, op=SUM)`` are the same call.
    keep = [(k, params.index(k), None if sig[k].default is inspect.Parameter.empty else sig[k].default)
            for k in WATCHED[name] if k in params]
    group_at = params.index("group") if "group" in params else None
    input_at = next(((params.index(k), k) for k in _INPUTS if k in params), None)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # e.g. send → isend in torch itself: the user's call is the record
            return fn(*args, **kwargs)
        try:
            got = {k: _plain(args[i] if i < len(args) else kwargs.get(k, d)) for k, i, d in keep}
            group = args[group_at] if group_at is not None and group_at < len(args) else kwargs.get("group")
        except Exception:  # recording must never break the user's call
            return fn(*args, **kwargs)
        main = threading.get_ident() == _MAIN
        if main:
            STOPS.calling = (name, group, got)  # before the flags are read (see StopFlags)
            if STOPS.hold or STOPS.gone or STOPS.every:
                try:
                    _stop(log, name, group, got, _inputs(args, kwargs, input_at))
                except BaseException:
                    STOPS.calling = None
                    raise
        try:
            rec = log.begin(name, group, got, _inputs(args, kwargs, input_at) if name != "new_group" else None)
        except Exception:
            rec = None
        work = None
        _inside.call = True
        try:
            work = fn(*args, **kwargs)
            return work
        finally:
            _inside.call = False
            if main:
                STOPS.calling = None
            if rec is not None:
                log.end(rec, work)

    return call


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any], at: tuple[int, str] | None) -> Any:
    if at is None:
        return None
    return args[at[0]] if at[0] < len(args) else kwargs.get(at[1])


def _stop(log: CallLog, name: str, group: Any, got: dict[str, Any], inputs: Any) -> None:
    """Before the call: pause in the debugger if asked, then raise if it needs a rank that left."""
    why, STOPS.hold = STOPS.hold, ""
    hook = STOPS.hook
    if not why and STOPS.every and STOPS.panel_hook is not None:
        why, hook = "panel", STOPS.panel_hook
    frame = _cell_frame(log._prefix) if why and hook is not None else None
    if frame is not None and hook is not None:
        info = {"op": name, "group": group_name(group), "members": members(group), "desc": description(group),
                "args": {k: v for k, v in got.items() if v is not None}, **_shapes(inputs),
                "cell": int(frame.f_code.co_filename[len(log._prefix):-1]), "line": frame.f_lineno,
                "func": frame.f_code.co_name, "why": why}
        STOPS.calling = None  # paused, not in the call: a release that comes meanwhile is read below
        try:
            hook(info, frame)
        finally:
            STOPS.calling = (name, group, got)
    if STOPS.gone and needs(name, group, got, STOPS.gone):
        left = ",".join(map(str, sorted(STOPS.gone)))
        print(f"distnb: stopped before {name} on group {group_name(group)} rather than wait for rank{'s' * (len(STOPS.gone) > 1)} "
              f"{left}, which left this cell{f' ({STOPS.why})' if STOPS.why else ''}: nothing was issued.", file=sys.stderr, flush=True)
        raise LeftCell(f"rank {left} left the cell")


def c10d_calls() -> list[str]:
    """The torch.distributed functions the main thread is in now, outermost first (read from
    another thread: the control thread's watch and escalation, a HOLD's answer)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    names: list[str] = []
    for _ in range(64):
        if frame is None:
            break
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[::-1]


def needs(name: str, group: Any, got: dict[str, Any], ranks: frozenset[int]) -> bool:
    """Would this call wait for one of ``ranks``? (new_group needs every rank, or with
    use_local_synchronization its members; unknown: yes.)"""
    if name == "new_group":
        made_of = got.get("ranks")
        return not (got.get("use_local_synchronization") and made_of is not None) or bool(set(made_of) & ranks)
    if name in P2P_OPS:
        side = "dst" if P2P_OPS[name] == "send" else "src"
        peer = got.get(side)
        if peer is None and got.get(f"group_{side}") is not None:
            peer = global_rank(group, got[f"group_{side}"])
        return peer is None or peer in ranks
    inside = members(group)
    return inside is None or bool(set(inside) & ranks)


def _cell_frame(prefix: str) -> Any:
    """The innermost frame of a notebook cell on the main thread's stack (None outside cells)."""
    frame: Any = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return None
        if frame.f_code.co_filename.startswith(prefix) and frame.f_code.co_filename[len(prefix):-1].isdigit():
            return frame
        frame = frame.f_back
    return None


def _shapes(inputs: Any) -> dict[str, Any]:
    """The input tensors' shapes and dtypes, named as the Flight Recorder names them."""
    tensors = inputs if isinstance(inputs, (list, tuple)) else [] if inputs is None else [inputs]
    sizes, dtypes = [], []
    for t in tensors[:64]:
        shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
        if shape is None or dtype is None:
            continue
        sizes.append([int(n) for n in shape])
        name = _DTYPE_NAMES.get(dtype)
        if name is None:  # read once per dtype: str() of a dtype is slow enough to count per call
            short = str(dtype).rsplit(".", 1)[-1]
            name = _DTYPE_NAMES[dtype] = _DTYPES.get(short, short)
        dtypes.append(name)
    return {"sizes": sizes, "dtypes": dtypes} if sizes else {}


_DTYPE_NAMES: dict[Any, str] = {}


def install(log: CallLog) -> None:
    """Wrap the watched functions in ``torch.distributed`` and its ``distributed_c10d`` module
    (both bindings: ``dist.x`` reads the first, torch's own internal calls the second)."""
    wrap_c10d(WATCHED, lambda name, fn: _wrap(log, name, fn), "__distnb_wrapped__")
    log.installed = STOPS.watching = True
