"""Is a rank's supervisor still there? Asked of the launcher on this machine and of the node
agents' beats for the others, where no exit report is coming (its process was killed with torchrun,
its machine went away)."""

from __future__ import annotations

from typing import Protocol

from distnb import _processes
from distnb.controller.rank_record import RankRecord
from distnb.launching.remote_nodes import Nodes

__all__ = ["Liveness", "supervisor_gone"]


class Liveness(Protocol):
    """What the tracker needs of the launcher: which processes it started live, and torchrun's exit."""

    known_pids: _processes.KnownProcesses

    def returncode(self) -> int | None: ...


def supervisor_gone(info: RankRecord, nodes: Nodes, liveness: Liveness | None) -> str | None:
    """Why ``info``'s supervisor is gone ("" where nothing more is known), None while it lives."""
    if info.agent:  # on another machine: its agent knows
        return nodes.rank_gone(info.agent, info.supervisor_pid, info.agent_beats)
    if liveness is None:  # no launcher yet: nothing it started can have gone
        return None
    if info.supervisor_pid is None:
        return "" if liveness.returncode() is not None else None
    # By PID and start time: a reused number must not make a dead supervisor look alive.
    return None if liveness.known_pids.is_alive(info.supervisor_pid) else ""
