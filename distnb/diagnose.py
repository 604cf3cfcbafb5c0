"""Cross-rank analysis of a running cell: is it hung, and whose fault is it?

Input is one :class:`Position` per rank (where the rank is: finished, failed, dead, computing, or
waiting in a collective since some time); output is a :class:`Diagnosis` in words that names the
ranks involved. The positions come from stacks and, where available, the ranks' collective logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb._processes import signal_meaning
from distnb.ranks import format_ranks
from distnb.results import group_by
from distnb.collective_log import CollectiveReport, describe, signature
from distnb.stacks import RankStack, parse_faulthandler, short_path

__all__ = ["Position", "Diagnosis", "diagnose", "position_from_stack", "collective_at_death", "COLLECTIVE_FUNCS"]

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
    state: str  # finished · failed · dead · computing · collective · unresponsive (no stack at all) · idle
    op: str | None = None  # the collective it waits in
    seq: int | None = None  # per-group sequence number, when known
    group: str | None = None
    shapes: str | None = None
    since: float | None = None  # seconds in the collective (or in the cell)
    line: int | None = None  # cell line
    code: str = ""  # the cell line's text
    detail: str = ""  # error summary, exit meaning …
    sizes: list[list[int]] | None = None  # input shapes of the collective, when the log knows them
    dtypes: list[str] | None = None

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
            dur = _duration(durations if durations is not None else [self.since] if self.since is not None else [])
            return f"running Python code (not in a collective{', ' + self.detail if self.detail else ''}){dur}{at}"
        if self.state == "finished":
            return "finished the cell"
        if self.state == "idle":
            return "idle: not part of this cell"
        if self.state == "failed":
            return f"raised {self.detail}{at}"
        if self.state == "dead":
            return f"died: {self.detail}"
        if self.state == "unresponsive":
            return f"not answering: {self.detail}"
        return self.state


@dataclass
class Diagnosis:
    kind: str  # ok · slow · hang · running
    # The headline. It names the situation, never a duration, so the same hang diagnosed a second
    # later has the same headline (the live watch prints a diagnosis again only when it changes);
    # durations are in the per-rank lines of text().
    summary: str
    positions: list[Position] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"[distnb] {self.summary}"]
        # Ranks waiting in the same place are one line even though their waits differ by a few ms.
        by_rank = {p.rank: p for p in self.positions}
        for ranks, _ in group_by((p.rank, p.where([])) for p in self.positions):
            durations = [since for r in ranks if (since := by_rank[r].since) is not None]
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


def collective_at_death(stderr: str, main_ident: int | None = None) -> str | None:
    """``all_reduce at cell line 2 (…)``: the collective the main thread was in when faulthandler
    printed its stack on a fatal signal (SIGABRT, SIGSEGV), from a dead rank's last stderr."""
    if "File " not in stderr:
        return None
    threads = parse_faulthandler(stderr, None, main_ident)
    main = next((t for t in threads if t.main), None)
    if main is None:
        return None
    pos = position_from_stack(RankStack(-1, "", "faulthandler", [main]))
    if pos.state != "collective":
        return None
    return f"{pos.op}" + (f" at cell line {pos.line}" if pos.line else "") + " (from the stack it printed as it died)"


def _importing(frames: list[Any]) -> str:
    """``importing torch/_dynamo/__init__.py`` when the rank is inside an import, else ``""``."""
    inside = [i for i, f in enumerate(frames) if f.filename.startswith("<frozen importlib")]
    if not inside:
        return ""
    module = next((f for f in reversed(frames[inside[0]:]) if f.name == "<module>" and not f.filename.startswith("<")), None)
    return f"importing {short_path(module.filename)}" if module else "importing a module"


def diagnose(
    positions: list[Position],
    hang_after: float,
    elapsed: float,
    log: CollectiveReport | None = None,
    first_death: int | None = None,
) -> Diagnosis:
    """Name the situation: a healthy (maybe slow) collective, or a hang and its likely cause.

    ``log`` (the ranks' collective sequences) refines the words: uneven loop lengths, a
    sub-group missing a member, the exact position where sequences diverge. ``first_death`` is the
    rank that died first (by its supervisor's clock), the root cause when several died.
    """
    waiting = [p for p in positions if p.state == "collective"]
    dead = [p for p in positions if p.state == "dead"]
    failed = [p for p in positions if p.state == "failed"]
    # "idle" ranks are not part of the cell: they did not finish it, they never had it.
    finished = [p for p in positions if p.state == "finished"]
    outside = [p for p in positions if p.state == "idle"]
    computing = [p for p in positions if p.state == "computing"]
    silent = [p for p in positions if p.state == "unresponsive"]
    if not waiting:
        if silent and elapsed >= hang_after:
            s = silent[0]
            return Diagnosis("hang", f"{format_ranks([p.rank for p in silent])} {'is' if len(silent) == 1 else 'are'} not answering: "
                             f"{s.detail}.", positions, [p.rank for p in silent])
        if computing and elapsed >= hang_after:
            return Diagnosis("running", f"{format_ranks([p.rank for p in computing])} still running Python code (no rank is in a collective).", positions)
        return Diagnosis("ok", "no rank is waiting in a collective.", positions)
    # since == 0.0 is a wait that just began, not an unknown one.
    longest = max(elapsed if p.since is None else p.since for p in waiting)
    if longest < hang_after:
        return Diagnosis("ok", "collectives in progress.", positions)
    w = format_ranks([p.rank for p in waiting])
    if dead:
        d = next((p for p in dead if p.rank == first_death), dead[0])
        later = [p.rank for p in dead if p is not d]
        then = f", then {format_ranks(later)}" if later else ""
        return Diagnosis(
            "hang",
            f"rank {d.rank} died{' first' if later else ''} ({d.detail}){then}; {w} {_waits(waiting)} for it in {waiting[0].op} "
            f"and can't finish. Root cause: rank {d.rank}.",
            positions, [d.rank, *later],
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
    if len(group_by((p.rank, _place(p)) for p in waiting)) > 1:
        return _disagree(waiting, positions)
    absent = _not_in_cell(waiting, outside, log)
    if absent:
        head = waiting[0]
        grp = f" on group {head.group}" if head.group else ""
        return Diagnosis(
            "hang",
            f"{w} {_waits(waiting)} in {head.collective()}{grp} for {format_ranks(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not part of this cell: a collective needs every rank of its group, "
            "so run the cell on all of them.",
            positions, absent,
        )
    if silent:
        s = silent[0]
        return Diagnosis(
            "hang",
            f"{w} {_waits(waiting)} in {waiting[0].op} for {format_ranks([p.rank for p in silent])}, which "
            f"{'is' if len(silent) == 1 else 'are'} not answering at all: {s.detail}. Root cause: {format_ranks([p.rank for p in silent])}.",
            positions, [p.rank for p in silent],
        )
    if computing and all(p.detail.startswith("importing") for p in computing):
        # A first use of e.g. torch._dynamo (DDP, compile) imports for seconds: slow, not hung yet.
        return Diagnosis(
            "slow",
            f"{w} {_waits(waiting)} in {waiting[0].op} while {format_ranks([p.rank for p in computing])} "
            f"{'is' if len(computing) == 1 else 'are'} still importing modules ({computing[0].detail}): slow, not a hang yet.",
            positions, [p.rank for p in computing],
        )
    if computing:
        return Diagnosis(
            "hang",
            f"{w} {_waits(waiting)} in {waiting[0].op} while {format_ranks([p.rank for p in computing])} "
            f"{'is' if len(computing) == 1 else 'are'} still running Python code outside any collective "
            "(slow, stuck in a loop, or about to skip it).",
            positions, [p.rank for p in computing],
        )
    return Diagnosis("slow", f"every rank is in the same collective ({waiting[0].op}): slow but consistent, not a hang.", positions)


def _waits(ranks: list[Position]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _place(p: Position) -> tuple[Any, ...]:
    """What must be equal for ranks to be in the same collective."""
    shapes = (_tup(p.sizes), _tup(p.dtypes)) if p.sizes is not None or p.dtypes is not None else p.shapes
    return (p.op, p.seq, p.group, shapes)


def _tup(x: Any) -> Any:
    return tuple(_tup(v) for v in x) if isinstance(x, (list, tuple)) else x


def _differences(waiting: list[Position]) -> list[str]:
    """What differs between the ranks' collectives, in words (op, sequence number, group, shape, dtype)."""
    def distinct(key: Any) -> bool:
        values = {repr(key(p)) for p in waiting if key(p) is not None}
        return len(values) > 1

    out = []
    if distinct(lambda p: p.op):
        out.append("op")
    if distinct(lambda p: p.seq):
        out.append("sequence number")
    if distinct(lambda p: p.group):
        out.append("group")
    if any(p.sizes is not None or p.dtypes is not None for p in waiting):
        if distinct(lambda p: p.sizes):
            out.append("shape")
        if distinct(lambda p: p.dtypes):
            out.append("dtype")
    elif distinct(lambda p: p.shapes):
        out.append("shape or dtype")  # only their description is known
    return out


def _disagree(waiting: list[Position], positions: list[Position]) -> Diagnosis:
    """The waiting ranks are not all in the same collective: say what differs and who stands out."""
    places = group_by((p.rank, _place(p)) for p in waiting)
    by_rank = {p.rank: p for p in waiting}
    diffs = _differences(waiting)

    def where(ranks: list[int]) -> str:
        p = by_rank[ranks[0]]
        seq = f" #{p.seq}" if p.seq is not None else ""
        grp = f" on group {p.group}" if p.group is not None and "group" in diffs else ""
        return f"{format_ranks(ranks)} in {p.op}{seq}{grp}" + (f" {p.shapes}" if p.shapes else "")

    if "op" in diffs:
        kind = "different collectives"
    else:
        kind = f"the same op ({waiting[0].op}) with a different {' and '.join(diffs) or 'call'}"
    detail = "; ".join(where(rs) for rs, _ in places)
    sizes = sorted((len(rs) for rs, _ in places), reverse=True)
    if sizes[0] > sizes[1]:
        # One place holds more ranks than any other: the rest are the odd ones out.
        majority = next(rs for rs, _ in places if len(rs) == sizes[0])
        odd = sorted(r for r in by_rank if r not in majority)
        blame = f"The odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)}."
    else:
        # A tie (e.g. 2 ranks, one each) says nothing about which side is wrong: name them all.
        odd = sorted(by_rank)
        blame = "No majority to tell which side went wrong: check " + " and ".join(format_ranks(rs) for rs, _ in places) + "."
    return Diagnosis("hang", f"ranks are in {kind}: {detail}. {blame}", positions, odd)


def _not_in_cell(waiting: list[Position], outside: list[Position], log: CollectiveReport | None) -> list[int]:
    """Ranks the waiting collective needs that the cell does not run on."""
    if not outside:
        return []
    group = waiting[0].group
    if log is not None and group is not None:
        members = set(log.members(group))
        return [p.rank for p in outside if p.rank in members]
    return [p.rank for p in outside]  # a group we can't name: most likely the default one, every rank


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
        kind = "different ops" if any(e["op"] != head.op for e in entered.values()) else _mismatch(mine, list(entered.values()))
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
    pending = log.log.pending(head.rank) or {}
    # Same op, exactly one call short (by sequence number: the log may have let old entries go),
    # and in the same cell: a loop that ran once less on those ranks.
    last = {r: log.log.sequence(r, head.group)[-1:] for r in absent}
    if all(
        log.log.last_seq(r, head.group) == head.seq - 1 and last[r] and last[r][0]["op"] == head.op
        and last[r][0].get("cell") == pending.get("cell")
        for r in absent
    ):
        cell = pending.get("cell")
        seq = log.log.sequence(absent[0], head.group)
        # Counting the cell's calls needs all of them: no gap, and the log reaching back before the cell.
        whole = len(seq) == seq[-1]["seq"] - seq[0]["seq"] + 1 and (seq[0]["seq"] == 1 or seq[0].get("cell") != cell)
        calls = [e for e in seq if e["op"] == head.op and e.get("cell") == cell]
        if cell is not None and whole and calls:
            made = f"made {len(calls) + 1} {head.op} calls on group {head.group}, {format_ranks(absent)} stopped after {len(calls)}"
        else:
            made = f"reached {head.op} #{head.seq} on group {head.group}, {format_ranks(absent)} stopped after #{head.seq - 1}"
        return Diagnosis(
            "hang",
            f"uneven loop lengths: {w} {made} (a data loader or loop with a different length per rank).",
            positions, absent,
        )
    return Diagnosis(
        "hang",
        f"rank-conditional collective: {w} entered {head.collective()} on group {head.group}, but "
        f"{format_ranks(absent)} finished the cell without entering it (a collective inside `if rank == …`).",
        positions, absent,
    )


def _mismatch(mine: dict[str, Any], theirs: list[dict[str, Any]]) -> str:
    """``shape mismatch``, ``dtype mismatch`` or both: what differs between the same op's calls."""
    if not mine:
        return "shape or dtype mismatch"
    shapes = any(signature(e)[1] != signature(mine)[1] for e in theirs)
    dtypes = any(signature(e)[2] != signature(mine)[2] for e in theirs)
    if shapes and dtypes:
        return "shape and dtype mismatch"
    return "dtype mismatch" if dtypes else "shape mismatch" if shapes else "mismatch"


def exit_detail(returncode: int | None) -> str:
    return signal_meaning(returncode)
