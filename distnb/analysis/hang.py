"""Cross-rank analysis of a running cell: is it hung, and whose fault is it?

Input is one :class:`Position` per rank (where the rank is: finished, failed, dead, computing, or
waiting in a collective since some time); output is a :class:`Diagnosis` in words that names the
ranks involved. The positions come from stacks and, where available, the ranks' collective logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb._processes import signal_meaning
from distnb.analysis.cell_source import because
from distnb.analysis.collectives import CollectiveReport, odd_ones, signature
from distnb.analysis.entry_words import args_text, describe
from distnb.analysis.group_creation import creation_mismatch
from distnb.analysis.p2p import match_p2p
from distnb.analysis.pairing import cross_cell, cross_group
from distnb.analysis.position import Position
from distnb.analysis.steps import uneven_steps
from distnb.ranks import format_ranks, group_by

__all__ = ["Diagnosis", "diagnose", "exit_detail", "victim"]


#: Places (ranks grouped by where they are) a diagnosis lists before "… and N more".
MAX_PLACES = 8


@dataclass
class Diagnosis:
    kind: str  # ok · slow · hang · running · paused · failed (over, with a cause elsewhere than the dead rank)
    # The headline. It names the situation, never a duration, so the same hang diagnosed a second
    # later has the same headline (the live watch prints a diagnosis again only when it changes);
    # durations are in the per-rank lines of text().
    summary: str
    positions: list[Position] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # more lines under the per-rank ones (figures)

    def text(self) -> str:
        lines = [f"[distnb] {self.summary}"]
        # Ranks waiting in the same place are one line even though their waits differ by a few ms.
        by_rank = {p.rank: p for p in self.positions}
        places = group_by((p.rank, p.where([])) for p in self.positions)
        if len(places) > MAX_PLACES:
            # A thousand ranks in as many places: the culprits' places, then the most crowded.
            culprits = set(self.culprits)
            keep = sorted(places, key=lambda g: (not set(g[0]) & culprits, -len(g[0])))[:MAX_PLACES]
            left = [g for g in places if g not in keep]
            places = [g for g in places if g in keep]
        else:
            left = []
        for ranks, _ in places:
            durations = [since for r in ranks if (since := by_rank[r].since) is not None]
            lines.append(f"  {format_ranks(ranks)}: {by_rank[ranks[0]].where(durations)}")
        if left:
            lines.append(f"  … and {sum(len(rs) for rs, _ in left)} more ranks in {len(left)} other places (each: .positions)")
        lines.extend(self.details)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def diagnose(
    positions: list[Position],
    hang_after: float,
    elapsed: float,
    log: CollectiveReport | None = None,
    first_death: int | None = None,
    sources: dict[int, str] | None = None,
) -> Diagnosis:
    """Name the situation: a healthy (maybe slow) collective, or a hang and its likely cause.

    ``log`` (the ranks' collective sequences) refines the words: uneven loop lengths, a
    sub-group missing a member, the exact position where sequences diverge. ``first_death`` is the
    rank that died first (by its supervisor's clock), the root cause when several died.
    ``sources`` (cell number → code) lets a cause quote its evidence: the ``if rank`` or the loop
    around the call.
    """
    waiting = [p for p in positions if p.state == "collective"]
    dead = [p for p in positions if p.state == "dead"]
    failed = [p for p in positions if p.state == "failed"]
    # "idle" ranks are not part of the cell: they did not finish it, they never had it.
    finished = [p for p in positions if p.state == "finished"]
    outside = [p for p in positions if p.state == "idle"]
    computing = [p for p in positions if p.state == "computing"]
    silent = [p for p in positions if p.state == "unresponsive"]
    paused = [p for p in positions if p.state == "paused"]
    if paused:
        return _paused(paused, waiting, positions)
    if not waiting:
        if dead:
            d = next((p for p in dead if p.rank == first_death), dead[0])
            victim_of = victim(d, log)
            if victim_of is not None:  # over: no hang, but the death has a cause elsewhere
                return Diagnosis("failed", victim_of[0], positions, victim_of[1])
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
        victim_of = victim(d, log)
        if victim_of is not None:
            return Diagnosis("hang", victim_of[0], positions, victim_of[1])
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
    if log is not None:
        moving = {p.rank for p in computing}
        mismatch = creation_mismatch(log.log, [p.rank for p in positions if p.state != "idle"], moving)
        if mismatch is not None:
            return Diagnosis("hang", mismatch.text(), positions, mismatch.odd)
        paired = _paired(positions, log)
        if paired is not None:
            return paired
    if any(p.peers for p in waiting):
        found = match_p2p(positions)
        if found.sentences:
            return Diagnosis("hang", "point-to-point calls without a partner: " + "; ".join(found.sentences) + ".",
                             positions, found.culprits)
        # Every open send/recv has its partner: those ranks are transferring, not hung.
        waiting = [p for p in waiting if not p.peers]
        if not waiting:
            return Diagnosis("slow", "send/recv in progress: every open call has its partner (a large transfer, or a slow link).",
                             positions)
        w = format_ranks([p.rank for p in waiting])
    if log is not None and all(p.group is not None for p in waiting):
        # Finished ranks outside every waiting rank's group are no evidence of anything here.
        members = {r for g in {str(p.group) for p in waiting} for r in log.members(g)}
        finished = [p for p in finished if p.rank in members]
    if finished and log is not None:
        refined = _refine_missing(waiting, finished, log, positions, sources or {})
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
    # A rank seen in an op without its sequence number (caught between two entries) is no evidence
    # of a different call when others are in that op.
    known = [p for p in waiting if p.seq is not None or not any(q.seq is not None and q.op == p.op for q in waiting)]
    if len(group_by((p.rank, _place(p)) for p in known)) > 1:
        return _disagree(known, positions, log)
    absent = _not_in_cell(waiting, outside, log)
    if absent:
        head = waiting[0]
        return Diagnosis(
            "hang",
            f"{w} {_waits(waiting)} in {head.collective()}{head.on()} for {format_ranks(absent)}, which "
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
    if computing and all(p.detail.startswith("compiling") for p in computing):
        # A compile takes seconds; one on some ranks only (a recompile: a guard failed there) makes
        # the others wait at their next collective.
        return Diagnosis(
            "slow",
            f"{w} {_waits(waiting)} in {waiting[0].op} while {format_ranks([p.rank for p in computing])} "
            f"{'is' if len(computing) == 1 else 'are'} {computing[0].detail}: slow, not a hang yet (if it recompiles on every "
            "step, %dist_compile says which guard fails).",
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
    if waiting[0].op == "new_group":
        # Group creation is a store rendezvous that takes milliseconds: a long wait with every
        # rank at the same creation is not "slow".
        return Diagnosis(
            "hang",
            f"every rank waits in new_group{waiting[0].at()}, with the same members on every rank as far as distnb saw, and it has "
            "not completed: a rank may have created a group under another name earlier (outside distnb's view) — check with "
            "%dist_stacks and %dist_collectives.",
            positions,
        )
    return Diagnosis("slow", f"every rank is in the same collective ({waiting[0].op}): slow but consistent, not a hang.", positions)


def _paired(positions: list[Position], log: CollectiveReport) -> Diagnosis | None:
    """Ranks in step by group but not by meaning: a collective over another group than its peers'
    (mesh dimensions, new_group families), or one that paired calls of different cells."""
    cell = next((p.running for p in positions if p.running is not None), None)
    if cell is None:
        cell = next((e.get("cell") for p in positions if p.state == "collective" and (e := log.log.pending(p.rank)) is not None), None)
    if cell is None:
        return None
    ranks = [p.rank for p in positions if p.state != "idle"]
    crossed = cross_group(log.log, ranks, cell, frozenset(p.rank for p in positions if p.state == "collective"))
    if crossed is not None and crossed.waits_for:
        return Diagnosis("hang", crossed.text(), positions, crossed.odd)
    paired = cross_cell(log.log, ranks, cell)
    if paired is not None:
        return Diagnosis("hang", paired.text(), positions, paired.odd)
    return None


def _paused(paused: list[Position], waiting: list[Position], positions: list[Position]) -> Diagnosis:
    """Ranks waiting for the notebook (pdb, input()) are not hung, and neither are those waiting for them."""
    first, one = paused[0], len(paused) == 1
    at = first.at() if all(p.at() == first.at() for p in paused) else ""
    summary = f"{format_ranks([p.rank for p in paused])} {'is' if one else 'are'} {first.detail}{at}"
    if waiting:
        summary += (f"; {format_ranks([p.rank for p in waiting])} {_waits(waiting)} for {'it' if one else 'them'} "
                    f"in {waiting[0].collective()}")
    act = "continue in the debugger panel" if "panel" in first.detail else "answer the prompt (c continues)"
    return Diagnosis("paused", summary + f" — not a hang: {act}, or interrupt the cell.", positions)


def victim(dead: Position, log: CollectiveReport | None) -> tuple[str, list[int]] | None:
    """A rank that died inside a collective whose ranks disagree (gloo aborts the rank that
    receives data it can't fit): the odd rank of the mismatch is the root cause, not the victim."""
    if log is None:
        return None
    for div in log.divergences():
        present = [e for e in div.by_rank.values() if e is not None]
        entry = div.by_rank.get(dead.rank) or (present[0] if log.log.died_in.get(dead.rank) and dead.rank in div.by_rank else None)
        if div.kind == "missing" or entry is None:
            continue
        odd = div.odd()
        if not odd or dead.rank in odd or len(odd) == len(div.by_rank):
            continue
        what = {"op": "different ops", "shape": "shape mismatch", "dtype": "dtype mismatch", "args": "argument mismatch"}[div.kind]
        detail = "; ".join(f"{format_ranks(rs)} {d}" for rs, d in group_by((r, describe(e)) for r, e in sorted(div.by_rank.items()) if e))
        if div.peers:
            detail += f" (where {div.witnesses()})"
        return (
            f"rank {dead.rank} died ({dead.detail}) inside {entry['op']} #{div.seq} on {div.label or f'group {div.group}'}, a {what}: {detail}. "
            f"Root cause: {format_ranks(odd)}, the odd one{'s' if len(odd) > 1 else ''} out; rank {dead.rank} is a victim "
            "(gloo aborts a rank that receives data its own tensor can't hold).",
            odd,
        )
    return None


def _waits(ranks: list[Position]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _place(p: Position) -> tuple[Any, ...]:
    """What must be equal for ranks to be in the same collective."""
    shapes = (_tup(p.sizes), _tup(p.dtypes)) if p.sizes is not None or p.dtypes is not None else p.shapes
    return (p.op, p.seq, p.group, shapes, args_text(p.args))


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
    for key in sorted({k for p in waiting for k in (p.args or {})}):
        if distinct(lambda p, key=key: (p.args or {}).get(key)):
            out.append(key)
    return out


def _witnesses(waiting: list[Position], log: CollectiveReport | None) -> dict[int, tuple[Any, ...]]:
    """Ranks not waiting that made the same position (sequence number) on another group of the
    same role as a waiting rank's (a mesh's other tp group): what they called there."""
    if log is None:
        return {}
    busy = {p.rank for p in waiting}
    out: dict[int, tuple[Any, ...]] = {}
    for p in waiting:
        if p.group is None or p.seq is None:
            continue
        for r, e in log.same_role(p.group, p.seq).items():
            if r not in busy:
                out[r] = (e["op"], _tup(e.get("sizes")), _tup(e.get("dtypes")))
    return out


def _disagree(waiting: list[Position], positions: list[Position], log: CollectiveReport | None = None) -> Diagnosis:
    """The waiting ranks are not all in the same collective: say what differs and who stands out."""
    places = group_by((p.rank, _place(p)) for p in waiting)
    by_rank = {p.rank: p for p in waiting}
    diffs = _differences(waiting)

    def where(ranks: list[int]) -> str:
        p = by_rank[ranks[0]]
        seq = f" #{p.seq}" if p.seq is not None else ""
        grp = p.on() if "group" in diffs else ""
        args = args_text(p.args)
        shapes = p.shapes or ""
        # The shapes' words (describe) already end with the arguments when the log knew them.
        return f"{format_ranks(ranks)} in {p.op}{seq}{grp}" + (f" {shapes}" if shapes else "") + (f" {args}" if args and args not in shapes else "")

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
        # A tie (e.g. 2 ranks, one each) says nothing by itself; ranks in step on the other groups of
        # the same role may (a mesh's other tp group made the same call at this position).
        seen = _witnesses(waiting, log)
        votes = {tuple(rs): sum(1 for v in seen.values() if v == (by_rank[rs[0]].op, _tup(by_rank[rs[0]].sizes), _tup(by_rank[rs[0]].dtypes)))
                 for rs, _ in places}
        best = max(votes.values(), default=0)
        if best and list(votes.values()).count(best) == 1:
            majority = list(next(rs for rs, v in votes.items() if v == best))
            odd = sorted(r for r in by_rank if r not in majority)
            blame = (f"The odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)} — {format_ranks(sorted(seen))} made the same "
                     f"call as {format_ranks(majority)} at that position on the other groups of this role.")
        else:
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


def _refine_missing(waiting: list[Position], finished: list[Position], log: CollectiveReport, positions: list[Position],
                    sources: dict[int, str]) -> Diagnosis | None:
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
        at = {p.rank: log.log.pending(p.rank) or {"op": p.op or "?"} for p in waiting} | entered
        if all("sizes" in e for e in at.values()) and len({signature(e) for e in at.values()}) == 1:
            # The same call everywhere: gloo's ranks leave an all_reduce at different times, and on a
            # slow link the last ones are still moving data when the first have finished.
            return Diagnosis("slow", f"every rank entered the same {head.op} #{head.seq} on {log.label(head.group)}; "
                             f"{format_ranks(list(entered))} finished it, {format_ranks([p.rank for p in waiting])} "
                             "are still finishing it (a large transfer or a slow link): slow, not a hang.", positions)
        kind = "different ops" if any(e["op"] != head.op for e in entered.values()) else _mismatch(list(at.values()))
        detail = "; ".join(f"{format_ranks(rs)} {d}" for rs, d in group_by((r, describe(e)) for r, e in sorted(at.items())))
        odd = odd_ones({r: signature(e) if "sizes" in e else e["op"] for r, e in at.items()})
        done = f"{format_ranks(list(entered))} completed it anyway; the others wait."
        if odd and len(odd) < len(at):
            blame = f"The odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)} ({done[:-1]})."
        else:
            odd, blame = list(entered), done
        return Diagnosis("hang", f"{kind} at {head.op} #{head.seq} on {log.label(head.group)}: {detail}. {blame}", positions, odd)
    w = format_ranks([p.rank for p in waiting])
    if head.group != "0" and absent:
        return Diagnosis(
            "hang",
            f"sub-group collective missing a member: {w} {_waits(waiting)} in {head.collective()} on {log.label(head.group)}, "
            f"but {format_ranks(absent)} of that group never entered it.",
            positions, absent,
        )
    if not absent:
        return None
    pending = log.log.pending(head.rank) or {}
    cell = pending.get("cell")
    # One collective short (by sequence number: the log may have let old entries go), in the same
    # cell: a loop that ran fewer times on those ranks — one op per step, or a step of several
    # (FSDP's all_gathers and reduce_scatters).
    if cell is not None and all(log.log.last_seq(r, head.group) == head.seq - 1 for r in absent):
        seq = log.log.sequence(absent[0], head.group)
        # Counting the cell's calls needs all of them: no gap, and the log reaching back before the cell.
        whole = len(seq) == seq[-1]["seq"] - seq[0]["seq"] + 1 and (seq[0]["seq"] == 1 or seq[0].get("cell") != cell)
        ahead = [e["op"] for e in log.log.sequence(head.rank, head.group) if e.get("cell") == cell]
        behind = [e["op"] for e in seq if e.get("cell") == cell]
        steps = uneven_steps(ahead, behind) if whole else None
        made = None
        if steps is not None and len(steps[0]) == 1:
            made = f"made {steps[1]} {head.op} calls on {log.label(head.group)}, {format_ranks(absent)} stopped after {steps[2]}"
        elif steps is not None:
            made = (f"ran {steps[1]} steps of ({', '.join(steps[0])}) on {log.label(head.group)}, {format_ranks(absent)} "
                    f"stopped after {steps[2]}")
        elif seq and seq[-1]["op"] == head.op and seq[-1].get("cell") == cell:
            made = f"reached {head.op} #{head.seq} on {log.label(head.group)}, {format_ranks(absent)} stopped after #{head.seq - 1}"
        if made is not None:
            why = _because(head, sources)
            if why and "under `" in why:
                return Diagnosis("hang", f"rank-conditional collective: {w} {made}; {why}.", positions, absent)
            return Diagnosis(
                "hang",
                f"uneven collective counts: {w} {made}" + (f"; {why}." if why else " (the same call ran more often on those ranks: likely a loop of another "
                                 "length per rank, or a per-rank condition — distnb counts calls, not iterations)."),
                positions, absent,
            )
    why = _because(head, sources)
    return Diagnosis(
        "hang",
        f"rank-conditional collective: {w} entered {head.collective()} on {log.label(head.group)}, but "
        f"{format_ranks(absent)} finished the cell without entering it" + (f"; {why}." if why else "."),
        positions, absent,
    )


def _because(head: Position, sources: dict[int, str]) -> str:
    """The cell's code around the waiting rank's call, as evidence (cell_source.because)."""
    cell = head.line_cell if head.line_cell is not None else head.running
    return because(sources.get(cell) if cell is not None else None, head.line, cell)


def _mismatch(entries: list[dict[str, Any]]) -> str:
    """``shape mismatch``, ``dtype mismatch``, ``argument mismatch (src)``: what differs between
    the same op's calls."""
    if any("sizes" not in e for e in entries):
        return "shape or dtype mismatch"
    shapes = len({signature(e)[1] for e in entries}) > 1
    dtypes = len({signature(e)[2] for e in entries}) > 1
    if shapes and dtypes:
        return "shape and dtype mismatch"
    if dtypes or shapes:
        return "dtype mismatch" if dtypes else "shape mismatch"
    keys = sorted({k for e in entries for k in (e.get("args") or {})})
    args = [k for k in keys if len({repr((e.get("args") or {}).get(k)) for e in entries if e.get("args") is not None}) > 1]
    return f"argument mismatch ({', '.join(args)})" if args else "mismatch"


def exit_detail(returncode: int | None) -> str:
    return signal_meaning(returncode)
