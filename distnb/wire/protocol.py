"""Wire protocol shared by the controller and the ranks.

A message is a dict with a ``"t"`` (type) key, pickled, and sent as one ZMQ frame
``MAGIC + signature + body`` where ``signature`` is keyed BLAKE2b of the body (see :func:`signature`),
or, for a body of 64 KiB or more, as two, ``[MAGIC + signature, body]``, so that a large body is
never copied to join them. (One frame, not three: every part costs a send and a receive call on
each side, and a cell's EXEC and CELL_DONE cross 8 ranks.) The signature is
checked *before* the body is unpickled, so a peer without the pool's key can never make
either side run pickle on its bytes. Each body also carries the sender's monotonically
increasing counter; a frame whose counter does not move forward is a replay and is dropped.

This module imports neither torch, IPython nor widgets: both sides speak only through it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import pickle
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

from distnb._text import mib

__all__ = [
    "BadFrame",
    "CellDone",
    "Codec",
    "CollectivesPush",
    "Display",
    "Event",
    "Exec",
    "FrameTooLarge",
    "Hello",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "Msg",
    "NodeBeat",
    "NodeExit",
    "NodeHello",
    "NodeOutput",
    "NodeRefused",
    "NodeStart",
    "Output",
    "RankExit",
    "Ready",
    "ReplayGuard",
    "Reply",
    "Request",
    "StartFailed",
    "StdinReply",
    "StdinRequest",
    "SupHello",
    "control_identity",
    "exec_identity",
    "generation_of",
    "in_generation",
    "new_key",
    "node_identity",
    "parse_identity",
    "mac",
    "socket_max_msgsize",
    "supervisor_identity",
]

#: DNB1 signed with HMAC-SHA256; a DNB1 frame is refused as not a distnb frame.
MAGIC = b"DNB2"
_SIG_LEN = 32
_HEADER_LEN = len(MAGIC) + _SIG_LEN
#: Bodies this large travel in a frame of their own (zero-copy); smaller ones are joined to the header.
_JOIN_BELOW = 65536
_DEFAULT_MAX_FRAME = 256 * 1024 * 1024
_MIN_MAX_FRAME = 1024 * 1024  # output chunks (64 KiB) and cell events must always fit
_MAX_MAX_FRAME = 2**31 - 1


def _max_frame_from_env() -> int:
    """The body limit, from ``DISTNB_MAX_FRAME_BYTES`` when set (1 MiB to 2 GiB), else 256 MiB.

    Ranks inherit the notebook's environment, so one setting covers both sides; a bad value is
    ignored rather than stopping a worker that has no way to report it yet.
    """
    text = os.environ.get("DISTNB_MAX_FRAME_BYTES", "")
    if text.strip().isdigit() and _MIN_MAX_FRAME <= int(text) <= _MAX_MAX_FRAME:
        return int(text)
    return _DEFAULT_MAX_FRAME


#: A message body larger than this is never sent (:class:`FrameTooLarge`) and is refused on receipt.
MAX_FRAME_BYTES = _max_frame_from_env()
#: Headroom over the body limit for ZMQ_MAXMSGSIZE: the limit applies to every part of a multipart
#: message on the wire, where CURVE adds a few dozen bytes of box and nonce to each.
_WIRE_SLACK = 64 * 1024


def socket_max_msgsize() -> int:
    """ZMQ_MAXMSGSIZE for every distnb socket: a peer sending a bigger part is disconnected by
    libzmq before it is buffered, so a peer without the key can't make us hold gigabytes."""
    return MAX_FRAME_BYTES + _WIRE_SLACK


class Msg:
    """Message kinds (plain strings in each message's ``"t"``). Each kind's fields are a
    ``TypedDict`` below, named after it (``SupHello`` for SUP_HELLO, ``CellDone`` for CELL_DONE …;
    ``Request`` covers every request the controller sends, ``Reply`` every answer).

    Who sends what, on which connection (identity prefix: ``x`` a rank's main thread, ``c`` its
    control thread, ``s`` its supervisor, ``n`` a node agent, ``C…`` the controller):
    """

    # s -> C
    SUP_HELLO = "sup_hello"  # the supervisor is up (pid, host, agent); again with the rank's child_pid
    OUTPUT = "output"  # a chunk of the rank's stdout/stderr
    EVENT = "event"  # a rank's CELL_DONE or DISPLAY, forwarded only after the output written before it
    RANK_EXIT = "rank_exit"  # the rank process ended: returncode, time of death, stderr tail
    # x -> C (HELLO, READY, START_FAILED; CELL_DONE of a silent cell; REPLY to PUSH/PULL/CHECK/REGROUP)
    HELLO = "hello"
    READY = "ready"
    START_FAILED = "start_failed"
    CELL_DONE = "cell_done"  # a cell finished on the rank (value, error, duration, memory)
    DISPLAY = "display"  # a rank's display() bundle (inside EVENT)
    STDIN_REQUEST = "stdin_request"  # a cell wants a line: pdb's next command or input() (inside EVENT)
    # x, c, s -> C: the answer to a request, matched to it by ``id``
    REPLY = "reply"
    # c -> C, unasked: new Flight Recorder entries, within ~50 ms of a collective being issued
    COLLECTIVES_PUSH = "collectives_push"
    # C -> x (main thread: runs in order with cells)
    EXEC = "exec"
    PUSH = "push"
    PULL = "pull"
    CHECK = "check"
    REGROUP = "regroup"
    STDIN_REPLY = "stdin_reply"  # the line for a STDIN_REQUEST (read by the cell waiting for it)
    # C -> c (control thread: answers while a cell runs)
    STACKS = "stacks"
    ENV = "env"
    MEMORY = "memory"
    COLLECTIVES = "collectives"
    INTERRUPT = "interrupt"
    WATCH = "watch"  # the cell has run a while: look at its collectives until it ends (unanswered)
    # C -> s
    PING = "ping"  # the controller's heartbeat (also to node agents)
    FAULT_REQUEST = "fault_request"  # SIGUSR1 the rank so faulthandler dumps every thread
    RESPAWN = "respawn"  # kill the rank; its spare (or a new process) joins process group generation N
    SPARE = "spare"  # start a spare rank process (torch imported, waiting) for the next RESPAWN
    SHUTDOWN = "shutdown"  # also to node agents
    # n -> C (a node agent, ``python -m distnb.node``, on another machine)
    NODE_HELLO = "node_hello"
    NODE_BEAT = "node_beat"  # alive pids of its torchrun's process tree, twice a second
    NODE_OUTPUT = "node_output"  # lines of its torchrun agent's own output
    NODE_EXIT = "node_exit"  # its torchrun ended
    # C -> n
    NODE_START = "node_start"  # the launch config and rendezvous to run torchrun with
    NODE_REFUSED = "node_refused"  # why this agent may not join (pool full, version mismatch)


# -- message fields ------------------------------------------------------------------------------
# One TypedDict per kind. ``t`` is the kind; the codec adds ``_s`` (sender) and ``_n`` (counter).
# Requests carry an ``id`` that their REPLY repeats.


class SupHello(TypedDict, total=False):
    t: str
    rank: int
    pid: int
    host: str
    local_rank: int
    group_rank: int  # torchrun's GROUP_RANK: the node's index in the job
    agent: int  # the node agent that started it; 0: the controller's machine
    child_pid: int  # in the second hello, once the rank process exists (again after each RESPAWN)


class Output(TypedDict):
    t: str
    stream: str  # "stdout" or "stderr"
    data: bytes


class Event(TypedDict):
    t: str
    body: bytes  # a pickled CellDone or Display, as the rank wrote it to its private events pipe


class RankExit(TypedDict):
    t: str
    rank: int
    returncode: int
    stderr_tail: str
    time: float  # the supervisor's wall clock when it reaped the rank


class Hello(TypedDict):
    t: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    host: str
    main_ident: int | None


class Ready(TypedDict):
    t: str
    rank: int
    device: str
    backend: str


class StartFailed(TypedDict):
    t: str
    rank: int
    error: str  # the traceback
    summary: str


class CellDone(TypedDict, total=False):
    t: str
    cell: int
    status: str  # "ok", "error", "interrupted"
    value: dict[str, str] | None  # a MIME bundle
    error: dict[str, Any] | None  # ename, evalue, traceback, line
    duration: float
    memory: dict[str, Any] | None
    profile: dict[str, Any]  # with EXEC's ``profile``: collective time, top ops, the zlib'd Chrome trace
    sync: dict[str, Any] | None  # collectives issued per group and groups created (worker/group_state.py)


class StdinRequest(TypedDict):
    t: str
    id: int  # per rank; the STDIN_REPLY repeats it
    cell: int
    kind: str  # "pdb" (the debugger's next command) or "input" (input(), sys.stdin)
    prompt: str
    output: str  # what pdb wrote since the last command (its answer to it)
    where: dict[str, Any] | None  # file, line, func, cell, code, context: where pdb stands
    mode: str  # "breakpoint" or "post_mortem"


class StdinReply(TypedDict, total=False):
    t: str
    id: int
    text: str
    detach: bool  # pdb: continue, and ignore this cell's remaining breakpoints
    eof: bool  # no line can be had (no input box): input() raises EOFError, pdb continues detached
    why: str


class Display(TypedDict):
    t: str
    cell: int
    data: dict[str, str]


class Reply(TypedDict, total=False):
    """The answer to a request: ``id`` is the request's; the other fields depend on it (``status``
    and ``error`` for the main thread's, the probe's data for the control thread's, ``text`` and
    ``alive`` for a supervisor's faulthandler dump)."""

    t: str
    id: str
    rank: int
    status: str
    error: str


class CollectivesPush(TypedDict, total=False):
    """Also the reply to COLLECTIVES: Flight Recorder entries (each with the ``args`` of the call
    that made it, when watched), the watched calls (point-to-point, group creation) and the
    rank's clock."""

    t: str
    rank: int
    entries: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    now: float
    groups: dict[str, list[int]]
    unavailable: str


class Exec(TypedDict, total=False):
    t: str
    cell: int
    code: str
    compiled: bytes  # the code objects, compiled by the notebook (distnb.wire.cell_code.pack); the rank compiles code itself without them
    profile: bool  # run under torch.profiler (%%on_ranks --profile)
    pdb: bool  # an exception opens the debugger at its frame (%%on_ranks --pdb)
    debug_last: bool  # instead of code: the debugger at the last error's frame (%dist_debug)


class Request(TypedDict, total=False):
    """PUSH (values), PULL (names), CHECK (names), REGROUP (generation), STACKS (all_threads,
    collectives_since, calls_since), ENV, MEMORY, COLLECTIVES (since, calls_since), INTERRUPT
    (cell), FAULT_REQUEST (wait); to supervisors, unanswered: RESPAWN (generation), SPARE."""

    t: str
    id: str
    values: bytes
    names: list[str]
    generation: int
    all_threads: bool
    collectives_since: int
    calls_since: int
    since: int
    cell: int | None
    wait: float


class NodeHello(TypedDict):
    t: str
    host: str
    pid: int
    version: str


class NodeBeat(TypedDict):
    t: str
    pids: list[int]
    torchrun: int | None


class NodeOutput(TypedDict):
    t: str
    lines: list[str]


class NodeExit(TypedDict):
    t: str
    returncode: int | None
    why: str
    tail: str


class NodeStart(TypedDict):
    t: str
    config: Any  # distnb.config.LaunchConfig (not imported here: this module stays dependency-free)
    rdzv: Any  # distnb.config.Rendezvous


class NodeRefused(TypedDict):
    t: str
    reason: str


def new_key() -> bytes:
    """A fresh random per-pool signing key."""
    return secrets.token_bytes(32)


def in_generation(identity: bytes, generation: int) -> bytes:
    """A rank's connection name in respawn generation N: ranks respawned under a running torchrun
    connect as ``x3.N``/``c3.N``, a fresh name, so the controller's ROUTER never sees it while the
    old rank's connection may still be open (ZMQ then silently ignores the newcomer for good).
    Supervisors and node agents keep their names."""
    return b"%s.%d" % (identity, generation) if generation and identity[:1] in (b"x", b"c") else identity


def exec_identity(rank: int, generation: int = 0) -> bytes:
    """A rank's main-thread connection (see :func:`in_generation`)."""
    return in_generation(b"x%d" % rank, generation)


def control_identity(rank: int, generation: int = 0) -> bytes:
    return in_generation(b"c%d" % rank, generation)


def supervisor_identity(rank: int) -> bytes:
    return b"s%d" % rank


def node_identity(agent_id: int) -> bytes:
    return b"n%d" % agent_id


def parse_identity(identity: bytes) -> tuple[str, int]:
    """``b"x3"`` (or ``b"x3.2"``) -> ``("x", 3)``; raises :class:`BadFrame` for anything else."""
    name, dot, generation = identity.partition(b".")
    if (len(identity) < 2 or len(identity) > 24 or name[:1] not in (b"x", b"c", b"s", b"n") or not name[1:].isdigit()
            or dot and (name[:1] not in (b"x", b"c") or not generation.isdigit())):
        raise BadFrame(f"unknown peer identity {identity[:16]!r}")
    return name[:1].decode(), int(name[1:])


def generation_of(identity: bytes) -> int:
    """The respawn generation a rank's connection belongs to (0: the ranks torchrun started)."""
    _, dot, generation = identity.partition(b".")
    return int(generation) if dot and generation.isdigit() else 0


class BadFrame(Exception):
    """A frame that is malformed, oversized, wrongly signed or replayed."""


class FrameTooLarge(ValueError):
    """A message whose pickled body exceeds :data:`MAX_FRAME_BYTES`; raised by :meth:`Codec.encode`
    before anything is sent, because the receiver would drop it and the sender would wait in vain.

    ``size`` and ``limit`` are in bytes, so a caller can name the culprit in its own words.
    """

    def __init__(self, size: int, limit: int, what: str = "message") -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} of {mib(size)} ({size:,} bytes pickled) exceeds distnb's limit of {mib(limit)} per message; "
            "send less at a time (a slice or a summary), or save it to a file both sides can read "
            "(torch.save / torch.load). The limit can be raised with DISTNB_MAX_FRAME_BYTES before launching."
        )


@dataclass
class ReplayGuard:
    """Remembers the highest counter seen per sender and rejects anything not above it."""

    _last: dict[str, int] = field(default_factory=dict)

    def check(self, sender: str, counter: int) -> None:
        last = self._last.get(sender, -1)
        if counter <= last:
            raise BadFrame(f"replayed or reordered frame from {sender} ({counter} <= {last})")
        self._last[sender] = counter

    def forget(self, sender: str) -> None:
        self._last.pop(sender, None)


def mac(key: bytes, body: bytes | memoryview) -> bytes:
    """The 32-byte signature of ``body``: BLAKE2b in its keyed mode, a MAC by design (RFC 7693).

    Not HMAC-SHA256, which was a fifth of a trivial cell's control-plane CPU: OpenSSL 3 looks the
    algorithm up again on every call, and on a machine whose caches the ranks share that cost
    ~20 µs a message. BLAKE2b is CPython's own code, one call, ~1 µs. A key longer than BLAKE2b
    takes (64 bytes) is hashed down to one first."""
    if len(key) > 64:
        key = hashlib.blake2b(key).digest()
    return hashlib.blake2b(body, key=key, digest_size=_SIG_LEN).digest()


class Codec:
    """Signs and encodes messages for one sender; verifies and decodes for one receiver."""

    def __init__(self, key: bytes, sender: str) -> None:
        if len(key) < 16:
            raise ValueError("the signing key must be at least 16 bytes")
        self._key = key
        self.sender = sender
        # Start from the clock so a sender that re-creates its codec keeps counting upwards.
        self._counter = itertools.count(time.time_ns())
        self.rejected = 0

    def encode(self, msg: dict[str, Any]) -> list[bytes]:
        """Sign ``msg``; raises :class:`FrameTooLarge` for a body the receiver would refuse."""
        msg["_s"] = self.sender
        msg["_n"] = next(self._counter)
        body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > MAX_FRAME_BYTES:
            raise FrameTooLarge(len(body), MAX_FRAME_BYTES, f"a {msg.get('t', '?')!s} message")
        header = MAGIC + mac(self._key, body)
        return [header + body] if len(body) < _JOIN_BELOW else [header, body]

    def decode(self, frames: list[bytes], guard: ReplayGuard | None = None) -> dict[str, Any]:
        """Verify and unpickle; raise :class:`BadFrame` (and count it) for any bad frame."""
        body: bytes | memoryview
        try:
            if len(frames) == 1:
                header, body = frames[0][:_HEADER_LEN], memoryview(frames[0])[_HEADER_LEN:]
            elif len(frames) == 2:
                header, body = frames
            else:
                raise BadFrame("not a distnb frame")
            if header[: len(MAGIC)] != MAGIC:
                raise BadFrame("not a distnb frame")
            sig = header[len(MAGIC):]
            if len(sig) != _SIG_LEN:
                raise BadFrame("bad signature length")
            if len(body) > MAX_FRAME_BYTES:
                raise BadFrame(f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
            if not hmac.compare_digest(sig, mac(self._key, body)):
                raise BadFrame("bad signature")
            try:
                msg = pickle.loads(body)
            except Exception as exc:  # signed but undecodable: a bug or a mismatched version
                raise BadFrame(f"undecodable body: {exc!r}") from None
            if not isinstance(msg, dict) or "t" not in msg:
                raise BadFrame("body is not a message")
            counter = msg.get("_n", -1)
            if not isinstance(counter, int) or isinstance(counter, bool):
                raise BadFrame("frame has no valid counter")
            if guard is not None:
                guard.check(str(msg.get("_s")), counter)
            return msg
        except BadFrame:
            self.rejected += 1
            raise
