"""The first place where a group's members stop agreeing, and who stands out there.

A group pairs its members' calls by sequence number: at every position each member must make a
call, and the same one (op, shapes, dtypes, reduce op, root). :func:`disagreements` walks each
group the cell used, position by position, and stops at the first where the members that
*definitively* made no call (they finished the cell, raised, died, or wait elsewhere) stand beside
members that did, or where the calls differ. A member still computing may yet arrive: it is no
evidence either way.

Who is wrong is judged by majority, counting beside the group's members the ranks in step on the
other groups of the same role (a mesh's other ``tp`` groups made their ``#k`` call too), so a
one-against-one split inside a group of two still has a majority across the mesh.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from distnb.analysis.agreement.calls import Call, call_of, death_call
from distnb.analysis.agreement.evidence import CollectiveEvidence, groups_in_cell, odd_ones, op_stem
from distnb.ranks import group_by
from distnb.wire.record_types import issued_in

__all__ = ["Disagreement", "Presence", "disagreements"]


class Presence(str, Enum):
    """Where a rank stands with respect to a position of a group it belongs to."""

    GONE = "gone"  # it left the cell (finished, raised, died, stranded, not part of it): it will make no more calls
    ELSEWHERE = "elsewhere"  # it waits in another collective or transfer: it is not coming now
    MOVING = "moving"  # it runs code: it may yet come


@dataclass
class Disagreement:
    """The first position of ``group`` where its members disagree."""

    group: str
    seq: int
    by_rank: dict[int, Call | None]  # each member's call there (None: it made none, definitively)
    witnesses: dict[int, Call | None]  # ranks in step on the other groups of this role
    odd: list[int]  # the members that stand out by majority (every member involved on a tie)
    tie: bool  # no majority: ``odd`` is every member involved
    fields: tuple[str, ...]  # what differs: presence, op, shape, dtype, and the argument names
    inside: list[int] = field(default_factory=list)  # members that died inside this call before its entry came

    @property
    def presence(self) -> bool:
        return "presence" in self.fields

    @property
    def t(self) -> float:
        """When the first call at this position was issued (controller's clock)."""
        return min((c.t for c in self.by_rank.values() if c is not None), default=float("inf"))

    def majority(self) -> list[int]:
        return sorted(r for r in self.by_rank if r not in self.odd)

    def voters(self) -> dict[int, Call | None]:
        return {**self.witnesses, **self.by_rank}


def _value(call: Call | None) -> Any:
    return ("out",) if call is None else ("in", call.signature())


def _fields(calls: list[Call]) -> tuple[str, ...]:
    out = []
    if len({op_stem(c.op) for c in calls}) > 1:
        out.append("op")
    if len({repr(c.sizes) for c in calls if c.sizes is not None}) > 1:
        out.append("shape")
    if len({repr(c.dtypes) for c in calls if c.dtypes is not None}) > 1:
        out.append("dtype")
    keys = sorted({k for c in calls for k, _ in c.args})
    out.extend(k for k in keys if len({dict(c.args).get(k) for c in calls}) > 1)
    return tuple(out)


def _split_pairs(at: dict[int, Call | None], members: list[int]) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs of an all_to_all whose split sizes disagree: what ``i`` says
    it sends to ``j`` against what ``j`` says it receives from ``i``."""
    order = sorted(members)
    splits = {r: c.splits for r, c in at.items() if c is not None and c.splits is not None}
    if len(splits) < 2:
        return []
    out = []
    for i, (ins, _) in splits.items():
        for j, (_, outs) in splits.items():
            if i == j or not ins or not outs or len(ins) != len(order) or len(outs) != len(order):
                continue
            if ins[order.index(j)] != outs[order.index(i)]:
                out.append((i, j))
    return out


def _sites(calls: list[Call], cell: int) -> tuple[str, ...]:
    """``("call site",)`` when calls of this cell at one position come from different lines:
    the same signature, but not the same call (a rank that skipped one call met the next)."""
    lines = {c.site() for c in calls if c.cell == cell and c.line is not None}
    unknown = any(c.line is None for c in calls)
    return ("call site",) if len(lines) > 1 or (lines and unknown and any(c.sizes is None for c in calls)) else ()


def disagreements(log: CollectiveEvidence, cell: int, where: dict[int, Presence], waiting_in: dict[int, str | None] | None = None,
                  ) -> list[Disagreement]:
    """The first disagreement of each group the cell issued collectives on, earliest first.

    ``where`` says, for each rank of the cell, whether it left it, waits elsewhere or still runs
    code (ranks missing from it are not part of the cell and are left out of every comparison);
    ``waiting_in``, the group a waiting rank's collective is on, when known (a call the recorder
    has no entry for yet is in that group, not absent from it), None when only its stack shows the
    call (it may be this group's)."""
    out = []
    for g in sorted(groups_in_cell(log, where, cell)):
        members = [r for r in log.groups.get(g, []) if r in where] or [r for r in where if log.seqs(r, g)]
        found = _first(log, g, members, cell, where, waiting_in or {})
        if found is not None:
            out.append(found)
    out.sort(key=lambda d: d.t)
    return out


def _first(log: CollectiveEvidence, g: str, members: list[int], cell: int, where: dict[int, Presence],
           waiting_in: dict[int, str | None]) -> Disagreement | None:
    seqs = {r: log.seqs(r, g) for r in members}
    first = min((s for m in seqs.values() for s, e in m.items() if issued_in(e) == cell), default=None)
    if len(members) < 2 or first is None:
        return None
    top = max(max(m) for m in seqs.values() if m)
    keys = [log.keys(r, g) for r in members]
    for k in range(first, top + 1):
        if _alike([by_seq.get(k) for by_seq in keys]):
            continue
        at: dict[int, Call | None] = {}
        inside = []
        for r in members:
            e = seqs[r].get(k)
            if e is not None:
                at[r] = call_of(log, r, e)
                continue
            if seqs[r] and min(seqs[r]) > k:
                continue  # its log starts later (the recorder let old entries go): no evidence
            last = max(seqs[r], default=0)
            if last > k:
                continue  # it got past this position (a group's numbers run without gaps): its entry died with it
            died = log.died_in.get(r)
            if died is not None and last < k:
                # Died inside a collective before its entry reached distnb: the one after its last
                # entry (positions beyond it are unknown). The same call as the others' unless its
                # stack at death puts it at another line than theirs.
                if last == k - 1:
                    mine = death_call(log, r, g, k)
                    lines = {e.get("line") for m in seqs.values() if (e := m.get(k)) and e.get("call_cell") is not None}
                    if mine is not None and mine.line is not None and _site_of_another_role(log, g, mine.site_cell, mine.line):
                        at[r] = None  # it died in a call the others made on a group of another role: before this one
                    elif mine is not None and mine.line is not None and lines and mine.line not in lines:
                        at[r] = mine
                    else:
                        inside.append(r)
                continue
            if where.get(r, Presence.MOVING) == Presence.MOVING and last < k:
                continue  # still running code: it may yet make this call
            if r in waiting_in and waiting_in[r] in (g, None) and last < k:
                continue  # in a call (on this group, or on one not known yet) that the recorder has not shown yet
            if where.get(r) == Presence.ELSEWHERE and last < k - 1:
                continue  # waits in an earlier call elsewhere: behind, not absent
            at[r] = None
        present = [c for c in at.values() if c is not None]
        if not present:
            continue
        absent = [r for r, c in at.items() if c is None]
        fields = ("presence",) if absent else _fields(present) or _sites(present, cell)
        if not fields:
            broken = _split_pairs(at, members)
            if broken:
                # Sender and receiver disagree on how much goes between them: the rank in most of
                # the broken pairs is the one whose split sizes are off.
                count = Counter(r for pair in broken for r in pair)
                top = max(count.values())
                odd = sorted(r for r, n in count.items() if n == top)
                return Disagreement(g, k, at, {}, odd, len(odd) > 1, ("split sizes",), inside)
            continue
        witnesses = _witnesses(log, g, k, set(members), where)
        odd, tie = _odd(at, witnesses)
        return Disagreement(g, k, at, witnesses, odd, tie, fields, inside)
    return None


def _alike(keys: list[tuple[Any, ...] | None]) -> bool:
    """Whether every member has an entry at a position and their keys (what a :class:`Call` is
    made of: ``entry_key``) are equal — most positions of a healthy group, whose calls then agree
    without building one (at thousands of ranks, building them was most of a diagnosis; the keys
    are counted at C speed). All-to-all's split sizes are checked pairwise, never here."""
    first = keys[0]
    return first is not None and not first[-1] and keys.count(first) == len(keys)


def _site_of_another_role(log: CollectiveEvidence, g: str, cell: int | None, line: int) -> bool:
    """Whether some rank's recorded call at (cell, line) went to a group of another role than
    ``g``'s (a dead rank's stack at that line then put it in that call, not in one on ``g``)."""
    role = log.group(g).role()
    return any(e.get("call_cell") == cell and e.get("line") == line and log.group(str(e["group"])).role() != role
               for by_rank in log.entries.values() for e in by_rank.values() if not e.get("p2p"))


def _witnesses(log: CollectiveEvidence, g: str, k: int, members: set[int], where: dict[int, Presence]) -> dict[int, Call | None]:
    """Each rank's call at position ``k`` on its own group of ``g``'s role (the other groups of a
    mesh dimension, or of one ``new_group`` site); None where it definitively made none."""
    role = log.group(g).role()
    if role.startswith("group "):  # a group known by its name alone has no peers
        return {}
    out: dict[int, Call | None] = {}
    for other, ranks in log.groups.items():
        if other == g or log.group(other).role() != role:
            continue
        for r in ranks:
            if r in members or r not in where:
                continue
            e = log.seqs(r, other).get(k)
            if e is not None:
                out[r] = call_of(log, r, e)
            elif where[r] == Presence.GONE and log.seqs(r, other) and max(log.seqs(r, other)) < k:
                out[r] = None
    return out


def _odd(at: dict[int, Call | None], witnesses: dict[int, Call | None]) -> tuple[list[int], bool]:
    """The members that stand out by majority over members and witnesses; on a tie, every member
    whose value is not shared by all (and ``tie``)."""
    values = {r: _value(c) for r, c in {**witnesses, **at}.items()}
    odd = [r for r in odd_ones(values) if r in at]
    groups = group_by((r, v) for r, v in sorted(values.items()))
    sizes = sorted((len(rs) for rs, _ in groups), reverse=True)
    tie = len(sizes) > 1 and sizes[0] == sizes[1]
    if odd and len(odd) < len(at) and not tie:
        return sorted(odd), False
    # Members alone (the witnesses may be too few to break the tie).
    own = odd_ones({r: _value(c) for r, c in at.items()})
    own_groups = group_by((r, _value(c)) for r, c in sorted(at.items()))
    own_sizes = sorted((len(rs) for rs, _ in own_groups), reverse=True)
    if own and len(own) < len(at) and not (len(own_sizes) > 1 and own_sizes[0] == own_sizes[1]):
        return sorted(own), False
    return sorted(at), True
