"""Wire protocol shared by the controller and the ranks.

A message is a dict with a ``"t"`` (type) key, pickled, and sent as a ZMQ multipart frame
``[MAGIC, signature, body]`` where ``signature = HMAC-SHA256(key, body)``. The signature is
checked *before* the body is unpickled, so a peer without the pool's key can never make
either side run pickle on its bytes. Each body also carries the sender's monotonically
increasing counter; a frame whose counter does not move forward is a replay and is dropped.

This module imports neither torch, IPython nor widgets: both sides speak only through it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import pickle
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAGIC",
    "MAX_FRAME_BYTES",
    "BadFrame",
    "Codec",
    "Msg",
    "ReplayGuard",
    "new_key",
    "exec_identity",
    "control_identity",
    "supervisor_identity",
    "node_identity",
    "parse_identity",
]

MAGIC = b"DNB1"
#: Frames larger than this are refused on receipt (a rank's value is summarised long before).
MAX_FRAME_BYTES = 256 * 1024 * 1024
_SIG_LEN = hashlib.sha256().digest_size


class Msg:
    """Message type tags (plain strings on the wire).

    Senders: C = controller, S = rank supervisor, R = rank process, N = node agent.
    """

    # S -> C
    SUP_HELLO = "sup_hello"  # supervisor is up: rank, pid, host
    OUTPUT = "output"  # a chunk of the rank's stdout/stderr
    EVENT = "event"  # a rank's cell event (done, display), forwarded after its output
    RANK_EXIT = "rank_exit"  # the rank process ended: returncode, stderr tail
    FAULT_DUMP = "fault_dump"  # faulthandler text read by the supervisor
    SUP_REPLY = "sup_reply"  # answer to a supervisor request
    # R -> C (control socket)
    HELLO = "hello"
    READY = "ready"
    START_FAILED = "start_failed"
    REPLY = "reply"
    PONG = "pong"
    # R -> C (exec socket)
    DONE = "done"
    DISPLAY = "display"
    # C -> R / C -> S
    EXEC = "exec"
    PUSH = "push"
    PULL = "pull"
    CHECK = "check"
    REGROUP = "regroup"
    PING = "ping"
    INTERRUPT = "interrupt"
    STACKS = "stacks"
    STATUS = "status"
    ENV = "env"
    MEMORY = "memory"
    COLLECTIVES = "collectives"
    SHUTDOWN = "shutdown"
    FAULT_REQUEST = "fault_request"  # S: send SIGUSR1 so faulthandler dumps every thread
    # N -> C (a node agent, ``python -m distnb.node``, on another machine)
    NODE_HELLO = "node_hello"  # host, pid, distnb version
    NODE_BEAT = "node_beat"  # alive pids of its torchrun's process tree, twice a second
    NODE_OUTPUT = "node_output"  # lines of its torchrun agent's own output
    NODE_EXIT = "node_exit"  # its torchrun ended: returncode, output tail
    # C -> N
    NODE_START = "node_start"  # the launch config and rendezvous to run torchrun with
    NODE_REFUSED = "node_refused"  # why this agent may not join (pool full, version mismatch)


def new_key() -> bytes:
    """A fresh random per-pool signing key."""
    return secrets.token_bytes(32)


def exec_identity(rank: int) -> bytes:
    return b"x%d" % rank


def control_identity(rank: int) -> bytes:
    return b"c%d" % rank


def supervisor_identity(rank: int) -> bytes:
    return b"s%d" % rank


def node_identity(agent_id: int) -> bytes:
    return b"n%d" % agent_id


def parse_identity(identity: bytes) -> tuple[str, int]:
    """``b"x3"`` -> ``("x", 3)``; raises :class:`BadFrame` for anything else."""
    if len(identity) < 2 or len(identity) > 24 or identity[:1] not in (b"x", b"c", b"s", b"n") or not identity[1:].isdigit():
        raise BadFrame(f"unknown peer identity {identity[:16]!r}")
    return identity[:1].decode(), int(identity[1:])


class BadFrame(Exception):
    """A frame that is malformed, oversized, wrongly signed or replayed."""


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
        msg["_s"] = self.sender
        msg["_n"] = next(self._counter)
        body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        sig = hmac.new(self._key, body, hashlib.sha256).digest()
        return [MAGIC, sig, body]

    def decode(self, frames: list[bytes], guard: ReplayGuard | None = None) -> dict[str, Any]:
        """Verify and unpickle; raise :class:`BadFrame` (and count it) for any bad frame."""
        try:
            if len(frames) != 3 or frames[0] != MAGIC:
                raise BadFrame("not a distnb frame")
            sig, body = frames[1], frames[2]
            if len(sig) != _SIG_LEN:
                raise BadFrame("bad signature length")
            if len(body) > MAX_FRAME_BYTES:
                raise BadFrame(f"frame of {len(body)} bytes exceeds the limit")
            expected = hmac.new(self._key, body, hashlib.sha256).digest()
            if not hmac.compare_digest(sig, expected):
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
