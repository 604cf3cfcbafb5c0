"""What the controller and the ranks say to each other: message kinds and one typed body per kind.

A message is a dict whose ``"t"`` names its kind (a plain string on the wire: no enum is pickled
into every frame). Each kind's fields are a ``TypedDict`` whose ``t`` is a ``Literal``, so a
receiver that dispatches on ``msg["t"] == Msg.CELL_DONE`` has its message narrowed to
:class:`CellDone` by mypy. What each kind of peer may send is a union (:data:`FromExec`,
:data:`FromControl`, :data:`FromSupervisor`, :data:`FromNode`, and the ranks' side:
:data:`ToExec`, :data:`ToControl`, :data:`ToSupervisor`, :data:`ToNode`); :func:`accept` checks a
decoded message against its peer's union (known kind, required fields present) before any handler
sees it, so a malformed message is rejected and counted, never half-handled.

Framing and signatures are :mod:`distnb.wire.codec`'s, connection names :mod:`distnb.wire.peers`'.
This module imports neither torch, IPython nor widgets: both sides speak only through the wire.
"""

from __future__ import annotations

import typing
from typing import Any, Final, Literal, TypedDict, cast, overload

from distnb.wire.codec import BadFrame
from distnb.wire.peers import PeerKind
from distnb.wire.record_types import CallRecord, CellOutcome, CollectivesRead

__all__ = [
    "CellDone",
    "CollectivesPush",
    "Dap",
    "DapPush",
    "Display",
    "Event",
    "Exec",
    "FromControl",
    "FromExec",
    "FromNode",
    "FromSupervisor",
    "Hello",
    "Hold",
    "Inbound",
    "Msg",
    "NodeBeat",
    "NodeExit",
    "NodeHello",
    "NodeOutput",
    "NodeRefused",
    "NodeStart",
    "Output",
    "Peek",
    "RankEvent",
    "RankExit",
    "Ready",
    "Reply",
    "Request",
    "StartFailed",
    "StdinReply",
    "StdinRequest",
    "SupHello",
    "ToControl",
    "ToExec",
    "ToNode",
    "ToSupervisor",
    "accept",
    "accept_event",
    "accept_request",
]


class Msg:
    """Message kinds (plain strings in each message's ``"t"``; ``Final``, so mypy reads each as
    its ``Literal`` and narrows on it). Each kind's fields are a ``TypedDict`` below, named after
    it (``SupHello`` for SUP_HELLO, ``CellDone`` for CELL_DONE …; ``Request`` covers every request
    the controller sends, ``Reply`` every answer).

    Who sends what, on which connection (identity prefix: ``x`` a rank's main thread, ``c`` its
    control thread, ``s`` its supervisor, ``n`` a node agent, ``C…`` the controller):
    """

    # s -> C
    SUP_HELLO: Final = "sup_hello"  # the supervisor is up (pid, host, agent); again with the rank's child_pid
    OUTPUT: Final = "output"  # a chunk of the rank's stdout/stderr
    EVENT: Final = "event"  # a rank's CELL_DONE or DISPLAY, forwarded only after the output written before it
    RANK_EXIT: Final = "rank_exit"  # the rank process ended: returncode, time of death, stderr tail
    # x -> C (HELLO, READY, START_FAILED; CELL_DONE of a silent cell; REPLY to PUSH/PULL/CHECK/REGROUP)
    HELLO: Final = "hello"
    READY: Final = "ready"
    START_FAILED: Final = "start_failed"
    CELL_DONE: Final = "cell_done"  # a cell finished on the rank (value, error, duration, memory)
    DISPLAY: Final = "display"  # a rank's display() bundle (inside EVENT)
    STDIN_REQUEST: Final = "stdin_request"  # a cell wants a line: pdb's next command or input() (inside EVENT)
    # x, c, s -> C: the answer to a request, matched to it by ``id``
    REPLY: Final = "reply"
    # c -> C, unasked: new Flight Recorder entries, within ~50 ms of a collective being issued
    COLLECTIVES_PUSH: Final = "collectives_push"
    # c -> C, unasked: DAP messages (responses, events) from the rank's debugpy (worker/process/panel_link.py)
    DAP_PUSH: Final = "dap_push"
    # C -> x (main thread: runs in order with cells)
    EXEC: Final = "exec"
    PUSH: Final = "push"
    PULL: Final = "pull"
    CHECK: Final = "check"
    REGROUP: Final = "regroup"
    STDIN_REPLY: Final = "stdin_reply"  # the line for a STDIN_REQUEST (read by the cell waiting for it)
    # C -> c (control thread: answers while a cell runs)
    STACKS: Final = "stacks"
    ENV: Final = "env"
    MESHES: Final = "meshes"  # the rank's device meshes: shape, dimension names, coordinates, groups
    MEMORY: Final = "memory"
    COLLECTIVES: Final = "collectives"
    INTERRUPT: Final = "interrupt"
    WATCH: Final = "watch"  # the cell has run a while: look at its collectives until it ends (unanswered)
    HOLD: Final = "hold"  # before the next collective: pause in the debugger, or raise rather than wait for ranks that left
    DAP: Final = "dap"  # DAP requests for the rank's debugpy (started on the first); answers come as DAP_PUSH
    PEEK: Final = "peek"  # an attached job's rank: its main thread's frames, or an expression evaluated in one (%dist_debug)
    # C -> s
    PING: Final = "ping"  # the controller's heartbeat (also to node agents)
    FAULT_REQUEST: Final = "fault_request"  # SIGUSR1 the rank's main thread so faulthandler dumps its stack
    RESPAWN: Final = "respawn"  # kill the rank; its spare (or a new process) joins process group generation N
    SPARE: Final = "spare"  # start a spare rank process (torch imported, waiting) for the next RESPAWN
    SHUTDOWN: Final = "shutdown"  # also to node agents
    # n -> C (a node agent, ``python -m distnb.node``, on another machine)
    NODE_HELLO: Final = "node_hello"
    NODE_BEAT: Final = "node_beat"  # alive pids of its torchrun's process tree, twice a second
    NODE_OUTPUT: Final = "node_output"  # lines of its torchrun agent's own output
    NODE_EXIT: Final = "node_exit"  # its torchrun ended
    # C -> n
    NODE_START: Final = "node_start"  # the launch config and rendezvous to run torchrun with
    NODE_REFUSED: Final = "node_refused"  # why this agent may not join (pool full, version mismatch)


# -- message fields ------------------------------------------------------------------------------
# One TypedDict per kind. ``t`` is the kind; the codec adds ``_s`` (sender) and ``_n`` (counter).
# Requests carry an ``id`` that their REPLY repeats.

class SupHello(TypedDict, total=False):
    t: Literal["sup_hello"]
    rank: int
    pid: int
    host: str
    local_rank: int
    group_rank: int  # torchrun's GROUP_RANK: the node's index in the job
    agent: int  # the node agent that started it; 0: the controller's machine
    child_pid: int  # in the second hello, once the rank process exists (again after each RESPAWN)


class Output(TypedDict):
    t: Literal["output"]
    stream: str  # "stdout" or "stderr"
    data: bytes


class Event(TypedDict):
    t: Literal["event"]
    body: bytes  # a pickled CellDone or Display, as the rank wrote it to its private events pipe


class _RankExitCore(TypedDict):
    t: Literal["rank_exit"]
    rank: int
    returncode: int
    stderr_tail: str
    time: float  # the supervisor's wall clock when it reaped the rank


class RankExit(_RankExitCore, total=False):
    last_calls: list[CallRecord]  # a death's: the calls its black box held (wire/black_box.py)


class Hello(TypedDict):
    t: Literal["hello"]
    rank: int
    local_rank: int
    world_size: int
    pid: int
    host: str
    main_ident: int | None


class Ready(TypedDict):
    t: Literal["ready"]
    rank: int
    device: str
    backend: str


class StartFailed(TypedDict):
    t: Literal["start_failed"]
    rank: int
    error: str  # the traceback
    summary: str


class CellDone(CellOutcome):
    """A cell finished on the rank: its outcome (:class:`~distnb.wire.record_types.CellOutcome`)."""

    t: Literal["cell_done"]
    cell: int


class StdinRequest(TypedDict):
    t: Literal["stdin_request"]
    id: int  # per rank; the STDIN_REPLY repeats it
    cell: int
    kind: str  # "pdb" (the debugger's next command) or "input" (input(), sys.stdin)
    prompt: str
    output: str  # what pdb wrote since the last command (its answer to it)
    where: dict[str, Any] | None  # file, line, func, cell, code, context: where pdb stands
    mode: str  # "breakpoint" or "post_mortem"


class StdinReply(TypedDict, total=False):
    t: Literal["stdin_reply"]
    id: int
    text: str
    detach: bool  # pdb: continue, and ignore this cell's remaining breakpoints
    eof: bool  # no line can be had (no input box): input() raises EOFError, pdb continues detached
    why: str


class Display(TypedDict):
    t: Literal["display"]
    cell: int
    data: dict[str, str]


class _ReplyKind(TypedDict):
    t: Literal["reply"]
    id: str


class Reply(_ReplyKind, total=False):
    """The answer to a request: ``id`` is the request's; the other fields depend on it (``status``
    and ``error`` for the main thread's, the probe's data for the control thread's, ``text`` and
    ``alive`` for a supervisor's faulthandler dump)."""

    rank: int
    status: str
    error: str


class CollectivesPush(CollectivesRead, total=False):
    """A read of the rank's recorders and call log (:class:`~distnb.wire.record_types.CollectivesRead`)
    the rank's control thread pushes unasked; a :class:`Reply` to COLLECTIVES carries the same
    fields."""

    t: Literal["collectives_push"]
    rank: int
    pid: int  # the rank's process: a push from the process a restart replaced is not this rank's


class Exec(TypedDict, total=False):
    t: Literal["exec"]
    cell: int
    code: str
    compiled: bytes  # the code objects, compiled by the notebook (distnb.wire.cell_code.pack); the rank compiles code itself without them
    profile: int  # run under torch.profiler (%%on_ranks --profile), started together on this many ranks
    comms: bool  # run under PyTorch's CommDebugMode (%%on_ranks --comms)
    numerics: str  # record every op ("ops") or the collectives ("collectives") with fingerprints (%%on_ranks --numerics)
    pdb: bool  # an exception opens the debugger at its frame (%%on_ranks --pdb)
    paths: bool  # record which of the notebook's lines ran (%%on_ranks --paths; absent: the rank's default)
    debug_last: bool  # instead of code: the debugger at the last error's frame (%dist_debug)
    source: dict[str, Any]  # the notebook cell this code is: {"path", "line"} (the debugger panel maps its breakpoints)


class Request(TypedDict, total=False):
    """PUSH (values), PULL (names), CHECK (names), REGROUP (generation), STACKS (all_threads,
    collectives_since, calls_since), ENV, MESHES, MEMORY, COLLECTIVES (since, calls_since), INTERRUPT
    (cell), FAULT_REQUEST (wait); to supervisors, unanswered: RESPAWN (generation), SPARE."""

    t: Literal["push", "pull", "check", "regroup", "stacks", "env", "meshes", "memory", "collectives", "interrupt", "fault_request", "respawn"]
    id: str
    values: bytes
    names: list[str]
    generation: int
    all_threads: bool
    collectives_since: int
    calls_since: int
    since: int
    groups: bool  # STACKS, COLLECTIVES: send the groups' members even if unchanged
    paths: bool  # STACKS: with the running cell's path record so far
    cell: int | None
    wait: float


class Hold(TypedDict, total=False):
    """What the rank's main thread does just before its next watched collective (worker/torch_hooks/call_log.py):
    ``mode`` "hold" pauses it in the debugger there (the console holds the pool at one point);
    "release" makes a call that needs one of ``ranks`` (they left the cell) raise instead of wait.
    The REPLY says where the rank is: ``state`` running · inside (a collective, named) · paused · finished."""

    t: Literal["hold"]
    id: str
    cell: int
    mode: str
    ranks: list[int]
    why: str


class _DapKind(TypedDict):
    t: Literal["dap"]
    id: str
    msgs: list[dict[str, Any]]


class Dap(_DapKind, total=False):
    """DAP requests for the rank's in-process debugpy, relayed by its control thread (the notebook's
    debugger panel, services/rank_debug.py); its REPLY says whether the link is up."""

    stops: bool  # the panel's "before each collective": on or off (worker/torch_hooks/call_log.py STOPS.every)
    consent: bool  # an attached job's rank: the notebook asked to debug it (%dist_debug)
    leave: bool  # an attached job's rank: these let its main thread go; stop tracing it once it has


class _PeekKind(TypedDict):
    t: Literal["peek"]
    id: str
    what: str  # frames · eval · exec · pretty · args · locals · source · function (worker/process/peek.py)


class Peek(_PeekKind, total=False):
    """A look into an attached job's rank from its control thread, the main thread left running
    (or held where debugpy paused it): its frames, or ``expr`` run in frame ``frame`` (an index
    into the frames, outermost first). Answered only with ``consent``: the notebook asked for it."""

    frame: int
    want: list[str]  # [filename, function] the notebook saw at ``frame``: a rank that ran on is looked at there, or says it returned
    expr: str
    consent: bool


class DapPush(TypedDict):
    t: Literal["dap_push"]
    rank: int
    msgs: list[dict[str, Any]]  # DAP responses and events, in the order debugpy sent them


class NodeHello(TypedDict):
    t: Literal["node_hello"]
    host: str
    pid: int
    version: str


class NodeBeat(TypedDict):
    t: Literal["node_beat"]
    pids: list[int]
    torchrun: int | None


class NodeOutput(TypedDict):
    t: Literal["node_output"]
    lines: list[str]


class NodeExit(TypedDict):
    t: Literal["node_exit"]
    returncode: int | None
    why: str
    tail: str


class NodeStart(TypedDict):
    t: Literal["node_start"]
    config: Any  # distnb.config.LaunchConfig (not imported here: this module stays dependency-free)
    rdzv: Any  # distnb.config.Rendezvous


class NodeRefused(TypedDict):
    t: Literal["node_refused"]
    reason: str


class Ping(TypedDict, total=False):
    t: Literal["ping", "shutdown", "watch"]  # unanswered words with no fields of their own


class Spare(TypedDict, total=False):
    """To a supervisor: keep a spare rank process for the next RESPAWN; with ``modules``, a zygote
    that has imported them and forks each fresh rank instead (worker/process/zygote.py)."""

    t: Literal["spare"]
    modules: list[str]


# -- who may send what ---------------------------------------------------------------------------
#: A rank's main thread, to the controller (a silent cell's CELL_DONE comes straight from it).
FromExec = Hello | Ready | StartFailed | CellDone | Reply
#: A rank's control thread: answers, and the collective entries it pushes unasked.
FromControl = Reply | CollectivesPush | DapPush
#: A rank's supervisor: the rank's output, its events (after the output before them), its exit.
FromSupervisor = SupHello | Output | Event | RankExit | Reply
#: A node agent on another machine.
FromNode = NodeHello | NodeBeat | NodeOutput | NodeExit
#: Whatever reaches the controller.
Inbound = FromExec | FromControl | FromSupervisor | FromNode
#: What a rank writes into its events pipe, for its supervisor to forward in an EVENT.
RankEvent = CellDone | Display | StdinRequest
#: The controller, to a rank's main thread, its control thread, its supervisor, a node agent.
ToExec = Exec | Request | StdinReply
ToControl = Request | Ping | Dap | Hold | Peek
ToSupervisor = Request | Ping | Spare
ToNode = NodeStart | NodeRefused | Ping

def _kinds(union: Any) -> dict[str, frozenset[str]]:
    """Each kind a union of messages holds, with the fields it must carry: read from the
    TypedDicts themselves, so a member or a field added there is checked by :func:`accept`."""
    out: dict[str, frozenset[str]] = {}
    for td in typing.get_args(union):
        required = frozenset(td.__required_keys__) - {"t"}
        for kind in typing.get_args(typing.get_type_hints(td)["t"]):
            out[kind] = out[kind] & required if kind in out else required
    return out


#: Kinds each peer may send the controller, and the fields each must carry.
_FROM: dict[PeerKind, dict[str, frozenset[str]]] = {
    PeerKind.EXEC: _kinds(FromExec),
    PeerKind.CONTROL: _kinds(FromControl),
    PeerKind.SUPERVISOR: _kinds(FromSupervisor),
    PeerKind.NODE: _kinds(FromNode),
}
_EVENTS = _kinds(RankEvent)
_WHO = {PeerKind.EXEC: "a rank", PeerKind.CONTROL: "a rank's control thread", PeerKind.SUPERVISOR: "a supervisor",
        PeerKind.NODE: "a node agent"}


def _check(msg: object, allowed: dict[str, frozenset[str]], who: str) -> None:
    if not isinstance(msg, dict):
        raise BadFrame(f"a message from {who} is not a dict")
    kind = msg.get("t")
    required = allowed.get(kind) if isinstance(kind, str) else None
    if required is None:
        raise BadFrame(f"{who} may not send a {kind!r} message")
    missing = required - msg.keys()
    if missing:
        raise BadFrame(f"a {kind} message from {who} lacks {', '.join(sorted(missing))}")


def accept(kind: PeerKind, msg: dict[str, Any]) -> Inbound:
    """``msg`` as the typed message it is, if a peer of this kind may send it with these fields;
    raises :class:`BadFrame` otherwise (the channel counts it and drops it unhandled)."""
    _check(msg, _FROM[kind], _WHO[kind])
    return cast(Inbound, msg)


def accept_event(event: object) -> RankEvent:
    """A rank's event, unpickled from an EVENT's body, checked as :func:`accept` checks a message."""
    _check(event, _EVENTS, "a rank's events pipe")
    return cast(RankEvent, event)


#: Kinds each of the ranks' connections (and a node agent) takes from the controller.
_TO: dict[PeerKind, frozenset[str]] = {
    PeerKind.EXEC: frozenset({Msg.EXEC, Msg.PUSH, Msg.PULL, Msg.CHECK, Msg.REGROUP, Msg.STDIN_REPLY}),
    PeerKind.CONTROL: frozenset({Msg.STACKS, Msg.ENV, Msg.MESHES, Msg.MEMORY, Msg.COLLECTIVES, Msg.INTERRUPT, Msg.WATCH, Msg.DAP, Msg.HOLD,
                                Msg.PEEK}),
    PeerKind.SUPERVISOR: frozenset({Msg.PING, Msg.FAULT_REQUEST, Msg.RESPAWN, Msg.SPARE, Msg.SHUTDOWN, Msg.INTERRUPT}),
    PeerKind.NODE: frozenset({Msg.NODE_START, Msg.NODE_REFUSED, Msg.PING, Msg.SHUTDOWN}),
}
#: Requests whose sender waits for a REPLY with their ``id``.
_ANSWERED = frozenset({Msg.PUSH, Msg.PULL, Msg.CHECK, Msg.REGROUP, Msg.STACKS, Msg.ENV, Msg.MESHES, Msg.MEMORY, Msg.COLLECTIVES, Msg.FAULT_REQUEST, Msg.DAP,
                       Msg.HOLD, Msg.PEEK})


@overload
def accept_request(receiver: Literal[PeerKind.EXEC], msg: dict[str, Any]) -> ToExec: ...
@overload
def accept_request(receiver: Literal[PeerKind.CONTROL], msg: dict[str, Any]) -> ToControl: ...
@overload
def accept_request(receiver: Literal[PeerKind.SUPERVISOR], msg: dict[str, Any]) -> ToSupervisor: ...
@overload
def accept_request(receiver: Literal[PeerKind.NODE], msg: dict[str, Any]) -> ToNode: ...
def accept_request(receiver: PeerKind, msg: dict[str, Any]) -> ToExec | ToControl | ToSupervisor | ToNode:
    """On the ranks' side (and a node agent's): ``msg`` if the controller may send this receiver a
    message of its kind; raises :class:`BadFrame` otherwise. A request that expects a reply must
    carry its ``id``."""
    kind = msg.get("t")
    if kind not in _TO[receiver]:
        raise BadFrame(f"a {receiver.name.lower()} connection takes no {kind!r} message")
    if kind in _ANSWERED and "id" not in msg:
        raise BadFrame(f"a {kind} request without an id")
    return cast("ToExec | ToControl | ToSupervisor | ToNode", msg)

