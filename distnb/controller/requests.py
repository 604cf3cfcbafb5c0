"""Requests to ranks and their replies, matched by id through one table (never by id prefixes).

A request waited for by a caller (``ask``) and a one-shot the I/O thread fires and forgets (a
collective-log poll, memory asked of the ranks an out-of-memory rank left waiting) are both
entries of the same table: the id a REPLY repeats says which handler takes it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from distnb.errors import NoAnswerError
from distnb.ranks import format_ranks

__all__ = ["Requests", "Transport", "ReplyHandler"]

#: ``handler(rank, reply)``, called on the I/O thread: must be quick and must not block.
ReplyHandler = Callable[[int, dict[str, Any]], None]


class Transport(Protocol):
    """What the controller side needs of the wire (``distnb.controller.channel.Channel``; a fake in tests)."""

    heartbeat_peers: set[bytes]

    def send(self, identity: bytes, msg: dict[str, Any]) -> None: ...

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any]) -> None: ...


class _Collector:
    """The replies to one ``ask``, one per rank."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.waiting = set(ranks)
        self.replies: dict[int, dict[str, Any]] = {}
        self.event = threading.Event()

    def __call__(self, rank: int, reply: dict[str, Any]) -> None:
        if rank in self.waiting:
            self.replies[rank] = reply
            self.waiting.discard(rank)
            if not self.waiting:
                self.event.set()


class Requests:
    """The table of open requests. ``transport`` is looked up per request: each launch has its own."""

    def __init__(self, transport: Callable[[], Transport | None]) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._table: dict[str, tuple[ReplyHandler, float]] = {}  # id -> (handler, expiry)

    def expect(self, handler: ReplyHandler, ttl: float) -> str:
        """A new request id whose replies go to ``handler`` for ``ttl`` seconds."""
        req_id = str(next(self._ids))
        with self._lock:
            self._table[req_id] = (handler, time.monotonic() + ttl)
        return req_id

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._table.pop(req_id, None)

    def deliver(self, rank: int, reply: dict[str, Any]) -> bool:
        """Hand a REPLY to whoever asked; False when nobody waits for it any more (a late answer)."""
        with self._lock:
            entry = self._table.get(str(reply.get("id")))
        if entry is None:
            return False
        entry[0](rank, reply)
        return True

    def prune(self) -> None:
        """Drop handlers past their time (ranks that died never answer)."""
        now = time.monotonic()
        with self._lock:
            for req_id in [i for i, (_, expiry) in self._table.items() if expiry < now]:
                del self._table[req_id]

    def __len__(self) -> int:
        return len(self._table)

    def ask(
        self,
        identity: Callable[[int], bytes],
        ranks: list[int],
        msg: dict[str, Any],
        timeout: float,
        partial: bool = False,
    ) -> dict[int, dict[str, Any]]:
        """Send ``msg`` to each rank's ``identity`` and wait for every reply; ``partial`` returns
        what came in time instead of raising :class:`NoAnswerError`."""
        transport = self._transport()
        if transport is None or not ranks:
            return {}
        collector = _Collector(ranks)
        req_id = self.expect(collector, timeout + 60.0)
        try:
            transport.send_many(map(identity, ranks), {**msg, "id": req_id})
            collector.event.wait(timeout)
        finally:
            self.forget(req_id)
        if collector.waiting and not partial:
            late = sorted(collector.waiting)
            raise NoAnswerError(
                f"{format_ranks(late)} did not answer within {timeout:g} s; check them with %dist_status.",
                ranks=late, timeout=timeout,
            )
        return dict(collector.replies)
