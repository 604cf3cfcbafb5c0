"""NCCL's own evidence after a collective timeout: the Flight Recorder dumps its watchdog writes,
blame by sequence numbers, and the watchdog's words in a dead rank's stderr.

At a timeout, NCCL's watchdog aborts the communicator; distnb's settings (``launcher.
nccl_environment``) keep the rank alive and have every rank dump its recorder into the pool's run
folder (``<run dir>/nccl_trace_rank_<rank>``). After the abort every entry reads "completed", so
states no longer tell who never came — sequence numbers still do: the rank that timed out first is
a victim that waited, and the ranks whose last collective on the group is older never arrived.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

from distnb.ranks import format_ranks

__all__ = ["SeqBlame", "dump_marks", "read_dumps", "seq_blame", "watchdog_cause"]

_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+).*?ran for (\d+) milliseconds")


def read_dumps(run_dir: str, newer_than: float = 0.0, prefix: str = "nccl_trace_rank_") -> dict[int, dict[str, Any]]:
    """The Flight Recorder dumps NCCL's watchdog wrote at a timeout, by rank: those written after
    ``newer_than`` (wall clock; an earlier timeout's dumps stay in the folder), unreadable ones
    skipped (a rank may have died mid-write)."""
    out: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(run_dir, prefix + "*")):
        tail = path[len(os.path.join(run_dir, prefix)) :]
        try:
            if not tail.isdigit() or os.path.getmtime(path) < newer_than:
                continue
        except OSError:
            continue
        try:
            with open(path, "rb") as f:
                out[int(tail)] = pickle.load(f)  # written by the pool's own ranks
        except Exception:
            continue
    return out


@dataclass(frozen=True)
class SeqBlame:
    """On ``group``, ``ahead`` issued collective ``seq`` (``op``) that ``never`` never reached."""

    group: str
    seq: int
    op: str
    ahead: list[int]
    never: dict[int, int | None]  # rank → its last sequence number on the group (None: none at all)

    def text(self, timed_out: list[int] | None = None) -> str:
        last = "; ".join(f"rank {r} last #{s}" if s is not None else f"rank {r} none" for r, s in sorted(self.never.items()))
        waited = f"; {format_ranks(timed_out)} timed out waiting" if timed_out else ""
        return (f"{format_ranks(self.never)} never arrived at {self.op} #{self.seq} on group {self.group}, which "
                f"{format_ranks(self.ahead)} issued ({last}){waited}. Root cause: {format_ranks(self.never)}, "
                "not the first rank to time out.")


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


def watchdog_cause(stderr: str) -> str:
    """``NCCL's watchdog ended it: ALLREDUCE #2 ran 8045 ms past …``, from a dead rank's stderr;
    ``""`` when the watchdog said nothing."""
    m = _WATCHDOG.search(stderr)
    if m is None:
        return ""
    return (f"NCCL's watchdog ended it: collective #{m.group(1)} ({m.group(2).lower()}) ran {int(m.group(3)) / 1000:.1f} s, past the "
            "group timeout, and TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down (distnb sets 2, which keeps it: was it overridden?)")
