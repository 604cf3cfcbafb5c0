"""Is a rank's supervisor still there? Asked of the launcher on this machine and of the node
agents' beats for the others, where no exit report is coming (its process was killed with torchrun,
its machine went away). And what a machine lost takes with it."""

from __future__ import annotations

from typing import Mapping, Protocol

from distnb import _processes
from distnb.controller.rank_record import RankRecord
from distnb.launching.remote_nodes import Nodes
from distnb.results import RankResult
from distnb.states import CellStatus, RankState

__all__ = ["Liveness", "gone_without_report", "lost_machines", "supervisor_gone"]


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


def gone_without_report(ranks: Mapping[int, RankRecord], nodes: Nodes, liveness: Liveness | None) -> list[RankRecord]:
    """Ranks not yet dead whose supervisor is gone (killed with torchrun or with its machine): no
    exit report is coming, so they are dead now. Their ``cause`` says why, where it is known."""
    gone = []
    for info in ranks.values():
        if info.state != RankState.DEAD and (cause := supervisor_gone(info, nodes, liveness)) is not None:
            info.cause = cause or info.cause
            gone.append(info)
    return gone


def lost_machines(nodes: Nodes, ranks: Mapping[int, RankRecord], last_results: Mapping[int, RankResult]) -> list[str]:
    """Machines whose agent just went silent: their ranks are dead, whatever they said meanwhile.

    A rank on a machine going down often reports an error first (its peers there died a moment
    before it: "Connection reset by peer") and is found gone only when the agent's silence is
    noticed, seconds later. A report that came after the agent's last beat raced the machine's
    loss: it is the loss's consequence, so the rank's outcome is its death, with the machine named
    (ranks still alive here are found gone at this same tick, and dead stays dead).
    Returns a note per machine lost."""
    notes = []
    for node in nodes.check():
        notes.append(f"{node.name()} stopped answering: its ranks are taken for dead")
        for info in ranks.values():
            if info.agent != node.agent_id:
                continue
            if not info.cause:
                info.cause = node.cause()
            res = last_results.get(info.rank)
            if res is None:
                continue
            raced = res.status in (CellStatus.ERROR, CellStatus.INTERRUPTED, CellStatus.STRANDED) and (res.finished_at or 0.0) >= node.last_beat
            if res.status == CellStatus.DEAD or raced:
                res.status, res.cause = CellStatus.DEAD, info.cause
    return notes
