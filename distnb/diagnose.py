"""Cross-rank analysis of a running cell: is it hung, and whose fault is it?

Input is one :class:`Position` per rank (where the rank is: finished, failed, dead, computing, or
waiting in a collective since some time); output is a :class:`Diagnosis` in words that names the
ranks involved. The positions come from stacks and, where available, the ranks' collective logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb._linux import signal_meaning
from distnb.ranks import format_ranks
from distnb.results import group_by
from distnb.collectives import CollectiveReport, describe, signature
from distnb.stacks import RankStack, short_path

__all__ = ["Position", "Diagnosis", "diagnose", "position_from_stack", "COLLECTIVE_FUNCS"]

#: Public torch.distributed functions that block until peers arrive.
COLLECTIVE_FUNCS = {
    "all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce",
    "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "batch_isend_irecv", "new_group", "init_process_group", "destroy_process_group",
}


def _duration(seconds: list[float]) -> str:
    if not seconds:
        return ""
    lo, hi = min(seconds), max(seconds)
    return f" for {lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f" for {lo:.1f}–{hi:.1f} s"


@dataclass
class Position:
    """Where one rank is in the current cell."""

    rank: int
    state: str  # finished · failed · dead · computing · collective
    op: str | None = None  # the collective it waits in
    seq: int | None = None  # per-group sequence number, when known
    group: str | None = None
    shapes: str | None = None
    since: float | None = None  # seconds in the collective (or in the cell)
    line: int | None = None  # cell line
    code: str = ""  # the cell line's text
    detail: str = ""  # error summary, exit meaning …

    def collective(self) -> str:
        """``all_reduce #4 at cell line 3``."""
        seq = f" #{self.seq}" if self.seq is not None else ""
        return f"{self.op}{seq}" + (f" at cell line {self.line}" if self.line else "")

    def where(self, durations: list[float] | None = None) -> str:
        """Where the rank is, in words; ``durations`` (of a group of ranks) replaces its own duration."""
        at = f" at cell line {self.line}" + (f" ({self.code.strip()})" if self.code.strip() else "") if self.line else ""
        if self.state == "collective":
            seq = f" #{self.seq}" if self.seq is not None else ""
            grp = f" on group {self.group}" if self.group else ""
            shp = f" {self.shapes}" if self.shapes else ""
            dur = _duration(durations if durations is not None else [self.since] if self.since is not None else [])
            return f"waiting in {self.op}{seq}{grp}{shp}{dur}{at}"
        if self.state == "computing":
            return f"running Python code (not in a collective{', ' + self.detail if self.detail else ''}){at}"
        if self.state == "finished":
            return "finished the cell"
        if self.state == "idle":
            return "idle (not running this cell)"
        if self.state == "failed":
            return f"raised {self.detail}{at}"
        if self.state == "dead":
            return f"died: {self.detail}"
        return self.state


@dataclass
class Diagnosis:
    kind: str  # ok · slow · hang · running
    summary: str
    positions: list[Position] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"[distnb] {self.summary}"]
        # Ranks waiting in the same place are one line even though their waits differ by a few ms.
        by_rank = {p.rank: p for p in self.positions}
        for ranks, _ in group_by((p.rank, p.where([])) for p in self.positions):
            durations = [by_rank[r].since for r in ranks if by_rank[r].since is not None]
            lines.append(f"  {format_ranks(ranks)}: {by_rank[ranks[0]].where(durations)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def position_from_stack(stack: RankStack, cell_code: str = "") -> Position:
    """A rank's position read off its stack: the outermost torch.distributed collective frame."""
    main = next((t for t in stack.threads if t.main), None)
    frames = main.user_frames() if main else []
    cell_frames = [f for f in frames if f.is_cell]
    line = cell_frames[-1].lineno if cell_frames else None
    code = cell_frames[-1].line if cell_frames else ""
    op = next(
        (f.name for f in frames if f.filename.endswith("distributed_c10d.py") and f.name in COLLECTIVE_FUNCS),
        None,
    )
    if op is not None:
        return Position(stack.rank, "collective", op=op, line=line, code=code)
    return Position(stack.rank, "computing", line=line, code=code, detail=_importing(frames))


def _importing(frames: list[Any]) -> str:
    """``importing torch/_dynamo/__init__.py`` when the rank is inside an import, else ``""``."""
    inside = [i for i, f in enumerate(frames) if f.filename.startswith("<frozen importlib")]
    if not inside:
        return ""
    module = next((f for f in reversed(frames[inside[0]:]) if f.name == "<module>" and not f.filename.startswith("<")), None)
    return f"importing {short_path(module.filename)}" if module else "importing a module"


def diagnose(positions: list[Position], hang_after: float, elapsed: float, log: CollectiveReport | None = None) -> Diagnosis:
    """Name the situation: a healthy (maybe slow) collective, or a hang and its likely cause.

    ``log`` (the ranks' collective sequences) refines the words: uneven loop lengths, a
    sub-group missing a member, the exact position where sequences diverge.
    """
    waiting = [p for p in positions if p.state == "collective"]
    dead = [p for p in positions if p.state == "dead"]
    failed = [p for p in positions if p.state == "failed"]
    finished = [p for p in positions if p.state in ("finished", "idle")]
    computing = [p for p in positions if p.state == "computing"]
    if not waiting:
        if computing and elapsed >= hang_after:
            return Diagnosis("running", f"{format_ranks([p.rank for p in computing])} still running Python code after {elapsed:.0f} s (no rank is in a collective).", positions)
        return Diagnosis("ok", "no rank is waiting in a collective.", positions)
    longest = max((p.since or elapsed) for p in waiting)
    if longest < hang_after:
        return Diagnosis("ok", "collectives in progress.", positions)
    w = format_ranks([p.rank for p in waiting])
    ops = group_by((p.rank, (p.op, p.seq, p.group, p.shapes)) for p in waiting)
    if dead:
        d = dead[0]
        return Diagnosis(
            "hang",
            f"rank {d.rank} died ({d.detail}); {w} {_waits(waiting)} for it in {waiting[0].op} and can't finish. Root cause: rank {d.rank}.",
            positions, [p.rank for p in dead],
        )
    if failed:
        f = failed[0]
        return Diagnosis(
            "hang",
            f"{format_ranks([p.rank for p in failed])} raised {f.detail} and left the cell; {w} {_waits(waiting)} in "
            f"{waiting[0].op} for {'it' if len(failed) == 1 else 'them'}. Root cause: the error on {format_ranks([p.rank for p in failed])}.",
            positions, [p.rank for p in failed],
        )
    if finished and log is not None:
        refined = _refine_missing(waiting, finished, log, positions)
        if refined is not None:
            return refined
    if finished:
        return Diagnosis(
            "hang",
            f"rank-conditional collective: {w} entered {waiting[0].collective()}, but "
            f"{format_ranks([p.rank for p in finished])} finished the cell without entering it "
            "(a collective inside `if rank == …`, or one rank ran fewer loop iterations).",
            positions, [p.rank for p in finished],
        )
    if len(ops) > 1:
        first_key = ops[0][1]
        detail = "; ".join(f"{format_ranks(rs)} in {k[0]}" + (f" #{k[1]}" if k[1] is not None else "") + (f" {k[3]}" if k[3] else "") for rs, k in ops)
        same_op = len({k[0] for _, k in ops}) == 1
        kind = "the same op with different shapes or dtypes" if same_op and first_key[3] else ("different positions in the collective sequence" if same_op else "different collectives")
        minority = min(ops, key=lambda g: len(g[0]))[0]
        return Diagnosis("hang", f"ranks are in {kind}: {detail}. The odd one out: {format_ranks(minority)}.", positions, minority)
    if computing and all(p.detail.startswith("importing") for p in computing):
        # A first use of e.g. torch._dynamo (DDP, compile) imports for seconds: slow, not hung yet.
        return Diagnosis(
            "slow",
            f"{w} {_waits(waiting)} in {waiting[0].op} for {longest:.0f} s while {format_ranks([p.rank for p in computing])} "
            f"{'is' if len(computing) == 1 else 'are'} still importing modules ({computing[0].detail}): slow, not a hang yet.",
            positions, [p.rank for p in computing],
        )
    if computing:
        return Diagnosis(
            "hang",
            f"{w} {_waits(waiting)} in {waiting[0].op} for {longest:.0f} s while {format_ranks([p.rank for p in computing])} "
            "are still running Python code outside any collective (slow, stuck in a loop, or about to skip it).",
            positions, [p.rank for p in computing],
        )
    return Diagnosis("slow", f"every rank is in the same collective ({waiting[0].op}) for {longest:.0f} s: slow but consistent, not a hang.", positions)


def _waits(ranks: list[Position]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _refine_missing(waiting: list[Position], finished: list[Position], log: CollectiveReport, positions: list[Position]) -> Diagnosis | None:
    """Ranks wait in a collective that others never entered: which of the field's cases is it?"""
    head = waiting[0]
    if head.group is None or head.seq is None:
        return None
    members = log.members(head.group)
    absent = [p.rank for p in finished if p.rank in members]
    theirs = {r: next((e for e in log.log.sequence(r, head.group) if e["seq"] == head.seq), None) for r in absent}
    entered = {r: e for r, e in theirs.items() if e is not None}
    if entered:
        # They did enter #k, with something else: a mismatch that let them finish (or abort).
        mine = log.log.pending(waiting[0].rank) or {}
        kind = "different ops" if any(e["op"] != head.op for e in entered.values()) else (
            "shape or dtype mismatch" if any(signature(e) != signature(mine) for e in entered.values() if mine) else "mismatch")
        detail = "; ".join(f"{format_ranks(rs)} {d}" for rs, d in group_by(
            [(p.rank, describe(log.log.pending(p.rank) or {"op": p.op or "?"})) for p in waiting]
            + [(r, describe(e)) for r, e in entered.items()]))
        return Diagnosis(
            "hang",
            f"{kind} at collective #{head.seq} on group {head.group}: {detail}. "
            f"{format_ranks(list(entered))} completed {'it' if len(entered) == 1 else 'them'} anyway; the others wait.",
            positions, list(entered),
        )
    w = format_ranks([p.rank for p in waiting])
    if head.group != "0" and absent:
        return Diagnosis(
            "hang",
            f"sub-group collective missing a member: {w} {_waits(waiting)} in {head.collective()} on group {head.group} "
            f"({format_ranks(members)}), but {format_ranks(absent)} of that group never entered it.",
            positions, absent,
        )
    if not absent:
        return None
    counts = log.counts(head.group)
    mine = log.log.sequence(absent[0], head.group)
    pending = log.log.pending(waiting[0].rank) or {}
    # Same op, one call short, and in the same cell: a loop that ran once less on those ranks.
    if mine and mine[-1]["op"] == head.op and counts.get(absent[0], 0) == head.seq - 1 and mine[-1].get("cell") == pending.get("cell"):
        ahead = format_ranks([p.rank for p in waiting])
        return Diagnosis(
            "hang",
            f"uneven loop lengths: {ahead} made {head.seq} {head.op} calls on group {head.group}, "
            f"{format_ranks(absent)} stopped after {head.seq - 1} (a data loader or loop with a different length per rank).",
            positions, absent,
        )
    return Diagnosis(
        "hang",
        f"rank-conditional collective: {w} entered {head.collective()} on group {head.group}, but "
        f"{format_ranks(absent)} finished the cell without entering it (a collective inside `if rank == …`).",
        positions, absent,
    )


def exit_detail(returncode: int | None) -> str:
    return signal_meaning(returncode)
