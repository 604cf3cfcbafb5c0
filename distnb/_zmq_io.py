"""Multipart send and receive for distnb's hot paths (every cell crosses them several times).

pyzmq's ``send_multipart``/``recv_multipart`` combine its flag enums per frame (``SNDMORE |
flags``, ``RCVMORE``), and on Python 3.11 each combination builds a new enum object: about half
the cost of a small message's Python side. These do the same with plain ints. Frames of 64 KiB
and more are sent without a copy, as pyzmq itself decides for ``copy=False``; smaller ones are
cheaper to copy.
"""

from __future__ import annotations

from typing import Sequence

import zmq

__all__ = ["NOBLOCK", "recv_frames", "send_frames"]

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_COPY_BELOW = 65536


def send_frames(sock: zmq.Socket, frames: Sequence[bytes], flags: int = 0) -> None:
    """Send ``frames`` as one multipart message."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=len(frame) < _COPY_BELOW)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """Receive one multipart message as bytes (``zmq.Again`` with ``NOBLOCK`` when none waits).

    Each part comes as a Frame whose ``more`` is read from the message itself: asking the socket
    (``RCVMORE``) goes through an enum conversion per part."""
    parts = []
    while True:
        frame = sock.recv(flags, copy=False)
        parts.append(frame.bytes)
        if not frame.more:
            return parts
