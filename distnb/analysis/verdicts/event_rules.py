"""Rules for ranks that left the cell by an event of their own: a death, an error.

A rank aborted inside a collective whose ranks disagree (gloo kills the rank that receives data
its tensor cannot hold) is a victim, and the odd rank of that collective the cause; any other
first death is the cause. An error of a rank's own (not a peer's connection closing, not a
timeout, not an interrupt) is the cause of the waits it leaves behind.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from distnb._text import end_sentence
from distnb.analysis.agreement.collectives import CollectiveReport, Differs, Divergence, issued_words
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.render import headline
from distnb.analysis.root_cause import Named, RootCause
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.records import Records
from distnb.analysis.verdicts.verdict import Certainty, Evidence, Kind, Site, Verdict, VerdictState
from distnb.analysis.verdicts.words import ranks_verb
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import issued_in

__all__ = ["Victim", "died", "raised", "victim", "victim_of_mismatch"]

#: torch.distributed's own checks of a call's tensors against the group's (gloo, NCCL, c10d).
_BAD_ARGUMENTS = re.compile(r"invalid tensor (size|type)|Tensors must be|tensor.* must have the same|"
                            r"Split sizes doesn't match|split_sizes|mismatch between collectives|Detected mismatch", re.IGNORECASE)


def died(rec: Records) -> Verdict | None:
    if not rec.dead:
        return None
    d = rec.dead[0]
    later = [p.rank for p in rec.dead if p is not d]
    then = f", then {format_ranks(later)}" if later else ""
    waiting = rec.waiting
    sites = [Site(p.line_cell if p.line_cell is not None else rec.judged_cell, p.line, p.func, p.code, "where it was last seen")
             for p in [d] if p.line]
    if waiting:
        w = format_ranks([p.rank for p in waiting])
        summary = (f"rank {d.rank} died{' first' if later else ''} ({d.detail}){then}; {w} {ranks_verb(waiting, 'wait')} for it in "
                   f"{waiting[0].op} and can't finish.")
    elif rec.running:
        return None
    else:
        summary = f"rank {d.rank} died{' first' if later else ''} ({d.detail}){then}."
    # A death by the rank's own hand (an exit, a kill) is certain; an abort or a crash inside a
    # collective may be the consequence of a mismatch the records did not catch.
    inside = rec.log is not None and d.rank in rec.log.log.died_in
    # Wider than Position.between: a rank in a send/recv or in new_group counts too (its part in
    # the aborted collective is not recorded either).
    unread = [p.rank for p in rec.positions if p.state == Place.COMPUTING or p.state == Place.COLLECTIVE and p.seq is None]
    state = VerdictState.HANG if waiting else VerdictState.FAILED
    victims = [p.rank for p in waiting] + later

    def abort(kind: Kind, words: str, culprits: list[int], reason: str, root: RootCause | None = None) -> Verdict:
        """An abort's verdict: likely, judged by whether the ranks' n-th calls agree."""
        return Verdict(state, kind, words, culprits, victims, sites,
                       Evidence("the n-th call on a group is the same on every member", {d.rank: d.detail}), Certainty.LIKELY,
                       reason, positions=rec.positions, rule="died", beyond_report=False, root=root)

    if "SIGABRT" in d.detail and unread:
        # gloo aborts the rank that receives more than its tensor holds, whoever sent it: with ranks
        # whose call is not recorded yet, the rank whose tensor differs may be any of them.
        return abort(Kind.MISMATCH,
                     f"rank {d.rank} aborted{then} (gloo's abort when a peer sends more than the rank's own tensor holds: the ranks' "
                     f"tensors in that collective likely differ); the calls of {format_ranks(unread)} there are not recorded yet, so "
                     "which rank's tensor differs is not known (%dist_collectives once they are).",
                     [], "an abort, not its cause: the other ranks' calls are not all recorded")
    certain = not inside and "SIGABRT" not in d.detail
    if "SIGABRT" in d.detail and (earlier := _out_of_step_before(rec, d.rank)) is not None:
        kind, words = earlier
        return abort(kind,
                     f"rank {d.rank} aborted{then}; {words}: from there its calls pair with other calls of the others, and gloo "
                     "aborts a rank that receives more than its tensor holds.",
                     [d.rank], "an earlier cell that ended on every rank left its calls out of step with the others'", RootCause.of([d.rank]))
    if inside and "SIGABRT" in d.detail:
        # gloo aborts a rank when a peer sends more than its own tensor holds: a mismatch in that
        # collective, and with no record of the others' to say who differs, likely its own.
        op = rec.log.log.died_in[d.rank] if rec.log is not None else "a collective"
        return abort(Kind.MISMATCH,
                     f"rank {d.rank} aborted inside {op}{then} (gloo's abort when a peer sends more than the rank's own tensor holds: "
                     "the ranks' tensors there differ).",
                     [d.rank], "the others' calls there are not recorded: the rank that aborted is the likelier odd one",
                     RootCause.of([d.rank], Named.CALL, likely=True, how="%dist_collectives shows the others'"))
    return Verdict(state, Kind.DIED, summary, [d.rank], victims, sites,
                   Evidence("every rank of the cell stays alive", {d.rank: d.detail}), Certainty.CERTAIN if certain else Certainty.LIKELY,
                   "" if certain else "it died inside a collective: a mismatch there may have caused it", positions=rec.positions,
                   rule="died", beyond_report=False, root=RootCause.of([d.rank]))


def _out_of_step_before(rec: Records, rank: int) -> tuple[Kind, str] | None:
    """The dead rank alone made fewer (or more) collectives than the others in a cell before the
    one judged, which ended on every rank: its records of that cell are whole, so the count apart
    is a fact, and every later collective of it pairs with another call."""
    if rec.log is None or rec.judged_cell is None:
        return None
    for div in rec.log.divergences():
        cells = {issued_in(e) for e in div.by_rank.values() if e is not None}
        if div.kind is not Differs.MISSING or not cells or any(c is None or c >= rec.judged_cell for c in cells) or div.odd() != [rank]:
            continue
        present = sorted(r for r, e in div.by_rank.items() if e is not None)
        entry = next(e for e in div.by_rank.values() if e is not None)
        where = f"{describe(entry)} #{div.seq} on {div.label or f'group {div.group}'} ({issued_words(entry)})"
        if div.by_rank.get(rank) is None:
            return Kind.CALL_MISSING, f"it did not make {where}, which {format_ranks(present)} made"
        return Kind.CALL_EXTRA, f"it made {where}, which {format_ranks([r for r in div.by_rank if r != rank])} did not"
    return None


def victim_of_mismatch(rec: Records) -> Verdict | None:
    """The first rank to die did so inside a collective whose ranks disagree, and was not the odd
    one: the odd rank is the cause."""
    if not rec.dead:
        return None
    dead = rec.dead[0]
    found = victim(dead, rec.log, rec.judged_cell)
    if found is None:
        return None
    said, odd, root = found
    return Verdict(VerdictState.HANG if rec.waiting else VerdictState.FAILED, Kind.MISMATCH, said, odd, [dead.rank], [],
                   Evidence("the n-th call on a group is the same on every member", {dead.rank: dead.detail}), Certainty.LIKELY,
                   "by majority at the collective it died in", positions=rec.positions, rule="victim", root=root)


class Victim(NamedTuple):
    """A rank that died of another's mismatch: the words, the odd ranks, and the root cause they are."""

    said: str
    odd: list[int]
    root: RootCause

    def text(self) -> str:
        return headline(self.said, self.root)


def victim(dead: Position, log: CollectiveReport | None, cell: int | None = None) -> Victim | None:
    """A rank that died inside a collective whose ranks disagree (gloo aborts the rank that
    receives data it can't fit): the odd rank of the mismatch is the root cause, not the victim.
    ``cell``: only a collective of that cell (an older divergence is another story)."""
    if log is None:
        return None
    for div in log.divergences():
        if cell is not None and not any(e is not None and issued_in(e) == cell for e in div.by_rank.values()):
            continue
        present = [e for e in div.by_rank.values() if e is not None]
        # An abort with its own call there unrecorded (it died before pushing it): the calls that
        # were recorded must say who is odd by a clear majority, without it.
        unseen = (dead.rank in div.by_rank and div.by_rank[dead.rank] is None and "SIGABRT" in dead.detail
                  and log.log.died_during.get(dead.rank) is not None)
        blind = unseen and not log.log.died_in.get(dead.rank)  # not even its stack at death says where it was
        entry = div.by_rank.get(dead.rank) or (present[0] if (log.log.died_in.get(dead.rank) or unseen) and dead.rank in div.by_rank else None)
        if div.kind is Differs.MISSING or entry is None:
            continue
        odd = div.odd()
        if blind and (len(odd) != 1 or len(present) - len(odd) < 2):
            continue
        by_size = div.kind is Differs.SHAPE and "SIGABRT" in dead.detail and len(odd) > 1 and set(odd) >= {r for r, e in div.by_rank.items() if e}
        if by_size:
            # No majority: gloo aborts the rank that receives more than its own tensor holds, so the
            # dead rank sided with the smaller tensors and the larger ones are the odd out.
            odd = _larger(div)
        if not odd or dead.rank in odd or len(odd) == len(div.by_rank):
            continue
        what = {Differs.OP: "different ops", Differs.SHAPE: "shape mismatch", Differs.DTYPE: "dtype mismatch",
                Differs.ARGS: "argument mismatch"}[div.kind]
        detail = "; ".join(f"{format_ranks(rs)} {d}" for rs, d in group_by((r, describe(e)) for r, e in sorted(div.by_rank.items()) if e))
        if div.peers:
            detail += f" (where {div.witnesses()})"
        where = f"{entry['op']} #{div.seq} on {div.label or f'group {div.group}'}"
        said = (f"rank {dead.rank} died ({dead.detail}) while the calls recorded at {where} disagree, a {what}: {detail}." if blind else
                f"rank {dead.rank} died ({dead.detail}) inside {where}, a {what}: {detail}.")
        then = f"rank {dead.rank} is a victim (gloo aborts a rank that receives data its own tensor can't hold)"
        if by_size:
            root = RootCause.of(odd, likely=True, then=then,
                                note="with the larger tensor that the rank could not receive (no majority among the calls recorded)")
        elif blind:
            root = RootCause.of(odd, likely=True, then=then,
                                note=f"the odd one out of the calls recorded (rank {dead.rank}'s own is not: it aborted before it was pushed)")
        else:
            root = RootCause.of(odd, note=f"the odd one{'s' if len(odd) > 1 else ''} out", then=then)
        return Victim(said, odd, root)
    return None


def _larger(div: Divergence) -> list[int]:
    """The ranks whose tensors at a shape divergence hold the most elements; none when they tie."""
    sizes = {r: sum(math.prod(s) for s in e.get("sizes") or []) for r, e in div.by_rank.items() if e}
    top = max(sizes.values(), default=0)
    big = sorted(r for r, n in sizes.items() if n == top)
    return big if len(big) < len(sizes) else []


def raised(rec: Records) -> Verdict | None:
    failed = rec.raised
    if not failed:
        return None
    waiting = rec.waiting
    f = failed[0]
    ranks = [p.rank for p in failed if p.detail.split(":", 1)[0] == f.detail.split(":", 1)[0]] or [f.rank]
    who = format_ranks(ranks)
    sites = [Site(p.line_cell if p.line_cell is not None else rec.judged_cell, p.line, p.func, p.code, "the error")
             for p in failed if p.rank == ranks[0] and p.line]
    if waiting:
        w = format_ranks([p.rank for p in waiting])
        summary = (f"{who} raised {f.detail} and left the cell; {w} {ranks_verb(waiting, 'wait')} in {waiting[0].op} for "
                   f"{'it' if len(ranks) == 1 else 'them'}.")
        state = VerdictState.HANG
    elif rec.running:
        return None
    else:
        summary = end_sentence(f"{who} raised {f.detail}")
        state = VerdictState.FAILED
    if _BAD_ARGUMENTS.search(f.detail):
        # torch.distributed refused the rank's own call (a tensor of another size or dtype than the
        # group's): a mismatch, found by the rank itself before anything was sent.
        return Verdict(state, Kind.MISMATCH, end_sentence(f"{who} called a collective with tensors the group does not match: {f.detail}"),
                       ranks, [p.rank for p in waiting], sites,
                       Evidence("the n-th call on a group is the same on every member", {p.rank: p.detail for p in failed}),
                       Certainty.LIKELY, "torch refused the call on that rank; its inputs differ from the group's", positions=rec.positions,
                       rule="raised", beyond_report=False, root=RootCause.of(ranks))
    # Raised by the cell's own code (a raise, an assert) it is the cause; raised inside torch (DDP
    # finding a reduction it never made, say), it may be the consequence of an earlier difference.
    own = any(word in f.code for word in ("raise ", "assert ")) or (f.code.strip().startswith(("raise", "assert")))
    return Verdict(state, Kind.RAISED, summary, ranks, [p.rank for p in waiting], sites,
                   Evidence("no rank leaves the cell while the others need it", {p.rank: p.detail for p in failed}),
                   Certainty.CERTAIN if own else Certainty.LIKELY,
                   "" if own else "raised inside a library: it may follow from an earlier difference between the ranks",
                   positions=rec.positions, rule="raised", beyond_report=False, root=RootCause.of(ranks, Named.ERROR))
