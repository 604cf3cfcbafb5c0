"""Why ranks did not make the call their group waits in, when the records say more than which
ranks: they called it on a group they are not members of (torch skipped it), a thread of theirs
that was to make it raised first, or the cell's code puts the call under an ``if`` on the rank or
inside a loop. Used by the agreement rule (:mod:`.agreement_rule`); words out."""

from __future__ import annotations

from typing import Iterable

from distnb.analysis.agreement.cell_source import around
from distnb.analysis.agreement.compare import Disagreement
from distnb.analysis.agreement.evidence import same_op
from distnb.analysis.agreement.programs import Difference
from distnb.analysis.verdicts.position import Place, thread_error_words
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Kind, Site, call_and_caller
from distnb.analysis.verdicts.words import site_words
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.wire.record_types import CallRecord, called_in

__all__ = ["code_cause", "skipped_calls", "skipped_words", "skipping_ranks", "thread_raised_words"]


def skipped_calls(rec: Records, ranks: Iterable[int], ops: list[str]) -> dict[int, CallRecord]:
    """Each of ``ranks`` that called one of ``ops`` in the cell on a group it is not a member of
    (torch returned at once: a no-op, with a warning), with that call."""
    if rec.log is None or not ops:
        return {}
    cell = rec.judged_cell
    return {r: c for r in ranks for c in reversed(rec.log.log.calls_of(r))
            if c.get("skipped") and any(same_op(c["op"], op) for op in ops) and (cell is None or called_in(c) == cell)}


def skipping_ranks(rec: Records, d: Disagreement) -> list[int]:
    """When a member of the group without the call made it on a group it is not in: every rank
    of the cell whose call of the op torch skipped so (ranks that picked another pair's group
    leave a member missing in each pair)."""
    ops = [c.op for c in d.by_rank.values() if c is not None]
    if not skipped_calls(rec, [r for r, c in d.by_rank.items() if c is None], ops):
        return []
    return sorted(skipped_calls(rec, [p.rank for p in rec.positions if p.state != Place.IDLE], ops))


def skipped_words(rec: Records, missing: list[int], ops: list[str]) -> str:
    """Words for ranks that did call the collective the others wait in, on a group they are not
    members of, so they never joined the group's call."""
    found = skipped_calls(rec, missing, ops)
    if not found:
        return ""
    call = next(iter(found.values()))
    at = site_words(call["cell"], line, call["func"], rec) if (line := call.get("line")) else ""
    one = len(found) == 1
    return (f"{format_ranks(sorted(found))} called {call['op']}{at} on a group {'it is not a member' if one else 'they are not members'} "
            f"of (new_group gives a rank outside the group GroupMember.NON_GROUP_MEMBER): torch skipped the "
            f"{'call' if one else 'calls'} — a no-op, with a warning — so {'it' if one else 'they'} never joined")


def thread_raised_words(rec: Records, missing: list[int], diff: Difference | None, d: Disagreement) -> str:
    """Words for ranks without the call whose other thread raised in the cell: a thread that
    raised ended there, and a call it was to make never came. Said as the cause when the call the
    others made comes from the function the thread raised in, else as the likely one."""
    raised = {r: p.threads[0] for r in missing if (p := rec.by_rank.get(r)) is not None and p.threads}
    if not raised:
        return ""
    calls = (diff.majority_calls if diff is not None else []) or [c for c in d.by_rank.values() if c is not None]
    funcs = {c.func for c in calls if c.func not in ("", "<module>")}
    first = next(iter(raised.values()))
    ranks = format_ranks(sorted(raised))
    own = len(raised) == 1
    said = f"{ranks}'s thread {thread_error_words(first, rec.judged_cell)}" if own else \
        f"a thread of each of {ranks} raised (rank {min(raised)}'s {thread_error_words(first, rec.judged_cell)})"
    if first["func"] in funcs:
        return f"{said}: the thread ended there, before its call"
    return f"{said}; likely the thread that was to make the call"


def code_cause(rec: Records, sites: list[Site], kind: Kind | None = None) -> str:
    """What the cell's code says around the site: a rank condition, a loop."""
    if not sites or sites[0].line is None:
        return ""
    # The call's own line, then the line of the cell that called the function it is in (a
    # function an earlier cell defined): the first under an `if` on the rank says why.
    read = [(s, found) for s in call_and_caller(sites) if s.line is not None and (found := around(rec.sources.get(s.cell or -1, ""), s.line, rec.rank_names))]
    if not read:
        return ""
    s, found = next(((s, f) for s, f in read if f.rank_condition() is not None), read[0])
    cond = found.rank_condition()
    if cond is not None and kind == Kind.MISMATCH:
        return f"the call at {cell_name(s.cell)} line {s.line} is under `{cond[1]}` (line {cond[0]}): the ranks took different branches"
    if cond is not None:
        return f"the call at {cell_name(s.cell)} line {s.line} is under `{cond[1]}` (line {cond[0]}): a collective only some ranks reach"
    loop = found.loop()
    if loop is not None:
        return f"the call is inside `{loop[1]}` ({cell_name(s.cell)} line {loop[0]})"
    return ""
