"""Blame by sequence numbers: every member of a group reaches the group's n-th collective, so a
rank whose last sequence number on a group is below the highest any member reached never issued
the calls after it. Read from Flight Recorder dumps (NCCL's watchdog writes them at a timeout,
when every entry reads "completed" and states no longer tell who never came) or from the
collective log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distnb.analysis.render import headline
from distnb.analysis.root_cause import RootCause
from distnb.ranks import format_ranks

__all__ = ["SeqBlame", "dump_marks", "seq_blame"]


@dataclass(frozen=True)
class SeqBlame:
    """On ``group``, ``ahead`` issued collective ``seq`` (``op``) that ``never`` never reached."""

    group: str
    seq: int
    op: str
    ahead: list[int]
    never: dict[int, int | None]  # rank → its last sequence number on the group (None: none at all)

    def said(self, timed_out: list[int] | None = None) -> str:
        """What the numbers show, without the root cause."""
        last = "; ".join(f"rank {r} last #{s}" if s is not None else f"rank {r} none" for r, s in sorted(self.never.items()))
        waited = f"; {format_ranks(timed_out)} timed out waiting" if timed_out else ""
        return (f"{format_ranks(self.never)} never arrived at {self.op} #{self.seq} on group {self.group}, which "
                f"{format_ranks(self.ahead)} issued ({last}){waited}.")

    def root(self) -> RootCause:
        return RootCause.of(sorted(self.never), note="not the first rank to time out")

    def text(self, timed_out: list[int] | None = None) -> str:
        return headline(self.said(timed_out), self.root())


def dump_marks(entries: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """``(group, collective sequence number, op)`` of each collective in raw recorder entries."""
    return [(str(e["process_group"][0]), int(e["collective_seq_id"]), str(e.get("profiling_name", "?")).split(":")[-1])
            for e in entries if not e.get("is_p2p")]


def seq_blame(by_rank: dict[int, list[tuple[str, int, str]]], members: dict[str, list[int]] | None = None) -> list[SeqBlame]:
    """Per group, the ranks whose last collective sequence number is below the highest any member
    reached: they never arrived there. ``by_rank`` holds each rank's ``(group, seq, op)`` marks
    (:func:`dump_marks` of a dump, or the collective log's entries); ``members`` names each
    group's ranks where known (else: the ranks that have entries on it)."""
    last: dict[str, dict[int, int]] = {}
    op_at: dict[tuple[str, int], str] = {}
    for rank, marks in by_rank.items():
        for g, seq, op in marks:
            last.setdefault(g, {})[rank] = max(seq, last.get(g, {}).get(rank, 0))
            op_at[(g, seq)] = op
    out = []
    for g, seqs in sorted(last.items()):
        ranks = [r for r in (members or {}).get(g, seqs) if r in by_rank]
        top = max(seqs.values())
        never = {r: seqs.get(r) for r in ranks if seqs.get(r, 0) < top}
        if never:
            first_missing = min(s or 0 for s in never.values()) + 1
            out.append(SeqBlame(g, first_missing, op_at.get((g, first_missing), "collective"), sorted(r for r in ranks if r not in never), never))
    return out
