"""Lifecycle states of a pool and of each rank, as the controller last saw them, and how a rank's
part of a cell ended.

Only the tracker moves them (its legal-moves table; a cell's statuses through its ``CellRun``);
everything else reads them."""

from __future__ import annotations

from enum import Enum

__all__ = ["POOL_MOVES", "RANK_MOVES", "PoolState", "CellStatus", "RankState"]


class PoolState(str, Enum):
    """Lifecycle of a pool.

    NEW → STARTING → READY ⇄ (cells run) → STOPPING → STOPPED. A rank that dies moves a READY pool
    to BROKEN, from which only restart or shutdown lead on. A failed start ends in STOPPED.
    """

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
    STOPPING = "stopping"
    STOPPED = "stopped"


class RankState(str, Enum):
    """Where a rank is in its life, as the controller last saw it."""

    LAUNCHED = "launched"  # torchrun started, nothing heard yet
    STARTED = "started"  # the rank's supervisor is up
    CONNECTED = "connected"  # the rank process connected; initialising its process group
    IDLE = "idle"  # process group ready, waiting for a cell
    RUNNING = "running"  # executing a cell
    DEAD = "dead"  # the rank process has ended


class CellStatus(str, Enum):
    """How one rank's part of a cell stands (``RankResult.status``). A ``str``: the words of a
    report and the wire's ``CellDone.status`` are its values."""

    RUNNING = "running"  # not finished yet
    OK = "ok"  # finished the cell
    ERROR = "error"  # the cell raised on it
    INTERRUPTED = "interrupted"  # a Ctrl-C (or fail-fast's) ended it
    DEAD = "dead"  # its process ended during the cell
    STRANDED = "stranded"  # still blocked waiting for a rank that died: the cell ended for the notebook, the pool is broken

    def __str__(self) -> str:
        return self.value

    @classmethod
    def reported(cls, status: str) -> CellStatus:
        """A rank's CELL_DONE status; one this controller does not know (a newer rank) is an error."""
        try:
            return cls(status)
        except ValueError:
            return cls.ERROR


#: The moves the tracker may make (controller/tracker.py, its one mover); anything else is a bug
#: (pool) or a late, reordered message (rank), which must not revive a dead rank.
POOL_MOVES: dict[PoolState, set[PoolState]] = {
    PoolState.NEW: {PoolState.STARTING},
    PoolState.STARTING: {PoolState.READY, PoolState.STOPPING},
    PoolState.READY: {PoolState.BROKEN, PoolState.STOPPING, PoolState.STARTING},  # STARTING: a respawn
    PoolState.BROKEN: {PoolState.STOPPING, PoolState.STARTING},
    PoolState.STOPPING: {PoolState.STOPPED},
    PoolState.STOPPED: {PoolState.STARTING},
}
RANK_MOVES: dict[RankState, set[RankState]] = {
    RankState.LAUNCHED: {RankState.STARTED, RankState.CONNECTED, RankState.IDLE, RankState.DEAD},
    RankState.STARTED: {RankState.CONNECTED, RankState.IDLE, RankState.DEAD},
    RankState.CONNECTED: {RankState.IDLE, RankState.DEAD},
    RankState.IDLE: {RankState.RUNNING, RankState.DEAD},
    RankState.RUNNING: {RankState.IDLE, RankState.DEAD},
    RankState.DEAD: set(),
}
