"""What the controller knows of the pool and each rank, as a result object (``%dist_status``,
``pool.status()``): no round trip to the ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from distnb._processes import signal_meaning
from distnb.analysis.verdicts.failures import holders_words
from distnb.cell_names import cell_name
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by
from distnb.states import RankState

__all__ = ["PoolStatus", "RankStatus", "Regrouped"]


@dataclass(frozen=True)
class Regrouped:
    """A regroup's outcome: every rank's fresh default group, and the names in the ranks'
    namespaces whose objects hold a group it closed (name → kind: DDP, a mesh, a group)."""

    world_size: int
    holders: dict[str, str]

    def text(self) -> str:
        head = f"every rank has a fresh default process group ({self.world_size} ranks), namespaces kept"
        if not self.holders:
            return head + "; groups made with new_group or a DeviceMesh, and objects holding one (DDP, FSDP), must be made again."
        return f"{head}. These hold a group it closed and fail at their next collective: {holders_words(self.holders)}."


def _natural(name: str) -> list[Any]:
    """``node2`` before ``node10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass
class RankStatus:
    rank: int
    state: RankState
    pid: int | None = None
    host: str | None = None
    device: str | None = None
    cell: int | None = None
    elapsed: float | None = None
    returncode: int | None = None
    local_rank: int | None = None
    node: int | None = None  # torchrun's GROUP_RANK: which machine
    cause: str = ""

    def describe(self, with_elapsed: bool = True) -> str:
        """In words: ``running cell 3 for 2.0 s`` (the duration left out with ``with_elapsed=False``)."""
        if self.state == RankState.DEAD:
            why = [signal_meaning(self.returncode)] if self.returncode is not None else []
            why += [self.cause] if self.cause else []
            return f"dead: {'; '.join(why)}" if why else "dead"
        if self.state == RankState.RUNNING and self.cell is not None:
            return f"running {cell_name(self.cell)}" + (f" for {self.elapsed or 0.0:.1f} s" if with_elapsed else "")
        return self.state.value


@dataclass
class PoolStatus:
    state: str
    backend: str | None
    world_size: int
    ranks: list[RankStatus]
    agent_pid: int | None = None
    address: str | None = None
    cells_run: int = 0
    nnodes: int = 1
    nodes: str = ""  # the other machines' node agents, in words
    rejected: int = 0  # frames and handshakes refused (wrong key, replay, unknown peer)
    internal_errors: int = 0  # failures distnb's I/O thread caught and survived
    last_internal_error: str | None = None
    diagnosis_errors: int = 0  # failures of the notebook side's best-effort diagnosis (the live watch, a timeout's why)
    last_diagnosis_error: str | None = None

    every_rank: bool = False  # a line per rank even above SUMMARY_ABOVE ranks (%dist_status --all)

    def text(self) -> str:
        nodes = f" on {self.nnodes} nodes" if self.nnodes > 1 else ""
        lines = [
            f"pool {self.state}: {self.world_size} ranks{nodes}, backend {self.backend or '?'}, "
            f"{self.cells_run} cells run, torchrun agent pid {self.agent_pid}, controller {self.address}"
        ]
        lines += self._summary() if len(self.ranks) > SUMMARY_ABOVE and not self.every_rank else self._table()
        if self.nodes:
            lines += ["other nodes:", *("  " + line for line in self.nodes.splitlines())]
        if self.rejected:
            lines.append(f"refused {self.rejected} frame(s) or handshake(s) from peers without this pool's key")
        if self.internal_errors:
            lines.append(f"{self.internal_errors} internal error(s) on distnb's I/O thread (it kept running; please report them); "
                         f"the last: {_first_and_last(self.last_internal_error)}")
        if self.diagnosis_errors:
            lines.append(f"{self.diagnosis_errors} internal error(s) in distnb's diagnosis (the cells went on without it; please report "
                         f"them: pool.internal_errors.last holds the traceback); the last: {_first_and_last(self.last_diagnosis_error)}")
        return "\n".join(lines)

    def _summary(self) -> list[str]:
        """Ranks grouped by state, the most common first; a group of a few ranks names each one's
        machine and pid (the odd ones out are what one looks for)."""
        groups = sorted(group_by((r.rank, r.describe(with_elapsed=False)) for r in self.ranks), key=lambda g: -len(g[0]))
        by_rank = {r.rank: r for r in self.ranks}
        lines = []
        for ranks, state in groups:
            hosts = sorted({by_rank[r].host or "?" for r in ranks}, key=_natural)
            where = (", ".join(f"rank {r} on {by_rank[r].host or '?'} (pid {by_rank[r].pid or '-'})" for r in ranks) if len(ranks) <= 4
                     else f"{format_ranks(ranks)} on {len(hosts)} machine{'s' if len(hosts) > 1 else ''}"
                     + (f" ({hosts[0]} … {hosts[-1]})" if len(hosts) > 2 else f" ({', '.join(hosts)})"))
            lines.append(f"  {state}: {where}")
        lines.append("  (a line per rank: %dist_status --all, or pool.status().ranks)")
        return lines

    def _table(self) -> list[str]:
        lines = []
        multi = self.nnodes > 1
        head = ("rank", "node", "pid", "host", "device") if multi else ("rank", "pid", "host", "device")
        rows = [(*head, "state")]
        for r in self.ranks:
            node = ("-" if r.node is None else str(r.node),) if multi else ()
            rows.append((str(r.rank), *node, str(r.pid or "-"), r.host or "-", r.device or "-", r.describe()))
        n = len(head)
        widths = [max(len(row[i]) for row in rows) for i in range(n)]
        for row in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row[:n], widths)) + "  " + row[n])
        return lines

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def _first_and_last(error: str | None) -> str:
    """A kept traceback's first line (when, and what was being done) and last (the exception)."""
    lines = (error or "").strip().splitlines()
    return f"{lines[0].rstrip(':') if lines else '?'}{(' — ' + lines[-1]) if len(lines) > 1 else ''}"
