"""Lifecycle states of a pool and of each rank, as the controller last saw them.

Only the tracker moves them (its legal-moves table); everything else reads them."""

from __future__ import annotations

from enum import Enum

__all__ = ["PoolState", "RankState"]


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
