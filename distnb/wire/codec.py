"""Signed framing, shared by the controller and the ranks.

A message is a dict with a ``"t"`` (type) key, pickled, and sent as one ZMQ frame
``MAGIC + signature + body`` where ``signature`` is keyed BLAKE2b of the body (see :func:`mac`),
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
from typing import Any, Mapping

from distnb._text import mib

__all__ = ["BadFrame", "Codec", "FrameTooLarge", "MAGIC", "MAX_FRAME_BYTES", "ReplayGuard", "mac", "new_key", "socket_max_msgsize"]

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


def new_key() -> bytes:
    """A fresh random per-pool signing key."""
    return secrets.token_bytes(32)


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

    def encode(self, msg: Mapping[str, Any]) -> list[bytes]:
        """Sign ``msg``; raises :class:`FrameTooLarge` for a body the receiver would refuse."""
        signed = {**msg, "_s": self.sender, "_n": next(self._counter)}
        body = pickle.dumps(signed, protocol=pickle.HIGHEST_PROTOCOL)
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
