"""Who is on the other end of a connection: every peer's ZMQ identity names its kind and index
(``x3`` rank 3's main thread, ``c3`` its control thread, ``s3`` its supervisor, ``n1`` node agent
1), and a respawned rank's connections carry their generation (``x3.2``)."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from distnb.wire.codec import BadFrame

__all__ = ["Peer", "PeerKind", "control_identity", "exec_identity", "generation_of", "in_generation", "node_identity", "parse_identity",
           "supervisor_identity"]


class PeerKind(str, Enum):
    """The kind of connection a frame came on (the first letter of its identity)."""

    EXEC = "x"  # a rank's main thread: runs cells in order
    CONTROL = "c"  # a rank's control thread: answers while a cell runs
    SUPERVISOR = "s"  # a rank's supervisor: its output, events and exit
    NODE = "n"  # a node agent on another machine


class Peer(NamedTuple):
    kind: PeerKind
    number: int  # the rank, or the node agent's id


_KINDS = {k.value.encode(): k for k in PeerKind}


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


def parse_identity(identity: bytes) -> Peer:
    """``b"x3"`` (or ``b"x3.2"``) -> ``Peer(PeerKind.EXEC, 3)``; raises :class:`BadFrame` for anything else."""
    name, dot, generation = identity.partition(b".")
    if (len(identity) < 2 or len(identity) > 24 or name[:1] not in (b"x", b"c", b"s", b"n") or not name[1:].isdigit()
            or dot and (name[:1] not in (b"x", b"c") or not generation.isdigit())):
        raise BadFrame(f"unknown peer identity {identity[:16]!r}")
    return Peer(_KINDS[name[:1]], int(name[1:]))


def generation_of(identity: bytes) -> int:
    """The respawn generation a rank's connection belongs to (0: the ranks torchrun started)."""
    _, dot, generation = identity.partition(b".")
    return int(generation) if dot and generation.isdigit() else 0
