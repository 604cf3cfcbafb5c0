"""Ranks without processes: a :class:`~distnb.transport.base.RankTransport` that replays what real
ranks sent, recorded once from a real pool (``tests/record_streams.py``) and kept as data under
``tests/data/streams/``.

A recording is every message the controller received (peer, message, when) and every message it
sent. :class:`Stream` cuts it into the start (up to every rank READY), one reply stream per cell
(what each rank sent from the cell's EXEC up to its CELL_DONE, collectives and output included)
and the replies to requests (``%dist_stacks``' STACKS, MEMORY, ENV, a PULL of a name …) by what
was asked and rank.
:class:`FakeRanks` then answers the Pool as the ranks did: a cell whose code was recorded is
replayed with the cell number the Pool gave it now; a request gets the recorded reply with its id;
anything not recorded fails loudly, in the test (``unrecorded``), never by a silent wait.
Messages reach the tracker through :func:`~distnb.wire.protocol.accept`, on a thread of the
fake's own, as the channel's I/O thread delivers them, and the tracker's tick runs once a second.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from distnb.controller.channel import FollowUp
from distnb.controller.tracker import Tracker
from distnb.errors import LaunchError
from distnb.launching.remote_nodes import Nodes
from distnb.states import RankState
from distnb.transport.multinode import MultiNode
from distnb.wire.peers import Peer, PeerKind, parse_identity
from distnb.wire.protocol import Msg

from conftest import feed

__all__ = ["FakeRanks", "Recorder", "Stream", "STREAMS"]

STREAMS = Path(__file__).resolve().parent / "data" / "streams"

#: A received message as recorded: seconds since the recording began, peer kind ("x", "c", "s"),
#: rank, the message.
Received = tuple[float, str, int, dict[str, Any]]
#: A sent message as recorded: seconds since the recording began, identities, the message.
Sent = tuple[float, list[bytes], dict[str, Any]]


class Recorder:
    """Wraps a real pool's tracker and transport before its start, and keeps every message."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.sent: list[Sent] = []
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def attach(self, pool: Any) -> None:
        tracker, transport = pool._tracker, pool._transport
        on_message, send_many = tracker.on_message, transport.send_many

        def received(peer: Peer, msg: Any) -> None:
            with self._lock:
                self.received.append((time.monotonic() - self._t0, peer.kind.value, peer.number, dict(msg)))
            on_message(peer, msg)

        def sent(identities: Iterable[bytes], msg: dict[str, Any], follow_up: FollowUp | None = None) -> None:
            ids = list(identities)
            with self._lock:
                self.sent.append((time.monotonic() - self._t0, ids, dict(msg)))
            send_many(ids, msg, follow_up)

        tracker.on_message = received  # the channel is made at start() and takes the attribute then
        transport.send_many = sent

    def save(self, path: Path, nproc: int, texts: dict[str, str]) -> None:
        """Writes the recording, with what the real pool showed for each cell (``texts``: code ->
        the result's text), which a replay must show too."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = {"nproc": nproc, "received": self.received, "sent": self.sent, "texts": texts}
        path.write_bytes(pickle.dumps(data, protocol=4))


def _renumber(value: Any, old: int, new: int) -> Any:
    """``value`` with every ``"cell": old`` in it (EVENT bodies unpickled and pickled again), and
    the cell's file name in its tracebacks (``<cell-old>``), made ``new``."""
    if isinstance(value, str):
        return value.replace(f"<cell-{old}>", f"<cell-{new}>")
    if isinstance(value, dict):
        out = {k: (new if k == "cell" and v == old else _renumber(v, old, new)) for k, v in value.items()}
        if out.get("t") == Msg.EVENT:
            out["body"] = pickle.dumps(_renumber(pickle.loads(value["body"]), old, new), protocol=pickle.HIGHEST_PROTOCOL)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_renumber(v, old, new) for v in value)
    return value


def _asked(request: dict[str, Any]) -> tuple[str, str]:
    """What a request asks, as a replay tells requests apart: its kind and the names it names (a
    PULL's variables, a CHECK's), so that a pull of another name is not answered with this one's value."""
    return request["t"], repr(request.get("names", ""))


#: What the ranks send that is not a cell's: answers to requests (replayed by id), the start.
_NOT_A_CELLS = frozenset({Msg.REPLY, Msg.SUP_HELLO, Msg.HELLO, Msg.READY})


@dataclass
class Stream:
    """One recording, cut into what a replay needs."""

    nproc: int
    start: list[Received]
    #: code -> (the cell number it ran as, what the ranks sent for it: kind, rank, message)
    cells: dict[str, tuple[int, list[Received]]] = field(default_factory=dict)
    #: what was asked (:func:`_asked`) -> rank -> the rank's reply (its ``id`` replaced at replay)
    replies: dict[tuple[str, str], dict[int, dict[str, Any]]] = field(default_factory=dict)
    #: code -> the text of the real pool's result for it
    texts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, name: str) -> Stream:
        data = pickle.loads((STREAMS / f"{name}.pickle").read_bytes())
        stream = cls.cut(data["nproc"], data["received"], data["sent"])
        stream.texts = data["texts"]
        return stream

    @classmethod
    def cut(cls, nproc: int, received: list[Received], sent: list[Sent]) -> Stream:
        ready: set[int] = set()
        start: list[Received] = []
        rest = list(received)
        while rest and len(ready) < nproc:
            item = rest.pop(0)
            start.append(item)
            if item[3]["t"] == Msg.READY:
                ready.add(item[2])
        stream = cls(nproc, [(0.0, kind, rank, msg) for _, kind, rank, msg in start])  # a replayed start takes no time
        requests = {m["id"]: _asked(m) for _, _, m in sent if "id" in m and m["t"] != Msg.EXEC}
        execs = [(t, m["cell"], m["code"]) for t, _, m in sent if m["t"] == Msg.EXEC]
        # A cell's messages: what the ranks sent from its EXEC to the next cell's (collectives are
        # pushed shortly after a cell ends; a rank that died sends its exit instead of CELL_DONE).
        ends = [t for t, _, _ in execs[1:]] + [float("inf")]
        for (t0, cell, code), t1 in zip(execs, ends):
            if code not in stream.cells:  # the first run of a code is its replay
                stream.cells[code] = (cell, [(t - t0, kind, rank, msg) for t, kind, rank, msg in rest
                                             if t0 <= t < t1 and msg["t"] not in _NOT_A_CELLS])
        for _, _, rank, msg in rest:
            if msg["t"] == Msg.REPLY and (kind := requests.get(msg.get("id"))) is not None:
                stream.replies.setdefault(kind, {}).setdefault(rank, msg)  # the first answer to it
        return stream


class FakeRanks:
    """A :class:`~distnb.transport.base.RankTransport` over a recorded :class:`Stream`."""

    multinode: MultiNode | None = None

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.generation = 0
        self.heartbeat_peers: set[bytes] = set()
        #: Every message the Pool sent: (identity, message).
        self.sent: list[tuple[bytes, dict[str, Any]]] = []
        #: What the Pool asked that the recording cannot answer (a test asserts it is empty).
        self.unrecorded: list[str] = []
        #: Exceptions the tracker raised on a replayed message (the channel would count them).
        self.errors: list[BaseException] = []
        self._tracker: Tracker | None = None
        self._inbox: queue.Queue[tuple[float, int, Callable[[], None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._order = itertools.count()
        self._open = False

    # -- a launch -------------------------------------------------------------------------------
    def open(self, tracker: Tracker) -> None:
        self._tracker = tracker
        tracker.begin_start(self, Nodes(0))  # no liveness: recorded PIDs are not this machine's processes
        self._open = True
        self._thread = threading.Thread(target=self._deliver, name="fake-ranks", daemon=True)
        self._thread.start()
        self._replay(self.stream.start, at=time.monotonic())

    def close(self) -> list[int]:
        if self._open:
            self._open = False
            self._inbox.put(None)
            if self._thread is not None:
                self._thread.join(5)
        return []

    def running(self) -> bool:
        return self._open

    def start_failure(self, tracker: Tracker) -> LaunchError | None:
        return None

    def start_timeout(self, tracker: Tracker, timeout: float, stages: Mapping[int, RankState]) -> LaunchError:
        return LaunchError(f"the recorded ranks did not become ready within {timeout:g} s: {dict(stages)}")

    def pids(self) -> list[int]:
        return []

    agent_pid = None
    run_dir = None
    health = None

    @property
    def address(self) -> str | None:
        return "fake://recorded" if self._open else None

    # -- the wire -------------------------------------------------------------------------------
    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.send_many((identity,), msg)

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any], follow_up: FollowUp | None = None) -> None:
        now = time.monotonic()
        for identity in identities:
            self.sent.append((identity, dict(msg)))
            _, rank = parse_identity(identity)
            if msg["t"] == Msg.EXEC:
                self._answer_cell(rank, msg, now)
            elif "id" in msg:
                self._answer_request(rank, msg, now)
        if follow_up is not None:
            self._later(now + follow_up.after, lambda: follow_up.fn() if follow_up.wanted() else None)

    def _answer_cell(self, rank: int, msg: dict[str, Any], now: float) -> None:
        recorded = self.stream.cells.get(msg["code"])
        if recorded is None:  # at once, in the test: a replay that never answers would only time out
            self.unrecorded.append(f"cell {msg['code']!r}")
            raise AssertionError(f"the recording has no cell {msg['code']!r}: add it to tests/record_streams.py and run it")
        was, items = recorded
        mine = [(t, kind, r, _renumber(m, was, msg["cell"])) for t, kind, r, m in items if r == rank]
        self._replay(mine, at=now)

    def _answer_request(self, rank: int, msg: dict[str, Any], now: float) -> None:
        reply = self.stream.replies.get(_asked(msg), {}).get(rank)
        if reply is None:  # answered as an error the caller reports, and kept for the test
            self.unrecorded.append(f"{msg['t']} to rank {rank}")
            reply = {"t": Msg.REPLY, "error": f"the recording has no reply to {msg['t']} from rank {rank}"}
        self._replay([(0.0, PeerKind.CONTROL.value, rank, {**reply, "id": msg["id"]})], at=now)

    # -- delivery, on the fake's own thread -----------------------------------------------------
    def _replay(self, items: list[Received], at: float) -> None:
        for t, kind, rank, msg in items:
            self._later(at + t, functools.partial(feed, self._tracker, kind, rank, dict(msg)))

    def _later(self, when: float, fn: Callable[[], None]) -> None:
        self._inbox.put((when, next(self._order), fn))

    def _deliver(self) -> None:
        due: list[tuple[float, int, Callable[[], None]]] = []
        next_tick = time.monotonic() + 1.0
        while True:
            wait = min([next_tick] + [d[0] for d in due[:1]]) - time.monotonic()
            try:
                item = self._inbox.get(timeout=max(wait, 0.0))
                if item is None:
                    return
                heapq.heappush(due, item)
            except queue.Empty:
                pass
            now = time.monotonic()
            while due and due[0][0] <= now:
                try:
                    heapq.heappop(due)[2]()
                except Exception as exc:  # kept for the test: the wire's thread must carry on
                    self.errors.append(exc)
            if now >= next_tick and self._tracker is not None:
                next_tick = now + 1.0
                try:
                    self._tracker.on_tick()
                except Exception as exc:
                    self.errors.append(exc)
