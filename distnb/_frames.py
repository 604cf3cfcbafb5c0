"""Multipart send and receive for distnb's hot paths (every cell crosses them several times).

pyzmq's ``send_multipart``/``recv_multipart`` combine its flag enums per frame (``SNDMORE |
flags``), and on Python 3.11 each combination builds a new enum object: about a third of the cost
of a small message. These do the same with plain ints. Frames of 64 KiB and more go without a
copy, as pyzmq itself decides for ``copy=False``; smaller ones are cheaper to copy.
"""

from __future__ import annotations

from typing import Sequence

import zmq

__all__ = ["NOBLOCK", "recv_frames", "send_frames"]

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_COPY_BELOW = 65536


def send_frames(sock: zmq.Socket, frames: Sequence[bytes], flags: int = 0) -> None:
    """Send ``frames`` as one multipart message."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=len(frame) < _COPY_BELOW)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """Receive one multipart message as bytes (``zmq.Again`` with ``NOBLOCK`` when none waits)."""
    parts = [sock.recv(flags)]
    while sock.get(_RCVMORE):
        parts.append(sock.recv(flags))
    return parts
