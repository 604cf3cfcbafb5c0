"""Ending a cell that can no longer finish: a rank raised (or died) and left it, and every rank
still running waits in a call that needs it.

Such a cell would otherwise run to its ``--timeout`` (or the group's, 30 minutes). Certain only
when the records prove it: each waiting rank's open collective is on a group holding a rank that
left, and that rank's own log — read fresh from it, not as last pushed — never reached that call;
or its open send/recv names the rank that left. A rank that issued the call before it raised
(``async_op=True``) may still complete it, so it dooms nothing. The cell is then ended as one
Ctrl-C would end it (the waiting ranks interrupted, unblocked if the interrupt can't land, the
group rebuilt, namespaces kept), and the note says why.

With ``finished`` (the minimizer's tries), a rank that finished the cell has left it too: ranks
waiting for a call it never reached are a hang proven, not one waited out. A notebook's cell is
not ended for that (the user sees the hang, and its verdict, to its ``--timeout``); a try is, as
its bound would end it (``Doomed.hang``), seconds earlier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import peer_of
from distnb.cell_names import cell_name
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.tracker import Tracker
from distnb.ranks import format_ranks, group_by
from distnb.results import CellResult
from distnb.states import CellStatus
from distnb.wire.record_types import P2P_OPS

__all__ = ["FAIL_FAST_AFTER", "FINISHED", "Doomed", "FailFast", "doomed"]

#: Seconds the waiting must stay doomed before the cell is ended: a rank's last entries travel
#: behind its CELL_DONE, and an error raised on purpose deserves a moment for the others' own.
FAIL_FAST_AFTER = 1.0
#: How a rank that finished the cell has left it (``doomed(finished=True)``).
FINISHED = "finished"


@dataclass(frozen=True)
class Doomed:
    """The ranks that left the cell, and what each still-running rank waits in that needs them."""

    cell: int
    left: dict[int, str]  # rank -> "raised ValueError" / "died" / FINISHED
    waiting: dict[int, str]  # rank -> the call it waits in, in words

    @property
    def hang(self) -> bool:
        """Every rank that left finished the cell: the waiting is a hang, none raised or died."""
        return all(why == FINISHED for why in self.left.values())

    def text(self) -> str:
        gone = "; ".join(f"{format_ranks(rs)} {what}" for rs, what in group_by(sorted(self.left.items())))
        waits = "; ".join(f"{format_ranks(rs)} in {what}" for rs, what in group_by(sorted(self.waiting.items())))
        them = "it" if len(self.waiting) == 1 else "them"
        if self.hang:
            return (f"[distnb] {gone} {cell_name(self.cell)}; the others wait ({waits}) for a call that "
                    f"{'it' if len(self.left) == 1 else 'they'} never reached: a hang, proven by the records, ended as its timeout would end it.")
        return (f"[distnb] {gone} and left {cell_name(self.cell)}; the others wait ({waits}) for a call that needs "
                f"{'it' if len(self.left) == 1 else 'them'}, which can no longer complete: ending the cell now instead of "
                f"at its timeout (interrupting {them}; a group that must be unblocked is rebuilt, namespaces kept). "
                "%%on_ranks --no-fail-fast (pool.wait(fail_fast=False)) waits instead.")


def doomed(result: CellResult, log: CollectiveLog, finished: bool = False) -> Doomed | None:
    """The cell's waiting, when the records prove it can't complete; None otherwise. ``finished``:
    ranks that finished the cell count as gone too."""
    left = {r: ("died" if res.status == CellStatus.DEAD else f"raised {res.error.get('ename', 'an error') if res.error else 'an error'}")
            for r, res in result.results.items() if res.status in (CellStatus.ERROR, CellStatus.DEAD)}
    if finished:
        left.update((r, FINISHED) for r, res in result.results.items() if res.status == CellStatus.OK)
    running = result.running
    if not left or not running:
        return None
    waiting = {}
    for r in running:
        why = _needs_gone(log, r, result.cell, set(left))
        if not why:
            return None
        waiting[r] = why
    return Doomed(result.cell, left, waiting)


def _needs_gone(log: CollectiveLog, rank: int, cell: int, gone: set[int]) -> str:
    """What ``rank`` waits in that a rank of ``gone`` never entered, in words; "" when none."""
    entry = log.stuck(rank)
    if entry is not None and not entry.get("p2p"):
        members = log.groups.get(entry["group"])
        if members is None:
            return ""  # a group distnb can't name: not proven
        missing = [g for g in gone if g in members and ((last := log.last_seq(g, entry["group"])) is None or last < entry["seq"])]
        return f"{describe(entry)} ({log.at(entry)})" if missing else ""
    for call in log.open_calls(rank):
        if call["op"] in P2P_OPS and (peer := peer_of(call)) is not None and peer in gone:
            return f"{call['op']} {'to' if P2P_OPS[call['op']] == 'send' else 'from'} rank {peer}"
    return ""


class FailFast:
    """Polled by the wait loop each tick: says, once, when to end a doomed cell. Cheap on the
    log as pushed; before deciding it reads the ranks that left afresh (``refresh``)."""

    def __init__(self, result: CellResult, tracker: Tracker, refresh: Callable[[list[int]], object], finished: bool = False) -> None:
        self._result = result
        self._tracker = tracker
        self._refresh = refresh
        self._finished = finished  # see doomed()
        self._since: float | None = None
        self.fired: Doomed | None = None

    def check(self) -> Doomed | None:
        if self.fired is not None:
            return None
        with self._tracker.lock:
            found = doomed(self._result, self._tracker.collective_log, self._finished)
        if found is None:
            self._since = None
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since < FAIL_FAST_AFTER:
            return None
        self._refresh(sorted(self._result.results))  # every rank of the cell: the ones that left, and the waiting
        with self._tracker.lock:
            found = doomed(self._result, self._tracker.collective_log, self._finished)
        if found is not None:
            self.fired = found
        return found
