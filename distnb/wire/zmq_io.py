"""Multipart send and receive for distnb's hot paths (every cell crosses them several times).

pyzmq's ``send_multipart``/``recv_multipart`` combine its flag enums per frame (``SNDMORE |
flags``, ``RCVMORE``), and on Python 3.11 each combination builds a new enum object: about half
the cost of a small message's Python side. These do the same with plain ints. Frames of 64 KiB
and more are sent without a copy, as pyzmq itself decides for ``copy=False``; smaller ones are
cheaper to copy.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import zmq

__all__ = ["NOBLOCK", "drain", "recv_frames", "send_frames"]

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_COPY_BELOW = 65536


def send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes], flags: int = 0) -> None:
    """Send ``frames`` as one multipart message."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=len(frame) < _COPY_BELOW)


def recv_frames(sock: zmq.Socket[bytes], flags: int = 0) -> list[bytes]:
    """Receive one multipart message as bytes (``zmq.Again`` with ``NOBLOCK`` when none waits).

    Each part comes as a Frame whose ``more`` is read from the message itself: asking the socket
    (``RCVMORE``) goes through an enum conversion per part."""
    parts = []
    while True:
        frame = sock.recv(flags, copy=False)
        parts.append(frame.bytes)
        if not frame.more:
            return parts


def drain(sock: zmq.Socket[bytes]) -> Iterator[list[bytes]]:
    """Every message waiting on ``sock`` now, for a socket a poll found readable.

    Asks the socket whether another message waits (ZMQ_EVENTS) instead of receiving until
    ``zmq.Again``: pyzmq builds that exception in Python (an import and a strerror call each time),
    and the controller's I/O thread ended every wake with one or two."""
    while int(sock.getsockopt(_EVENTS)) & _POLLIN:
        try:
            yield recv_frames(sock, NOBLOCK)
        except zmq.Again:  # not expected after EVENTS said so; nothing lost by stopping
            return
