"""The records every layer handles, typed once: a rank's watched call, a collective entry as the
controller keeps it, a read of a rank's collectives, and a cell's outcome on a rank.

A rank builds them (``worker/call_log.py``, ``worker/flight_recorder.py``, ``worker/execute.py``),
the wire carries them, the controller merges them (``controller/collective_log.py``,
``controller/tracker.py``) and the analyses read them: each field is named and typed here, so a
field added on the rank and misspelt where it is read is a type error, not a silent ``None``.
They stay TypedDicts, not dataclasses, because they cross processes as plain msgpack/JSON maps.
"""

from __future__ import annotations

import math
from typing import Any, Final, NamedTuple, TypedDict

__all__ = ["P2P_OPS", "UNRECORDED", "CallRecord", "CellError", "CellOutcome", "CollectiveEntry", "CollectivesRead", "InputRead", "NumericsRecord",
           "OpRecord", "OutputStats", "PeekFrame", "PeekRead", "SAMPLE", "SyncState", "TENSORS_READ", "ThreadError",
           "called_in", "issued_in"]

#: The id of an entry made from a watched call the recorder has no entry for yet (NCCL connecting
#: a communicator): above every real id, so it sorts after the rank's recorded calls.
UNRECORDED: Final = 1 << 62
#: The point-to-point functions the call log watches, and which side of a pair each is.
P2P_OPS: Final = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class _CallRecordCore(TypedDict):
    n: int  # the rank's own number for the call, from 1
    op: str  # the torch.distributed function called (``all_reduce``, ``isend``, ``new_group``)
    group: str  # the process group's name (``"0"`` the default group; ``"?"`` none known)
    args: dict[str, Any]  # the arguments that must agree across ranks (op, src, dst, tag, ranks …)
    t: int  # when it was called, the rank's wall clock in ns
    end: int | None  # when it returned (or its work completed); None while open
    cell: int | None  # the cell whose code holds ``line`` (None: not from a cell's code)
    line: int | None
    func: str


class CallRecord(_CallRecordCore, total=False):
    """A call the rank's call log watched (``worker/call_log.py``): point-to-point, group
    creation, and the arguments of every collective."""

    count: int | None  # new_group: how many groups the rank had created before it
    made: str  # new_group: the name of the group made (absent on ranks outside it)
    local: bool  # new_group with use_local_synchronization: only its members make it (count None)
    sizes: list[list[int]]  # the input tensors' shapes (point-to-point, the digested collectives)
    dtypes: list[str]
    splits: list[Any]  # all_to_all: the input and output split sizes
    seq: int | None  # a collective's place in its group's sequence, as torch counted it (the black box's calls)
    skipped: bool  # torch skipped the call: the rank is not a member of the group it names (a no-op, with a warning)
    in_cell: int  # the cell running when it was called, where that is not ``cell`` (a function an earlier cell defined)
    in_line: int  # the line of ``in_cell``'s code that led to the call


class CollectiveEntry(TypedDict, total=False):
    """A collective or point-to-point call as the controller keeps it: a Flight Recorder entry
    (``worker/flight_recorder.py``) given its Python call's arguments and line, or one the
    analyses reconstruct from a watched call the recorder did not see (then ``id`` is ``inf``)."""

    id: int  # distnb's id for the recorder entry, increasing per rank (UNRECORDED: made from a call)
    rec: str  # which recorder wrote it: "nccl" or "fr"
    group: str
    desc: str  # torch's description of the group (``mesh_dp``, ``default_pg``)
    seq: int  # its number in the group's sequence (of point-to-point calls for those); absent: not recorded yet
    p2p: bool
    op: str
    sizes: list[list[int]]
    dtypes: list[str]
    t: float  # when it was created, the rank's wall clock in s
    done: bool
    state: str  # the recorder's: scheduled, started, completed
    started: float | None  # when the GPU started and finished it (NCCL with timing on)
    ended: float | None
    queued: bool  # not started on the GPU yet (NCCL with timing on)
    cell: int | None  # the cell running when it was created
    call_cell: int | None  # the cell whose code holds its Python call's ``line`` and ``func`` (``cell`` issued it)
    line: int | None
    func: str
    in_line: int  # where ``call_cell`` is an earlier cell's function: the line of ``cell`` that called it
    file: str  # the script its call came from, for a job's own program (read from a Flight Recorder dump's frames)
    args: dict[str, Any]  # the arguments of the call that created it (``CallRecord.args``)
    peer: int  # point-to-point reconstructed from a call: the other rank


def issued_in(e: CollectiveEntry) -> int | None:
    """The cell that issued an entry: the rank's cell at the time (a function an earlier cell
    defined, called from this one, is this one's), else the cell of its Python call."""
    cell = e.get("cell")
    return int(cell) if cell is not None else e.get("call_cell")


def called_in(c: CallRecord) -> int | None:
    """The cell running when a watched call was made (see :func:`issued_in`)."""
    return c.get("in_cell", c.get("cell"))


class CollectivesRead(TypedDict, total=False):
    """One read of a rank's recorders and call log (the answer to a COLLECTIVES probe)."""

    entries: list[CollectiveEntry]
    calls: list[CallRecord]
    now: float  # the rank's wall clock at the read
    unavailable: str  # no recorder could be read, and why
    missing: dict[str, str]  # recorders that could not be read, and why
    groups: dict[str, list[int]]  # the groups' members, only when the rank's table changed since last sent (or asked)
    gkey: int  # the rank's group table's key, in every read: a missed ``groups`` shows as a new key
    descs: dict[str, str]  # group name → torch's description (mesh_dp …), with ``groups``


class PeekFrame(NamedTuple):
    """One frame of a rank's main thread, as a look into it (``worker/process/peek.py``) sees it."""

    filename: str
    line: int
    function: str
    code: str  # the source line
    user: bool  # the user's code: not the standard library, an installed package, distnb or the debugger


class PeekRead(TypedDict, total=False):
    """The answer to a PEEK: the main thread's frames, outermost first, and what was asked of one."""

    frames: list[PeekFrame]
    frame: int  # the frame looked at (an index into ``frames``)
    value: str  # the expression's value (repr, pretty-printed or cut to a length), or the names asked
    source: list[tuple[int, str]]  # (line number, text) for ``source`` and ``function``
    error: str  # why nothing came: the expression raised (its last line), or the rank refused


class SyncState(TypedDict, total=False):
    """What a cell left behind on a rank's groups (``worker/group_state.py``): compared across
    ranks at the cell's end, it shows a rank a call ahead before anything hangs."""

    seqs: dict[str, int]  # per group name, collectives issued since the pool's group was made
    created: int  # process groups created
    digests: dict[str, int]  # per group, a crc32 of this cell's calls (op, arguments, shapes)


class CellError(TypedDict, total=False):
    """A cell's exception on a rank, as the notebook shows it."""

    ename: str
    evalue: str
    traceback: str
    line: int | None  # the cell line it was raised at
    stale: dict[str, str]  # names still bound to an object holding a group a regroup closed: name → kind


class ThreadError(TypedDict):
    """An uncaught exception of one of a rank's other threads (worker/recorders/thread_errors.py)."""

    thread: str  # the thread's name
    ename: str
    evalue: str
    cell: int | None  # where it was raised: the innermost line in a notebook cell (None: not in one)
    line: int | None
    func: str
    during: int | None  # the cell running when it was raised


class _CellOutcomeCore(TypedDict):
    status: str  # "ok", "error", "interrupted"


class CellOutcome(_CellOutcomeCore, total=False):
    """A cell's outcome on one rank, as the executor builds it (a CELL_DONE without its header)."""

    value: dict[str, str] | None  # a MIME bundle
    error: CellError | None
    duration: float
    memory: dict[str, Any] | None
    profile: dict[str, Any]  # with EXEC's ``profile``: collective time, top ops, the zlib'd Chrome trace
    comms: dict[str, Any]  # with EXEC's ``comms``: collectives per module with group and bytes, redistributes
    numerics: NumericsRecord  # with EXEC's ``numerics``: the per-op record (worker/torch_hooks/numerics.py)
    sync: SyncState | None
    paths: dict[str, Any] | None  # the notebook lines' transitions the cell made (worker/paths.py)
    compiles: dict[str, Any] | None  # what torch.compile did during the cell (worker/compile_record.py)
    threads: list[ThreadError]  # uncaught exceptions of the rank's other threads during the cell
    imported: list[str]  # torch's modules (and its libraries') the cell imported first: a zygote's to load (worker/process/zygote.py)


# -- the per-op numerics record (%%on_ranks --numerics) ------------------------------------------
#: Tensors fingerprinted per op, in and out; an op with more reads only its first ones.
TENSORS_READ: Final = 8
#: Elements of each output and input kept as values (spread evenly; all of a smaller tensor), so
#: that a divergence has a size: its largest difference, exact where every element was kept.
SAMPLE: Final = 16


class OutputStats(NamedTuple):
    """One output tensor of an op, fingerprinted where it lives: ``hash`` is torch.hash_tensor (the
    xor of the elements' 64-bit bit patterns: one element changed always changes it; equal elements
    cancel in pairs, which the sum catches), ``total`` the float64 sum (NaN or ±inf exactly when an
    element is); a DTensor's local piece. The fingerprint is the pair."""

    shape: tuple[int, ...]
    dtype: str
    hash: int
    total: float
    sample: tuple[float, ...] = ()  # SAMPLE elements spread evenly in logical order (all of a smaller tensor), as float64

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class InputRead(NamedTuple):
    """A tensor argument as the op read it."""

    arg: int  # which tensor argument (flattened order)
    hash: int
    total: float  # as OutputStats: the fingerprint is (hash, total)
    agree: tuple[int, ...] | None  # the ranks that must hold the same value (None: none known)
    why: str  # how that is known (as OpRecord.why)
    label: str | None  # a name for a tensor from before the cell (``model.0.weight``, optimizer state)
    producer: int  # the op (``seq``) whose output it is; -1: not an output of a recorded op
    sample: tuple[float, ...] = ()  # as OutputStats.sample
    numel: int = 0
    # A sum of the elements at its two ends weighted by place: what tells it from a permutation of
    # it, which (hash, total) cannot. NaN: not read (an older record).
    order: float = math.nan

    @property
    def finite(self) -> bool:
        return self.total - self.total == 0  # False for NaN and ±inf


class OpRecord(NamedTuple):
    """One op the dispatcher ran on a rank, in execution order."""

    seq: int
    op: str  # ``aten.addmm.default``, ``c10d.allreduce_.default``
    module: str  # the module path running it (the forward's, for a backward op); ``optimizer step (Adam)``; "" none
    phase: str  # fwd · bwd · step · "" (outside any module)
    cell: int  # the notebook cell (its number) and line the op came from; 0 unknown
    line: int
    agree: tuple[int, ...] | None  # the ranks whose outputs must equal this one's; None: none known
    why: str  # how ``agree`` is known: "all_reduce", "Replicate", "inputs", "DDP" …
    outputs: list[OutputStats]  # empty for a collective whose output was never read
    inputs: list[InputRead]
    args: str  # a digest of the non-tensor arguments (a scalar, a dim, a group)
    random: bool  # the op draws from the RNG (torch's ``nondeterministic_seeded`` tag)
    collective: bool
    # Its outputs are fixed by what the record read: every tensor input read, and a kernel that gives
    # equal bits for equal inputs (a CPU one; an accelerator's only under
    # torch.use_deterministic_algorithms; never one torch tags ``nondeterministic_bitwise``). False
    # in a record that does not say (older ones): no agreement is inferred from its inputs.
    determined: bool = False
    rng: int = 0  # a random op: a fingerprint of its generator's state before it drew (0: not read)


class NumericsRecord(TypedDict, total=False):
    """What ``--numerics`` brings back from one rank: its ops in order, at most ``limit`` of them."""

    mode: str  # "ops" (every op) or "collectives" (collectives only: a cheap check for NaN/Inf)
    ops: list[OpRecord]
    total: int  # ops the rank ran under the record (``len(ops)`` unless past the limit)
    limit: int
    mesh_groups: dict[str, list[int]]  # per mesh dimension name of the meshes the cells hold: this rank's group
    error: str  # the record could not be made (a torch without what it reads): the cell still ran
