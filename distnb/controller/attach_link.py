"""The notebook's connections to an attached job's ranks: one DEALER per rank, connected to the
address in its discovery file, frames signed with the key the rank published there.

The pool's ranks connect to the controller's ROUTER; an attached job's ranks listen and the
notebook connects, so no Channel or I/O thread is needed: :meth:`AttachLink.ask` sends a request
to each rank and waits for the replies on the caller's thread. Requests are the control thread's
own (STACKS, COLLECTIVES, MEMORY, ENV, PEEK, DAP); each reply repeats its ``id``. What a rank
pushes unasked (its debugpy's answers and stops, DAP_PUSH) is kept in :attr:`AttachLink.pushed`
for :meth:`AttachLink.listen`.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Any, Callable, Iterable, Mapping

import zmq

from distnb.wire.codec import BadFrame, Codec, ReplayGuard, socket_max_msgsize
from distnb.wire.discovery import RankEndpoint
from distnb.wire.protocol import Msg
from distnb.wire.security import Credentials
from distnb.wire.zmq_io import drain, send_frames

__all__ = ["AttachLink"]


class AttachLink:
    """Signed request/reply with each rank of an attached job."""

    def __init__(self, endpoints: Mapping[int, RankEndpoint]) -> None:
        self.endpoints = dict(endpoints)
        self._ctx: zmq.Context[Any] = zmq.Context(1)
        self._ctx.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
        # A sender name of its own per attach: each rank's replay guard keeps the counters it saw.
        name = f"A{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._socks: dict[int, zmq.Socket[bytes]] = {}
        self._codecs: dict[int, Codec] = {}
        self._guard = ReplayGuard()
        self._ids = itertools.count(1)
        #: DAP messages each rank's debugpy sent (services/job_stepper.py takes them).
        self.pushed: dict[int, list[dict[str, Any]]] = {r: [] for r in self.endpoints}
        for r, e in self.endpoints.items():
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if e.creds:  # a rank other machines reach serves CURVE, with the keys its file gave
                Credentials.loads(e.creds, f"rank {r}'s discovery file").secure_client(sock)
            sock.connect(e.address)
            self._socks[r] = sock
            self._codecs[r] = Codec(e.key, name)

    def ask(self, ranks: Iterable[int], msg: Mapping[str, Any], timeout: float) -> dict[int, dict[str, Any]]:
        """Send ``msg`` to each of ``ranks`` and wait up to ``timeout`` seconds for their replies;
        the ranks that did not answer in time are absent from the result."""
        wanted: dict[int, int] = {}
        for r in ranks:
            if r not in self._socks:
                continue
            rid = next(self._ids)
            try:
                send_frames(self._socks[r], self._codecs[r].encode({**msg, "id": rid}), zmq.NOBLOCK)
            except zmq.Again:
                continue  # not connected yet, or its queue is full: counts as no answer
            wanted[r] = rid
        replies: dict[int, dict[str, Any]] = {}
        poller = zmq.Poller()
        by_sock = {self._socks[r]: r for r in wanted}
        for sock in by_sock:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while len(replies) < len(wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                r = by_sock[sock]
                for reply in self._read(r, sock):
                    if reply.get("id") == wanted[r]:
                        replies[r] = reply
        return replies

    def listen(self, rank: int, until: Callable[[list[dict[str, Any]]], bool], timeout: float) -> bool:
        """Read what ``rank`` pushes until ``until(self.pushed[rank])`` holds (True) or ``timeout``
        seconds pass (False)."""
        sock = self._socks[rank]
        deadline = time.monotonic() + timeout
        while not until(self.pushed[rank]):
            left = deadline - time.monotonic()
            # Polled at least once, without waiting when the time is up: ``timeout=0`` reads what came.
            if sock.poll(max(0, int(left * 1000)), zmq.POLLIN):
                for _ in self._read(rank, sock):
                    pass  # a late answer to an ask that gave up on it
            elif left <= 0:
                return False
        return True

    def _read(self, rank: int, sock: zmq.Socket[bytes]) -> Iterable[dict[str, Any]]:
        """The replies waiting on ``sock``; pushed DAP messages go to :attr:`pushed` on the way."""
        for frames in drain(sock):
            try:
                msg = self._codecs[rank].decode(frames, self._guard)
            except BadFrame:
                continue
            if msg.get("t") == Msg.DAP_PUSH:
                self.pushed[rank].extend(msg.get("msgs") or [])
            else:
                yield msg

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()
