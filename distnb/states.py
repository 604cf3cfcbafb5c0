"""Lifecycle states of a pool and of each rank, as the controller last saw them.

Only the tracker moves them (its legal-moves table); everything else reads them."""

from __future__ import annotations

from enum import Enum

__all__ = ["POOL_MOVES", "RANK_MOVES", "PoolState", "RankState"]


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
