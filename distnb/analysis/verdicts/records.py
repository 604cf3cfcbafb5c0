"""What the rules read: every rank's position, the collective log, the cells' code, the first
death, and the questions every rule asks of them (who waits, who left, who raised an error of its
own and who only a consequence of another rank's failure)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from distnb.analysis.agreement.cell_source import rank_names
from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.agreement.compare import Presence
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.verdict import VerdictState
from distnb.wire.record_types import P2P_OPS

__all__ = ["Records", "is_consequence"]

#: Errors a rank raises because of another rank (its peer died, closed its connections, never
#: came), or because distnb or the user stopped it: never a root cause of their own.
_CONSEQUENCE = re.compile(
    r"Connection (reset|closed) by peer|Timed out waiting|Application timeout caused pair closure|Socket Timeout|Broken pipe|"
    r"NCCL communicator was aborted|communicator .*abort|Watchdog caught collective operation timeout|"
    r"ProcessGroup.* (abort|shut ?down)|Connection refused|pair closure|Read error|Write error",
    re.IGNORECASE)
_CONSEQUENCE_NAMES = {"KeyboardInterrupt", "LeftCell", "DistNetworkError", "DistBackendError"}


def is_consequence(detail: str) -> bool:
    """Whether a rank's error (``ename: evalue``) only reports another rank's failure or a stop."""
    ename = detail.split(":", 1)[0].strip()
    return ename in _CONSEQUENCE_NAMES or bool(_CONSEQUENCE.search(detail))


@dataclass
class Records:
    """The evidence a diagnosis has: what the rules read, and nothing they could not."""

    positions: list[Position]
    hang_after: float
    elapsed: float
    log: CollectiveReport | None = None
    first_death: int | None = None
    sources: dict[int, str] = field(default_factory=dict)
    cell: int | None = None  # the cell judged (None: read off the positions)
    dumps_only: frozenset[int] = frozenset()  # ranks known by Flight Recorder dumps alone: their places say nothing

    def of(self, *states: Place) -> list[Position]:
        return [p for p in self.positions if p.state in states]

    @cached_property
    def rank_names(self) -> frozenset[str]:
        """The names that hold the rank in the session's cells (``master_process``), read once."""
        return rank_names(self.sources.values())

    @cached_property
    def by_rank(self) -> dict[int, Position]:
        return {p.rank: p for p in self.positions}

    @cached_property
    def waiting(self) -> list[Position]:
        return self.of(Place.COLLECTIVE)

    @cached_property
    def running(self) -> bool:
        """Some rank of the cell still runs it (waits, computes, or gives no answer)."""
        return bool(self.of(Place.COLLECTIVE, Place.COMPUTING, Place.UNRESPONSIVE, Place.PAUSED))

    @cached_property
    def raised(self) -> list[Position]:
        """Ranks that raised an error of their own (not a consequence of another rank's failure)."""
        return [p for p in self.of(Place.FAILED) if not is_consequence(p.detail)]

    @cached_property
    def dead(self) -> list[Position]:
        dead = self.of(Place.DEAD)
        return sorted(dead, key=lambda p: p.rank != self.first_death)

    @cached_property
    def judged_cell(self) -> int | None:
        if self.cell is not None:
            return self.cell
        cell = next((p.running for p in self.positions if p.running is not None), None)
        if cell is None and self.log is not None:
            cell = next((e.get("cell") for p in self.waiting if (e := self.log.log.pending(p.rank)) is not None), None)
        return cell

    def presence(self) -> dict[int, Presence]:
        """Each rank of the cell as the agreement model needs it: left the cell, waits elsewhere,
        or may yet come (ranks not part of the cell are left out)."""
        out = {}
        for p in self.positions:
            if p.state == Place.IDLE:
                continue
            if p.state in (Place.FINISHED, Place.FAILED, Place.DEAD, Place.STRANDED) or not self.running:
                out[p.rank] = Presence.GONE
            elif p.state == Place.COLLECTIVE or p.state == Place.PAUSED:
                out[p.rank] = Presence.ELSEWHERE
            else:
                out[p.rank] = Presence.MOVING
        return out

    @cached_property
    def logs_behind(self) -> list[int]:
        """Finished ranks whose own collective counts (from their CELL_DONE) are ahead of what the
        log holds of them on a group the log has records of: their log has not all arrived, so what
        it lacks is no evidence that they skipped a call."""
        if self.log is None:
            return []
        log = self.log.log
        recorded: dict[str, bool] = {}  # per group, once (not per finished rank: 1,024 ranks ask it)

        def has_records(group: str) -> bool:
            if group not in recorded:
                recorded[group] = any(log.last_seq(q.rank, group) is not None for q in self.positions)
            return recorded[group]

        return [p.rank for p in self.of(Place.FINISHED)
                if any(has_records(group) and (log.last_seq(p.rank, group) or 0) < issued for group, issued in (p.seqs or {}).items())]

    def waiting_in(self) -> dict[int, str | None]:
        """The group each waiting rank's collective is on; None for a collective its stack shows
        and the log does not hold yet (any group's: the rank is not known to be absent from one).
        A rank in a send or recv is elsewhere: point-to-point calls take no collective's place."""
        return {p.rank: p.group for p in self.waiting if p.group is not None or p.op not in P2P_OPS}

    def state(self) -> VerdictState:
        """What a cause found now means: ranks still waiting, a hang; over with a failure, failed;
        over on every rank, a desync (wrong results, or the next sync hangs)."""
        if self.running:
            return VerdictState.HANG
        return VerdictState.FAILED if self.of(Place.FAILED, Place.DEAD, Place.STRANDED) else VerdictState.DESYNC

    def longest_wait(self) -> float:
        # since == 0.0 is a wait that just began, not an unknown one.
        return max((self.elapsed if p.since is None else p.since for p in self.waiting), default=0.0)
