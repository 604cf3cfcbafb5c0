"""What the tracker asks the ranks on its own, from the I/O thread: new collective-log entries of
ranks that ran cells (a backstop to the ranks' own pushes, so the log survives a rank that later
dies abruptly), and the memory of ranks left waiting by one that ran out of it."""

from __future__ import annotations

from typing import Any, Callable, Iterable, cast

from distnb.controller.collective_log import CollectiveLog
from distnb.controller.requests import Requests, Transport
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg
from distnb.wire.record_types import CollectivesRead

__all__ = ["Asks"]

#: Ranks still running a cell are polled every this many ticks: they push their own entries
#: within ~50 ms (worker/process/control.py), and a full read of a rank's recorder costs milliseconds.
POLL_RUNNING_EVERY = 5


class Asks:
    def __init__(self, requests: Requests, transport: Callable[[], Transport | None], log: CollectiveLog) -> None:
        self._requests = requests
        self._transport = transport
        self._log = log
        self._dirty: set[int] = set()
        self._ticks = 0

    def ran_cell(self, ranks: Iterable[int]) -> None:
        """These ranks began a cell: poll their logs at the next tick."""
        self._dirty.update(ranks)

    def poll_collectives(self, running: set[int], dead: set[int]) -> None:
        """Ask for the new entries of ranks that began a cell since the last tick (and, every
        :data:`POLL_RUNNING_EVERY` ticks, of those still running); merged into the log on reply."""
        transport = self._transport()
        if transport is None:
            return
        self._ticks += 1
        polled = running if self._ticks % POLL_RUNNING_EVERY == 0 else set()
        targets = sorted((self._dirty | polled) - dead)
        self._dirty = set()
        generation = self._log.generation

        def merge(r: int, reply: dict[str, Any]) -> None:
            if self._log.generation == generation:  # else it answers for processes a restart replaced
                self._log.merge(r, cast(CollectivesRead, reply))

        for r in targets:
            req_id = self._requests.expect(merge, ttl=10.0)
            transport.send(control_identity(r), {"t": Msg.COLLECTIVES, "id": req_id, "since": self._log.cursor(r),
                                                 "calls_since": self._log.last_call(r), "groups": self._log.wants_groups([r])})

    def memory_of(self, into: dict[int, dict[str, Any]], ranks: list[int]) -> None:
        """The others usually wait for an out-of-memory rank in a collective and will report no
        end-of-cell memory: ask for theirs now (into ``into``), for the side-by-side comparison."""
        transport = self._transport()
        if transport is None:
            return

        def keep(rank: int, reply: dict[str, Any]) -> None:
            if "memory" in reply:
                into[rank] = reply["memory"]

        req_id = self._requests.expect(keep, ttl=30.0)
        transport.send_many(map(control_identity, ranks), {"t": Msg.MEMORY, "id": req_id})
