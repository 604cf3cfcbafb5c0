"""The rule the others lean on: the first place the cell's ranks broke an SPMD constraint, who
broke it, and how — from the agreement model (:mod:`distnb.analysis.agreement`).

A disagreement in a group (members that left the cell beside members waiting in a call, or
different calls at one position) is the gate: nothing is judged while every group agrees. The odd
ranks are the group's minority, counting the ranks in step on the other groups of its role; on a
tie, the ranks whose whole program of the cell departs from the other ranks'. How the odd rank's
program departs — a call missing or extra, a loop run another number of times, another call at the
same site, another group — is the kind. An odd rank that left the cell by raising an error of its
own, or by dying before the call, is a ``raised`` or ``died`` verdict instead: its error or death
explains the calls it did not make.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from distnb.analysis.agreement.calls import Call, cell_calls, death_call
from distnb.analysis.agreement.cell_source import loop_span, other_branches
from distnb.analysis.agreement.compare import Disagreement, Presence, disagreements
from distnb.analysis.agreement.programs import Change, Difference, compare_programs
from distnb.analysis.verdicts.agreement_causes import skipping_ranks
from distnb.analysis.verdicts.agreement_verdict import By, How, agreement_verdict, same_value, under_rank_condition
from distnb.analysis.verdicts.position import Place
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Kind, Verdict
from distnb.wire.record_types import UNRECORDED

__all__ = ["agreement"]

#: Other ranks a tied rank's program is compared with (the majority needs a handful, not all).
_SAMPLE = 16

_KINDS = {Change.MISSING: Kind.CALL_MISSING, Change.EXTRA: Kind.CALL_EXTRA, Change.REPEATS: Kind.LOOP_COUNT,
          Change.DIFFERENT: Kind.MISMATCH, Change.OTHER_GROUP: Kind.WRONG_GROUP}


def agreement(rec: Records) -> Verdict | None:
    log, cell = rec.log, rec.judged_cell
    if log is None or cell is None or rec.logs_behind:
        return None  # (a finished rank's records still on their way: what they lack decides nothing yet)
    where = rec.presence()
    found = disagreements(log.log, cell, where, rec.waiting_in())
    if not found:
        return None
    d = _upstream(found, rec)
    programs: dict[int, list[Call]] = {}

    def program(r: int) -> list[Call]:
        if r not in programs:
            programs[r] = _program(rec, r, cell)
        return programs[r]

    def loop_of(c: int, line: int) -> tuple[int, int] | None:
        return loop_span(rec.sources.get(c), line)

    def apart(c: int, a: int, b: int) -> bool:
        return other_branches(rec.sources.get(c), a, b)

    dead = {p.rank for p in rec.dead}

    def compare(a: int, b: int, votes: bool = False) -> Difference | None:
        # A dead rank's program ends where it died, not where it left the cell: shorter is not
        # "missing". For a vote, its last call read off its stack at death (no shapes) is no
        # evidence either way.
        def calls(r: int) -> list[Call]:
            return [c for c in program(r) if not (c.entry.get("id") == UNRECORDED and c.sizes is None)] if votes else program(r)
        return compare_programs(calls(a), calls(b), where.get(a) == Presence.GONE and a not in dead,
                                where.get(b) == Presence.GONE and b not in dead, loop_of, apart)

    odd, tie, how = _blame(d, where, lambda a, b: compare(a, b, votes=True), rec)
    if not odd:
        return None
    if tie and how.by is By.NO_MAJORITY and _undecided_members(rec, d, where):
        return None  # members whose call there is not known yet may break the tie: judge when they are
    if tie and how.by is By.NO_MAJORITY:
        # No side to call odd: compare the two sides' programs, the ranks in the call against the others.
        inside = [r for r in odd if d.by_rank.get(r) is not None] or odd[:1]
        a = inside[0]
        ref = next((r for r in odd if not same_value(d, r, a)), None)
    else:
        a = odd[0]
        ref = _reference(d, odd, program)
    if ref is not None:
        programs[a] = _known_start(programs.get(a) or program(a), program(ref), d, a)
    diff = compare(a, ref) if ref is not None else None
    branch = _rank_branch(rec, d, program)
    if branch is not None:
        side, call = branch
        if tie and how.by is By.NO_MAJORITY:
            odd, tie, how = side, False, How(By.RANK_BRANCH)
        # The odd ranks took the branch (an extra call), or the others did (the odd ones lack it).
        diff = Difference(Change.EXTRA, [call], [], 0) if set(odd) <= set(side) else Difference(Change.MISSING, [], [call], 0)
    skipped = skipping_ranks(rec, d)
    if skipped and set(skipped) != set(odd):
        # The members without the call made it, on a group they are not in: torch dropped it.
        # They are the odd ones, whatever a vote of a group of two said.
        present = next(c for c in d.by_rank.values() if c is not None)
        odd, tie, how, diff = skipped, False, How(By.SKIPPED), Difference(Change.MISSING, [], [present], 0)
    if _left_first(rec, d, odd):
        return None  # their error or death explains the calls they did not make: the event rules say so
    kind = _KINDS[diff.change] if diff is not None else (
        Kind.CALL_MISSING if d.presence and all(d.by_rank.get(r) is None for r in odd) else
        Kind.CALL_EXTRA if d.presence else Kind.MISMATCH)
    return agreement_verdict(rec, d, odd, tie, how, kind, diff, ref)


def _rank_branch(rec: Records, d: Disagreement, program: Any) -> tuple[list[int], Call] | None:
    """The ranks whose own call at the disagreement sits under an ``if`` on the rank (``if
    master_process:``), at a site none of the group's other ranks made a call from in the cell,
    and that call: one side took a branch the other did not, however the programs line up. (They
    line up wrongly when a rank died within milliseconds: its calls before that one never reached
    distnb, and the reference rank's, copied in their place, make a call at an earlier line of the
    loop look skipped.)"""
    at: dict[tuple[int, int], Call] = {}  # each call site at the disagreement, and a call made there
    for c in d.by_rank.values():
        if c is not None and (s := c.site()) is not None:
            at.setdefault(s, c)
    # Read once per site, not per rank (each reading parses the cell): a thousand ranks share a few sites.
    conditional = {s: under_rank_condition(rec, c) for s, c in at.items()}
    for site in sorted(at):
        side = sorted(r for r, c in d.by_rank.items() if c is not None and c.site() == site)
        if not conditional[site] or len(side) == len(d.by_rank):
            continue
        if any(conditional[s] for s in at if s != site):
            continue  # the others' call is under an `if` on the rank too (its else branch): calls that differ, not one extra
        if any(c.site() == site for r in d.by_rank if r not in side for c in program(r)):
            continue  # the others make calls there too: the branch is not what sets them apart
        call = d.by_rank[side[0]]
        assert call is not None  # side holds the ranks with a call at this site
        return side, call
    return None


def _upstream(found: list[Disagreement], rec: Records) -> Disagreement:
    """The disagreement that comes first in the program, not in time: one whose absent ranks wait
    in another's call, earlier in the cell (and outside any loop around it), follows from that one.
    Rank 2 skipped its subgroup's all_reduce (line 9) and waits in the barrier (line 12); its
    subgroup peer waits in that all_reduce and so is absent from the barrier. The barrier may have
    been entered first; the all_reduce is where the ranks parted."""
    first = found[0]
    for other in found[1:]:
        if _holds_absent(other, first) and _earlier(rec, other, first):
            return other
    return first


def _holds_absent(a: Disagreement, b: Disagreement) -> bool:
    """Whether ranks absent from ``b`` made their call in ``a``."""
    return any(c is None and a.by_rank.get(r) is not None for r, c in b.by_rank.items())


def _earlier(rec: Records, a: Disagreement, b: Disagreement) -> bool:
    """Whether ``a``'s call site comes before ``b``'s in one cell, neither inside a loop around the other."""
    ca = next((c for c in a.by_rank.values() if c is not None and c.line is not None), None)
    cb = next((c for c in b.by_rank.values() if c is not None and c.line is not None), None)
    if ca is None or cb is None or ca.site_cell != cb.site_cell or ca.site_cell is None or ca.line is None or cb.line is None or ca.line >= cb.line:
        return False
    loop = loop_span(rec.sources.get(ca.site_cell), cb.line)
    return loop is None or not loop[0] <= ca.line <= loop[1]


def _program(rec: Records, r: int, cell: int) -> list[Call]:
    """The rank's calls of the cell; the one it waits in (or raised in) placed at its stack's line
    when the call came from C++ (DDP's buckets carry no Python site), and the call its stack at
    death put it in when its entry never came (or came without its site)."""
    assert rec.log is not None
    calls = cell_calls(rec.log.log, r, cell)
    p = rec.by_rank.get(r)
    if p is None:
        return calls
    if calls and p.line and calls[-1].line is None and (p.state == Place.FAILED or p.state == Place.COLLECTIVE and not calls[-1].done):
        here = p.line_cell if p.line_cell is not None else cell
        calls[-1] = replace(calls[-1], site_cell=here, line=p.line, func=p.func)
    if p.state == Place.DEAD:
        last = calls[-1] if calls else None
        mine = death_call(rec.log.log, r, last.group if last is not None else "0", None)
        if mine is not None and mine.cell == cell and (last is None or last.site() != mine.site()):
            calls.append(mine)
    return calls


def _known_start(mine: list[Call], theirs: list[Call], d: Disagreement, rank: int) -> list[Call]:
    """A rank whose calls before the disagreement never reached distnb (it died within
    milliseconds, before its control thread pushed them): up to the disagreement the ranks agreed
    — it is the first place they part — so its program starts as the reference rank's does."""
    at = d.by_rank.get(rank)
    if at is None:
        return mine
    if at.seq is None or any(c.group == d.group and c.seq is not None and c.seq < d.seq for c in mine):
        return mine
    before = []
    for c in theirs:
        if c.group == d.group and c.seq is not None and c.seq >= d.seq:
            break
        before.append(c)
    if not before:
        return mine
    rest = [c for c in mine if not (c.group == d.group and c.seq is not None and c.seq < d.seq)]
    if rest and rest[0].seq is None and at.entry.get("id") == UNRECORDED:
        rest[0] = replace(rest[0], seq=d.seq)  # the call its stack at death put it in is the one at the disagreement
    return before + rest


def _blame(d: Disagreement, where: dict[int, Presence], compare: Any, rec: Records) -> tuple[list[int], bool, How]:
    """The odd ranks, whether only a tie-break named them, and how they were found.

    The ranks whose programs of the cell depart from most other ranks' (among the cell's ranks,
    up to a sample: the rank that skipped a call may not be in the group that shows the hang first,
    and a group of two has no majority of its own); else the group's majority, with the ranks in
    step on the other groups of its role."""
    ranks = list(d.by_rank) + [r for r in where if r not in d.by_rank]
    ranks = ranks[:_SAMPLE] if len(ranks) > _SAMPLE else ranks
    if len(ranks) >= 3:
        departs = [r for r in ranks if sum(compare(r, o) is not None for o in ranks if o != r) * 2 > len(ranks) - 1]
        if departs and len(departs) * 2 < len(ranks):
            if not d.tie and set(departs) == set(d.odd):
                return d.odd, False, _by_majority(d)
            return sorted(departs), False, How(By.DEPARTS, len(ranks) - 1)
    if not d.tie:
        return d.odd, False, _by_majority(d)
    return sorted(d.odd), True, How(By.NO_MAJORITY)


def _undecided_members(rec: Records, d: Disagreement, where: dict[int, Presence]) -> list[int]:
    """Members of the group in the cell whose call at the disagreement is not known either way
    (still running code, or in a call the log has not shown yet)."""
    members = rec.log.log.groups.get(d.group, []) if rec.log is not None else []
    return [r for r in members if r in where and r not in d.by_rank]


def _by_majority(d: Disagreement) -> How:
    return How(By.MAJORITY, len(d.voters()), bool(d.witnesses))


def _reference(d: Disagreement, odd: list[int], program: Any) -> int | None:
    """A majority rank to compare the odd rank's program with: the one that got furthest."""
    pool = [r for r in d.by_rank if r not in odd] or [r for r in d.witnesses if r not in odd]
    return max(pool, key=lambda r: (len(program(r)), -r)) if pool else None


def _left_first(rec: Records, d: Disagreement, odd: list[int]) -> bool:
    """The disagreement is only that ranks made no call because they raised an error of their
    own, died, or were stranded by a death before it: the event is the cause."""
    if not any(c is None for c in d.by_rank.values()):
        return False
    absent = [r for r, c in d.by_rank.items() if c is None]
    if d.inside and not (rec.dead and all((p := rec.by_rank.get(r)) is not None and p.state in (Place.FAILED, Place.STRANDED)
                                          and p not in rec.raised for r in absent)):
        # A rank died inside the call: the call may be the mismatch that killed it, unless every
        # rank without it left on a peer's closed connection (a death elsewhere took them out).
        return False
    events = {p.rank for p in rec.raised} | {p.rank for p in rec.dead}
    if not events:
        return False
    # Ranks stranded by a death, or failed only because a peer's connection closed, left with it.
    left = events | {p.rank for p in rec.of(Place.STRANDED, Place.FAILED)}
    if not all(r in left for r in absent):
        return False
    # The ranks in the call agree with each other: only the absent ones differ, and they left.
    present = {c.signature() for c in d.by_rank.values() if c is not None}
    return len(present) == 1 or all(d.by_rank.get(r) is None for r in odd) or not set(odd) - left - set(absent)
