"""Rules that read where the ranks are, not what they called: a debugger pause, nothing to judge
yet, ranks the cell does not run on, a rank with no stack, ranks still computing (importing,
compiling), every rank in the same collective, and — when the log cannot say more — ranks that
finished while others wait, or wait in different places."""

from __future__ import annotations

from typing import Any

from distnb._text import end_sentence
from distnb.analysis.agreement.cell_source import because
from distnb.analysis.agreement.entry_words import args_text
from distnb.analysis.root_cause import RootCause
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.straggler_rule import straggler
from distnb.analysis.verdicts.verdict import Certainty, Kind, Site, Verdict, VerdictState
from distnb.analysis.verdicts.words import ranks_verb
from distnb.ranks import format_ranks, group_by

__all__ = ["computing", "disagree", "finished_early", "new_group_wait", "not_in_cell", "paused", "quiet", "same_collective", "unresponsive"]


def _v(rec: Records, state: VerdictState, kind: Kind, summary: str, culprits: list[int] | None = None, rule: str = "",
       certainty: Certainty = Certainty.LIKELY, reason: str = "", sites: list[Site] | None = None, root: RootCause | None = None) -> Verdict:
    return Verdict(state, kind, summary, culprits or [], [p.rank for p in rec.waiting if p.rank not in (culprits or [])], sites or [],
                   None, certainty, reason, positions=rec.positions, rule=rule, root=root)


def paused(rec: Records) -> Verdict | None:
    """Ranks waiting for the notebook (pdb, input()) are not hung, and neither are those waiting for them."""
    held = rec.of(Place.PAUSED)
    if not held:
        return None
    first, one = held[0], len(held) == 1
    at = first.at() if all(p.at() == first.at() for p in held) else ""
    summary = f"{format_ranks([p.rank for p in held])} {'is' if one else 'are'} {first.detail}{at}"
    if rec.waiting:
        summary += (f"; {format_ranks([p.rank for p in rec.waiting])} {ranks_verb(rec.waiting, 'wait')} for {'it' if one else 'them'} "
                    f"in {rec.waiting[0].collective()}")
    act = "continue in the debugger panel" if "panel" in first.detail else "answer the prompt (c continues)"
    return _v(rec, VerdictState.PAUSED, Kind.PAUSED, summary + f" — not a hang: {act}, or interrupt the cell.", rule="paused",
              certainty=Certainty.CERTAIN)


def quiet(rec: Records) -> Verdict | None:
    """A running cell with nothing to judge yet: no rank waits past the threshold, none failed."""
    if not rec.running or rec.dead or rec.of(Place.FAILED, Place.STRANDED):
        return None
    if not rec.waiting:
        silent, busy = rec.of(Place.UNRESPONSIVE), rec.of(Place.COMPUTING)
        if silent and rec.elapsed >= rec.hang_after:
            return None  # the unresponsive rule says it
        if busy and rec.elapsed >= rec.hang_after:
            return _v(rec, VerdictState.RUNNING, Kind.NONE, f"{format_ranks([p.rank for p in busy])} still running Python code (no rank is in a "
                      "collective).", rule="quiet")
        return _calm(rec, "no rank is waiting in a collective.")
    if rec.longest_wait() < rec.hang_after:
        return _calm(rec, "collectives in progress.")
    return None


def _calm(rec: Records, summary: str) -> Verdict:
    """Nothing wrong yet — unless one rank keeps the others waiting at most collectives."""
    return straggler(rec) or _v(rec, VerdictState.OK, Kind.NONE, summary, rule="quiet")


def not_in_cell(rec: Records) -> Verdict | None:
    """Ranks the waiting collective needs that the cell does not run on."""
    outside = rec.of(Place.IDLE)
    if not rec.waiting or not outside:
        return None
    head = rec.waiting[0]
    if rec.log is not None and head.group is not None:
        members = set(rec.log.members(head.group))
        absent = [p.rank for p in outside if p.rank in members]
    else:
        absent = [p.rank for p in outside]  # a group we can't name: most likely the default one, every rank
    if not absent:
        return None
    w = format_ranks([p.rank for p in rec.waiting])
    return _v(rec, VerdictState.HANG, Kind.NOT_IN_CELL,
              f"{w} {ranks_verb(rec.waiting, 'wait')} in {head.collective()}{head.on()} for {format_ranks(absent)}, which "
              f"{'is' if len(absent) == 1 else 'are'} not part of this cell: a collective needs every rank of its group, "
              "so run the cell on all of them.", absent, "not_in_cell", Certainty.CERTAIN)


def unresponsive(rec: Records) -> Verdict | None:
    silent = rec.of(Place.UNRESPONSIVE)
    if not silent or (not rec.waiting and rec.elapsed < rec.hang_after):
        return None
    ranks = [p.rank for p in silent]
    s = silent[0]
    if not rec.waiting:
        summary = end_sentence(f"{format_ranks(ranks)} {'is' if len(silent) == 1 else 'are'} not answering: {s.detail}")
    else:
        w = format_ranks([p.rank for p in rec.waiting])
        summary = end_sentence(f"{w} {ranks_verb(rec.waiting, 'wait')} in {rec.waiting[0].op} for {format_ranks(ranks)}, which "
                               f"{'is' if len(silent) == 1 else 'are'} not answering at all: {s.detail}")
    return _v(rec, VerdictState.HANG, Kind.UNRESPONSIVE, summary, ranks, "unresponsive", reason="it gives no stack: where it is stuck is unknown",
              root=RootCause.of(ranks) if rec.waiting else None)


#: A running rank's main thread busy (running, or waiting for a CPU taken from it: worker/recorders/main_cpu.py) this
#: share of the time or more computes, however loaded the machine; one this little or less is blocked.
BUSY_CPU = 0.2
IDLE_CPU = 0.05


def computing(rec: Records) -> Verdict | None:
    """Ranks still running code while others wait for them: importing or compiling (slow), else
    slow, stuck in a loop, or about to skip the collective."""
    busy = rec.of(Place.COMPUTING)
    if not busy or not rec.waiting:
        return None
    w = format_ranks([p.rank for p in rec.waiting])
    ranks = [p.rank for p in busy]
    who, verb = format_ranks(ranks), "is" if len(busy) == 1 else "are"
    head = f"{w} {ranks_verb(rec.waiting, 'wait')} in {rec.waiting[0].op} while {who} {verb}"
    if all(p.detail.startswith("importing") for p in busy):
        # A first use of e.g. torch._dynamo (DDP, compile) imports for seconds: slow, not hung yet.
        return _v(rec, VerdictState.SLOW, Kind.IMPORTING, f"{head} still importing modules ({busy[0].detail}): slow, not a hang yet.", ranks,
                  "computing")
    if all(p.detail.startswith("compiling") for p in busy):
        # A compile on some ranks only (a recompile: a guard failed there) makes the others wait.
        return _v(rec, VerdictState.SLOW, Kind.COMPILING, f"{head} {busy[0].detail}: slow, not a hang yet (if it recompiles on every step, "
                  "%dist_compile says which guard fails).", ranks, "computing")
    if all(p.cpu is not None and p.cpu >= BUSY_CPU for p in busy):
        # Its main thread uses the CPU: it computes (a rank given more work, a slower path) and may
        # arrive any moment. Said live, never as a hang: a long healthy cell must not print one.
        share = min(p.cpu or 0.0 for p in busy)
        return _v(rec, VerdictState.SLOW, Kind.STILL_RUNNING, f"{head} still computing outside any collective (its main thread "
                  f"is busy {share:.0%} of the time or more): slow, not a hang yet; if it never arrives, %dist_stacks shows where it loops.",
                  ranks, "computing")
    idle = all(p.cpu is not None and p.cpu <= IDLE_CPU for p in busy)
    return _v(rec, VerdictState.HANG, Kind.STILL_RUNNING, f"{head} still running Python code outside any collective " + (
              "without using the CPU (blocked on something else: a sleep, a lock, a queue, I/O — or about to skip the collective)."
              if idle else "(slow, stuck in a loop, or about to skip it)."), ranks, "computing",
              reason="a rank running code may yet arrive: slow, stuck, or on its way elsewhere")


def new_group_wait(rec: Records) -> Verdict | None:
    if not rec.waiting or rec.waiting[0].op != "new_group" or any(p.op != "new_group" for p in rec.waiting):
        return None
    # Group creation is a store rendezvous that takes milliseconds: a long wait with every rank at
    # the same creation is not "slow".
    return _v(rec, VerdictState.HANG, Kind.GROUP_CREATION,
              f"every rank waits in new_group{rec.waiting[0].at()}, with the same members on every rank as far as distnb saw, and it "
              "has not completed: a rank may have created a group under another name earlier (outside distnb's view) — check with "
              "%dist_stacks and %dist_collectives.", rule="new_group_wait", reason="no record shows which rank differs")


def finished_early(rec: Records) -> Verdict | None:
    """Ranks finished the cell while others wait in a collective (the log could not say more)."""
    finished = rec.of(Place.FINISHED)
    if not rec.waiting or not finished:
        return None
    if rec.log is not None and all(p.group is not None for p in rec.waiting):
        # Finished ranks outside every waiting rank's group are no evidence of anything here.
        members = {r for g in {str(p.group) for p in rec.waiting} for r in rec.log.members(g)}
        finished = [p for p in finished if p.rank in members]
        if not finished:
            return None
    head = rec.waiting[0]
    w = format_ranks([p.rank for p in rec.waiting])
    entered = {p.rank for p in finished if _issued(p, rec.waiting)}
    if entered and len(entered) == len(finished):
        # Each finished rank's own count says it issued the collective the others wait in (its
        # log may not have arrived yet): they are still in a call every rank made. Slow so far.
        return _v(rec, VerdictState.SLOW, Kind.SLOW_COLLECTIVE,
                  f"{format_ranks(sorted(entered))} issued {head.collective()} and finished the cell; {w} "
                  f"{'is' if len(rec.waiting) == 1 else 'are'} still in it (its data still on its way): slow, not a hang yet.",
                  rule="finished_early", reason="from the finished ranks' collective counts at the cell's end")
    finished = [p for p in finished if p.rank not in entered]  # no evidence they entered it
    cell = head.line_cell if head.line_cell is not None else head.running
    why = because(rec.sources.get(cell) if cell is not None else None, head.line, cell)
    # By majority: more ranks waiting than finished — the finished ones skipped it; fewer — the
    # waiting ones made a call the others did not.
    waiting_more = len(rec.waiting) > len(finished)
    culprits = [p.rank for p in finished] if waiting_more or len(rec.waiting) == len(finished) else [p.rank for p in rec.waiting]
    kind = Kind.CALL_MISSING if culprits == [p.rank for p in finished] else Kind.CALL_EXTRA
    sites = [Site(cell, head.line, head.func, head.code, "the call")] if head.line else []
    # Named for its cause only when the code shows it: a condition on the rank, or a loop.
    head_words = "rank-conditional collective" if "under `" in why else "uneven loop" if "inside `" in why else \
        "a collective only some ranks reached"
    left = "ended" if any(p.file for p in finished) else "finished the cell"  # a program's rank (a job's) has no cell
    found = _v(rec, VerdictState.HANG, kind,
               f"{head_words}: {w} entered {head.collective()}, but {format_ranks([p.rank for p in finished])} {left} without entering it"
               + (f"; {end_sentence(why)}" if why else " (likely a condition on the rank around it, or a loop that ran fewer times on one side)."),
               culprits, "finished_early", reason="from where the ranks are (the collective log said no more)", sites=sites)
    found.explained = bool(why)
    return found


def _issued(done: Position, waiting: list[Position]) -> bool:
    """Whether a finished rank's counts show it issued every call the waiting ranks wait in (each
    known by its group and sequence number): then it did not skip them."""
    seqs = done.seqs or {}
    known = [(str(p.group), p.seq) for p in waiting if p.group is not None and p.seq is not None]
    return bool(seqs and known) and all(seqs.get(group, 0) >= seq for group, seq in known)


def disagree(rec: Records) -> Verdict | None:
    """The waiting ranks are not all in the same collective: say what differs and who stands out."""
    waiting = rec.waiting
    # A rank seen in an op without its sequence number (caught between two entries) is no evidence
    # of a different call when others are in that op.
    known = [p for p in waiting if p.seq is not None or not any(q.seq is not None and q.op == p.op for q in waiting)]
    places = group_by((p.rank, _place(p)) for p in known)
    if len(places) < 2:
        return None
    by_rank = {p.rank: p for p in known}
    diffs = _differences(known)

    def where(ranks: list[int]) -> str:
        p = by_rank[ranks[0]]
        seq = f" #{p.seq}" if p.seq is not None else ""
        grp = p.on() if "group" in diffs else ""
        args = args_text(p.args)
        shapes = p.shapes or ""
        return f"{format_ranks(ranks)} in {p.op}{seq}{grp}" + (f" {shapes}" if shapes else "") + (f" {args}" if args and args not in shapes else "")

    kind = "different collectives" if "op" in diffs else f"the same op ({known[0].op}) with a different {' and '.join(diffs) or 'call'}"
    detail = "; ".join(where(rs) for rs, _ in places)
    # A rank left out above still votes for the side whose op its stack shows, when only one side has it.
    votes = {i: len(rs) for i, (rs, _) in enumerate(places)}
    for p in waiting:
        if p not in known:
            sides = [i for i, (rs, _) in enumerate(places) if by_rank[rs[0]].op == p.op]
            if len(sides) == 1:
                votes[sides[0]] += 1
    sizes = sorted(votes.values(), reverse=True)
    if sizes[0] > sizes[1]:
        majority = next(rs for i, (rs, _) in enumerate(places) if votes[i] == sizes[0])
        odd = sorted(r for r in by_rank if r not in majority)
        blame = f"The odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)}."
    else:
        odd = sorted(by_rank)
        blame = "No majority to tell which side went wrong: check " + " and ".join(format_ranks(rs) for rs, _ in places) + "."
    return _v(rec, VerdictState.HANG, Kind.MISMATCH if "group" not in diffs else Kind.WRONG_GROUP, f"ranks are in {kind}: {detail}. {blame}",
              odd, "disagree", reason="from where the ranks wait (the collective log said no more)")


def same_collective(rec: Records) -> Verdict | None:
    if not rec.waiting:
        return None
    return _v(rec, VerdictState.SLOW, Kind.SLOW_COLLECTIVE, f"every rank is in the same collective ({rec.waiting[0].op}): slow but consistent, "
              "not a hang.", rule="same_collective", reason="the ranks agree on the call; what keeps it (a large transfer, a slow link, "
              "a peer outside distnb's view) is not recorded")


def _place(p: Position) -> tuple[Any, ...]:
    """What must be equal for ranks to be in the same collective."""
    shapes = (_tup(p.sizes), _tup(p.dtypes)) if p.sizes is not None or p.dtypes is not None else p.shapes
    return (p.op, p.seq, p.group, shapes, args_text(p.args))


def _tup(x: Any) -> Any:
    return tuple(_tup(v) for v in x) if isinstance(x, (list, tuple)) else x


def _differences(waiting: list[Position]) -> list[str]:
    def distinct(key: Any) -> bool:
        return len({repr(key(p)) for p in waiting if key(p) is not None}) > 1

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
        out.append("shape or dtype")
    for key in sorted({k for p in waiting for k in (p.args or {})}):
        if distinct(lambda p, key=key: (p.args or {}).get(key)):
            out.append(key)
    return out

