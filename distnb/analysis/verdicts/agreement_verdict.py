"""The verdict an agreement finding makes (:mod:`distnb.analysis.verdicts.agreement_rule` finds
the disagreement and its odd ranks): its kind's sentence, the sites that show it, what the
others suffer, how sure the records make it, and whom its root cause names."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from distnb.analysis.agreement.calls import Call
from distnb.analysis.agreement.cell_source import around, condition_ranks
from distnb.analysis.agreement.compare import Disagreement
from distnb.analysis.agreement.programs import Change, Difference
from distnb.analysis.root_cause import RootCause
from distnb.analysis.verdicts.agreement_causes import code_cause, skipped_words, thread_raised_words
from distnb.analysis.verdicts.position import Place
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import CALLED_FROM, Certainty, Evidence, Kind, Site, Verdict, VerdictState, call_and_caller
from distnb.analysis.verdicts.words import call_words, group_words, ranks_verb, site_of_call
from distnb.ranks import format_ranks

__all__ = ["By", "How", "agreement_verdict", "same_value", "under_rank_condition"]


class By(Enum):
    """How the odd ranks of a disagreement were found."""

    MAJORITY = "majority"  # the group's majority (with the ranks in step on the other groups of its role)
    DEPARTS = "departs"  # their calls in the cell depart from most other ranks'
    NO_MAJORITY = "no majority"  # a tie: both sides named, neither blamed
    RANK_BRANCH = "rank branch"  # the `if` on the rank around their call
    SKIPPED = "skipped"  # they made the call on a group they are not members of, and torch skipped it


@dataclass(frozen=True)
class How:
    """How the odd ranks were found, and over how many ranks (the words are :meth:`words`)."""

    by: By
    over: int = 0  # the ranks voting (MAJORITY) or compared with (DEPARTS)
    witnesses: bool = False  # MAJORITY: ranks of the other groups of the role voted too

    def words(self) -> str:
        if self.by is By.MAJORITY:
            return f"by majority over {self.over} ranks" + (
                " (the group's members and the ranks in step on the other groups of its role)" if self.witnesses else "")
        if self.by is By.DEPARTS:
            return f"its calls in this cell depart from most of the other {self.over} ranks'"
        if self.by is By.SKIPPED:
            return "by their own call of it, on a group they are not members of (torch skips it; the call log saw it)"
        return "by the `if` on the rank around their call" if self.by is By.RANK_BRANCH else "no majority"


def agreement_verdict(rec: Records, d: Disagreement, odd: list[int], tie: bool, how: How, kind: Kind, diff: Difference | None,
             ref: int | None) -> Verdict:
    log = rec.log
    assert log is not None
    undecided = tie and how.by is By.NO_MAJORITY
    others = [r for r in d.by_rank if r not in odd]
    if undecided:  # both sides named: the ranks in the call against those without it, or one value against the other
        lead = next((r for r in odd if d.by_rank.get(r) is not None), odd[0])
        side = [r for r in odd if same_value(d, r, lead)]
        first, second = side, [r for r in odd if r not in side]
    elif how.by is By.SKIPPED:  # the headline is this group's: its members that skipped
        first, second = [r for r in odd if r in d.by_rank], others
    else:
        first, second = odd, others or ([ref] if ref is not None else [])
    waiting = [p.rank for p in rec.waiting if p.rank not in odd]
    dead = [p.rank for p in rec.dead if p.rank not in odd]
    sites = _sites(rec, d, odd, diff, ref)
    cause = skipped_words(rec, odd, [c.op for c in d.by_rank.values() if c is not None]) if kind == Kind.CALL_MISSING else ""
    cause = cause or (thread_raised_words(rec, odd, diff, d) if kind == Kind.CALL_MISSING else "") or code_cause(rec, sites, kind)
    summary, kind = _words(rec, d, kind, diff, first, second)
    tail = []
    if diff is not None and diff.odd_calls and _pending_async(rec, diff.odd_calls[0]):
        tail.append("it was issued with async_op=True and its work is still pending (never waited on)")
    if cause:
        tail.append(cause)
    if waiting:
        tail.append(f"{format_ranks(waiting)} {ranks_verb(waiting, 'wait')} for {'them' if len(odd) > 1 else 'it'}")
    if dead:
        tail.append(f"{format_ranks(dead)} died in it ({_victim_words(rec, dead)})")
    gone = [p.rank for p in rec.dead if p.rank in odd]
    if gone:
        tail.append(f"{format_ranks(gone)} then died ({rec.by_rank[gone[0]].detail})")
    if rec.state() == VerdictState.DESYNC and kind in (Kind.CALL_EXTRA, Kind.CALL_MISSING, Kind.LOOP_COUNT):
        # Over on every rank, one side a call ahead: what that means for the cells to come.
        on = group_words(rec.log, d.group) if rec.log is not None else f"group {d.group}"
        tail.append(f"the next synchronisation on {on} will hang, or pair the wrong collectives")
    said = summary + ("; " + "; ".join(tail) if tail else "") + "."
    if undecided:
        said += f" No majority to tell which side went wrong: {format_ranks(first)} against {format_ranks(second)}."
    # Named with how when the group alone could not tell (a tie-break, or witnesses from the
    # other groups of its role outvoting a group of two).
    root = None if undecided else RootCause.of(odd, how=how.words() if tie or d.witnesses and how.by is By.MAJORITY else "")
    certain = _certain(rec, kind, tie, d, diff, odd, sites, how)
    return Verdict(
        rec.state(), kind, said, root=root,
        culprits=odd, victims=sorted(set(waiting) | set(dead)), sites=sites,
        evidence=Evidence("the n-th call on a group is made, and the same, by every member", _records(d), d.group, d.seq,
                          diff.fields if diff is not None and diff.fields else d.fields),
        certainty=certain, reason="" if certain == Certainty.CERTAIN else f"the odd {'ones' if len(odd) > 1 else 'one'} found {how.words()}",
        positions=rec.positions, rule="agreement", explained=bool(cause),
    )


def same_value(d: Disagreement, a: int, b: int) -> bool:
    x, y = d.by_rank.get(a), d.by_rank.get(b)
    return (x is None) == (y is None) and (x is None or y is None or x.signature() == y.signature())


def _words(rec: Records, d: Disagreement, kind: Kind, diff: Difference | None, odd: list[int], others: list[int]) -> tuple[str, Kind]:
    """The headline for the kind, ``odd`` against ``others`` (the majority, or the other side)."""
    log = rec.log
    assert log is not None
    label = group_words(log, d.group)
    who, them = format_ranks(odd), format_ranks(others) if others else "the others"
    at = next((c for r in others if (c := d.by_rank.get(r)) is not None), None)
    if kind == Kind.CALL_MISSING:
        missing = diff.majority_calls if diff is not None and diff.majority_calls else [c for c in [at] if c is not None]
        call = missing[0] if missing else None
        if under_rank_condition(rec, call):
            return _rank_conditional(rec, call, others, odd), kind
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"{who} did not make {call_words(call)}{more}{site_of_call(call, rec)} on {label}, which {them} made", kind
    if kind == Kind.CALL_EXTRA:
        extra = diff.odd_calls if diff is not None and diff.odd_calls else [c for r in odd if (c := d.by_rank.get(r)) is not None]
        call = extra[0] if extra else None
        if under_rank_condition(rec, call):
            return _rank_conditional(rec, call, odd, others), kind
        on = group_words(log, call.group) if call is not None else label
        return f"{who} made a call {them} did not: {call_words(call)}{site_of_call(call, rec)} on {on}", kind
    if kind == Kind.LOOP_COUNT and diff is not None and diff.loop is not None:
        ran, maj = diff.loop
        body = ", ".join(dict.fromkeys(c.words() for c in diff.body))
        where = site_of_call(diff.body[0], rec) if diff.body else ""
        return (f"uneven loop: {who} ran {ran} step{'s' * (ran != 1)} of ({body}){where} on {label}, {them} ran {maj}: a loop of another "
                "length per rank, or a condition in it that differs"), kind
    if kind == Kind.LOOP_COUNT and diff is not None and diff.body:
        first = diff.body[0]
        again = bool(diff.odd_calls)
        return (f"uneven loop: {who} {'went round the loop again' if again else 'left the loop'} at {call_words(first)}{site_of_call(first, rec)} "
                f"where {them} {'left it' if again else 'went round again'}: a loop of another length per rank, or a condition in it "
                "that differs"), kind
    if kind == Kind.WRONG_GROUP and diff is not None:
        first, second = diff.odd_calls[0], diff.majority_calls[0]
        return (f"collective on another group: {who} called {first.op}{site_of_call(first, rec)} over {group_words(log, first.group)} "
                f"where {them} used {second.role}"), kind
    mine = diff.odd_calls[0] if diff is not None and diff.odd_calls else next((c for r in odd if (c := d.by_rank.get(r))), None)
    theirs = diff.majority_calls[0] if diff is not None and diff.majority_calls else at
    fields = tuple(dict.fromkeys((diff.fields if diff is not None and diff.fields else d.fields) or ("call",)))
    if "op" in fields:
        fields = ("op",)  # another collective: its shapes and dtypes differ as a matter of course
    sides = "; ".join(part for part in (f"{who} {call_words(mine)}{site_of_call(mine, rec)}" if mine else "",
                                         f"{them} {call_words(theirs)}" if theirs and others else "") if part)
    shown = mine or theirs
    op = shown.op if shown is not None else "a collective"
    return f"{' and '.join(fields)} mismatch at {op} #{d.seq} on {label}: {sides}", Kind.MISMATCH


def _victim_words(rec: Records, dead: list[int]) -> str:
    return "gloo aborts a rank that receives data its own tensor can't hold" if any("SIGABRT" in rec.by_rank[r].detail for r in dead) else \
        "a victim"


def under_rank_condition(rec: Records, call: Call | None) -> bool:
    """Its line, or the issuing cell's line that called the function it is in, sits under an
    ``if`` on the rank."""
    if call is None:
        return False
    for cell, line in call.sites():
        found = around(rec.sources.get(cell, ""), line, rec.rank_names)
        if found is not None and found.rank_condition() is not None:
            return True
    return False


def _rank_conditional(rec: Records, call: Call | None, entered: list[int], skipped: list[int]) -> str:
    """``rank-conditional collective: rank 0 entered barrier #1 at cell line 4, but ranks 1,2
    finished the cell without entering it`` — the ranks on each side of an ``if`` on the rank."""
    finished = all(rec.by_rank[r].state == Place.FINISHED for r in skipped if r in rec.by_rank)
    rest = "finished the cell without entering it" if finished else "did not enter it"
    return (f"rank-conditional collective: {format_ranks(entered)} entered {call_words(call)}{site_of_call(call, rec)}, but "
            f"{format_ranks(skipped) if skipped else 'the others'} {rest}")


def _certain(rec: Records, kind: Kind, tie: bool, d: Disagreement, diff: Difference | None, odd: list[int], sites: list[Site],
             how: How) -> Certainty:
    """Certain only where the records leave no other reading, by a strict majority of at least
    three ranks: the same call site on both sides with another signature (a mismatch); or a call
    whose ``if`` on the rank, evaluated for every rank, says exactly which ranks reach it — and
    they are the odd ones (an extra call) or exactly the ones that don't (a missing one)."""
    members = [r for r in d.by_rank if r not in odd]
    if tie or len(d.voters()) < 3 or how.by is not By.MAJORITY or len(members) <= len(odd):
        return Certainty.LIKELY  # the group's own members must outnumber the odd ones
    if kind == Kind.MISMATCH and diff is not None and diff.odd_calls and diff.majority_calls and \
            diff.odd_calls[0].site() is not None and diff.odd_calls[0].site() == diff.majority_calls[0].site():
        return Certainty.CERTAIN
    if kind in (Kind.CALL_EXTRA, Kind.CALL_MISSING):
        ranks = [p.rank for p in rec.positions if p.state != Place.IDLE]
        # The call's own line first, then the cell's line that called its function.
        reach = next((found for s in call_and_caller(sites) if s.line is not None and s.cell is not None
                      if (found := condition_ranks(rec.sources.get(s.cell), s.line, max(ranks) + 1 if ranks else 0)) is not None), None)
        if reach is not None:
            reach &= set(ranks)
            if set(odd) == (reach if kind == Kind.CALL_EXTRA else set(ranks) - reach):
                return Certainty.CERTAIN
    return Certainty.LIKELY


def _records(d: Disagreement) -> dict[int, str]:
    return {r: (c.words() + c.at()) if c is not None else "no call" for r, c in sorted(d.by_rank.items())}


def _sites(rec: Records, d: Disagreement, odd: list[int], diff: Difference | None, ref: int | None) -> list[Site]:
    """Where in the notebook: the odd rank's call (extra, mismatched, misrouted), or the call the
    majority made that it did not; the majority's position when the call came from C++."""
    calls: list[Call] = []
    if diff is not None:
        calls = diff.odd_calls or diff.majority_calls or diff.body
    out = []
    for c in calls[:1]:
        if c.site() is not None:
            out.append(Site(c.site_cell, c.line, c.func, _code(rec, c.site_cell, c.line), "the call"))
            for caller, at in c.sites()[1:]:
                out.append(Site(caller, at, "", _code(rec, caller, at), CALLED_FROM))
    if not out:
        # Issued from C++ (DDP, FSDP): the line the ranks were at when they made it.
        side = odd if diff is not None and diff.odd_calls else [r for r in d.by_rank if r not in odd] or odd
        for r in side:
            p = rec.by_rank.get(r)
            if p is not None and p.line:
                cell = p.line_cell if p.line_cell is not None else p.running if p.running is not None else rec.judged_cell
                out.append(Site(cell, p.line, p.func, p.code, "where the call was made"))
                break
    if diff is not None and diff.change == Change.REPEATS and out:
        # The loop around the call, or around the line of the cell that called its function.
        for s in call_and_caller(out):
            found = around(rec.sources.get(s.cell or -1, ""), s.line or 0, rec.rank_names)
            loop = found.loop() if found else None
            if loop is not None:
                out.append(Site(s.cell, loop[0], "", loop[1], "the loop"))
                break
    return out


def _code(rec: Records, cell: int | None, line: int | None) -> str:
    code = rec.sources.get(cell) if cell is not None else None
    lines = code.splitlines() if code else []
    return lines[line - 1].strip() if line and line <= len(lines) else ""


def _pending_async(rec: Records, call: Call) -> bool:
    """An ``async_op=True`` call whose work nobody waited on: it leaves its rank a call ahead
    without any rank blocking in it."""
    return not call.done and "async_op=True" in _code(rec, call.site_cell, call.line).replace(" ", "")
