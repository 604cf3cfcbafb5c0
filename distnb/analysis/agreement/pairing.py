"""Which calls a collective really paired, when ranks' sequences are in step by group but not by
what the user meant.

Two mistakes are invisible one group at a time:

* **Another group than its peers** (:func:`cross_group`). On a (dp, tp) mesh every rank issues the
  same calls in the same order, each over its own group of a dimension. A rank that all_gathers
  over ``dp`` where its peers use ``tp`` leaves every group looking merely short of a member; the
  ranks' *n*-th calls of the cell, compared by role (the mesh dimension, the ``new_group`` site),
  say who went where.
* **A call paired across cells** (:func:`cross_cell`). A group pairs calls by sequence number, not
  by meaning: rank 0's ``all_reduce(async_op=True)`` left pending in one cell is matched by the
  others' next call on that group, in a later cell, whatever its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from distnb.analysis.agreement.entry_words import describe, line_words
from distnb.analysis.agreement.evidence import CollectiveEvidence, groups_in_cell, odd_ones, op_stem, unrecorded_calls
from distnb.analysis.render import headline
from distnb.analysis.root_cause import Named, RootCause
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import CollectiveEntry, issued_in

__all__ = ["CrossCell", "CrossGroup", "cross_cell", "cross_group"]


def _site(e: CollectiveEntry) -> str:
    cell = issued_in(e)
    return "outside distnb's cells" if cell is None else f"{cell_name(cell)}{line_words(e)}"


@dataclass
class CrossGroup:
    """The ranks' ``index``-th collectives of ``cell`` went to groups of different roles."""

    cell: int
    index: int  # 1-based position among the cell's collectives, every group counted
    by_rank: dict[int, CollectiveEntry]  # each rank's entry at that position
    roles: dict[int, str]
    labels: dict[int, str]  # each rank's group there, as the user built it
    odd: list[int]
    waits_for: dict[int, list[int]]  # a rank whose call is open → the members of its group not in it

    def _named(self) -> bool:
        """Whether a majority names the odd ranks (else: a tie between roles)."""
        return len(self.odd) < len(self.by_rank) and any(r not in self.odd for r in self.by_rank)

    def root(self) -> RootCause | None:
        return RootCause.of(self.odd, note="on the wrong group") if self._named() else None

    def text(self) -> str:
        return headline(self.said(), self.root())

    def said(self) -> str:
        """What the calls show, without the root cause."""
        sides = group_by((r, (self.roles[r], op_stem(self.by_rank[r]["op"]))) for r in sorted(self.by_rank))
        majority = [rs for rs, _ in sides if not set(rs) & set(self.odd)]
        sample = next(iter(self.by_rank.values()))
        where = f"the {_ordinal(self.index)} collective of {cell_name(self.cell)}" + (f" (line {sample['line']})" if sample.get("line") else "")
        odd_words = "; ".join(f"{format_ranks(rs)} called {self.by_rank[rs[0]]['op']} over {self.labels[rs[0]]}"
                              for rs, _ in sides if set(rs) <= set(self.odd))
        if majority and self._named():
            maj = majority[0]
            op = self.by_rank[maj[0]]["op"]
            same_op = all(op_stem(self.by_rank[r]["op"]) == op_stem(op) for r in self.by_rank)
            used = f"used {self.roles[maj[0]]}" if same_op else f"called {op} over {self.roles[maj[0]]}"
            head = f"collective on another group: {odd_words} where {format_ranks(maj)} {used} ({where})."
        else:
            head = ("ranks disagree on the group: " + "; ".join(
                f"{format_ranks(rs)} called {self.by_rank[rs[0]]['op']} over {self.labels[rs[0]]}" for rs, _ in sides)
                + f" ({where}); no majority to tell which side is wrong.")
        done = sorted(r for r, e in self.by_rank.items() if e["done"] and r not in self.waits_for)
        after = []
        if done:
            after.append(f"{format_ranks(done)} completed {'its' if len(done) == 1 else 'theirs'} (the members of "
                         f"{'its' if len(done) == 1 else 'their'} group happened to match)")
        for rs, need in group_by((r, tuple(w)) for r, w in sorted(self.waits_for.items())):
            after.append(f"{format_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} on {self.labels[rs[0]]} for {format_ranks(list(need))}")
        tail = "; ".join(after)
        return head + (f" {tail[0].upper()}{tail[1:]}." if tail else "")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _in_cell(log: CollectiveEvidence, rank: int, cell: int) -> list[CollectiveEntry]:
    """The rank's collectives of ``cell`` in issue order: its recorder's entries, then the call it
    is in when the recorder has no entry for it yet (NCCL connecting a group's communicator)."""
    entries = sorted((e for e in log.entries.get(rank, {}).values() if not e.get("p2p") and issued_in(e) == cell), key=lambda e: e["id"])
    return entries + [{**e, "sizes": [], "dtypes": []} for e in unrecorded_calls(log, rank, cell, entries)]


def cross_group(log: CollectiveEvidence, ranks: list[int], cell: int, waiting: frozenset[int] = frozenset()) -> CrossGroup | None:
    """The first position of ``cell`` where the ranks' collectives go to groups of different roles
    (with the same calls before it on every rank: the ranks were in step until then). ``waiting``:
    ranks whose stack shows them still in a collective — their entry there is open whatever the
    recorder says (NCCL's can read "completed" for a call still connecting its communicator)."""
    if len(groups_in_cell(log, ranks, cell, open_calls=True)) < 2:
        return None  # one group (or none) in the cell: no call of it can have gone elsewhere
    seqs = {r: _in_cell(log, r, cell) for r in ranks}
    depth = max((len(s) for s in seqs.values()), default=0)
    for k in range(depth):
        at = {r: s[k] for r, s in seqs.items() if len(s) > k}
        if len(at) < 2:
            return None
        names = {e["group"] for e in at.values()}
        roles = {r: log.group(e["group"]).role() for r, e in at.items()} if len(names) > 1 else {}
        if len(set(roles.values())) <= 1:
            if len({e["op"] for e in at.values()}) > 1 and len({op_stem(e["op"]) for e in at.values()}) > 1:
                return None  # the same groups, other ops: the group's own divergence says it
            continue
        labels = {r: log.group(e["group"]).label() for r, e in at.items()}
        odd = odd_ones({r: (roles[r], op_stem(e["op"])) for r, e in at.items()})
        waits = {}
        for r, e in at.items():
            if not e["done"] or r in waiting:
                members = log.groups.get(e["group"], [])
                waits[r] = [m for m in members if m != r and not (m in at and at[m]["group"] == e["group"])]
        return CrossGroup(cell, k + 1, at, roles, labels, odd, waits)
    return None


@dataclass
class CrossCell:
    """One collective of a group paired calls that different cells issued."""

    group: str
    label: str
    seq: int
    by_rank: dict[int, CollectiveEntry]

    @property
    def odd(self) -> list[int]:
        """The ranks whose call came from another cell than most ranks' (every rank on a tie)."""
        return odd_ones({r: issued_in(e) for r, e in self.by_rank.items()})

    @property
    def blamed(self) -> list[int]:
        """The odd ranks when their call is older than every other rank's: left pending in an
        earlier cell, it is the root cause; else none is named."""
        odd = self.odd
        later = [r for r in self.by_rank if r not in odd] if len(odd) < len(self.by_rank) else []
        if later and all((issued_in(self.by_rank[r]) or 0) < min(issued_in(self.by_rank[x]) or 0 for x in later) for r in odd):
            return odd
        return []

    def root(self) -> RootCause | None:
        if not self.blamed:
            return None
        return RootCause.of(self.odd, Named.PENDING_CALL, how="likely an async_op=True work never waited on, or a collective only some ranks "
                            "reached", then="the next call on this group paired with it")

    def text(self) -> str:
        return headline(self.said(), self.root())

    def said(self) -> str:
        """What the paired calls show, without the root cause."""
        sides = group_by((r, (issued_in(e), describe(e))) for r, e in sorted(self.by_rank.items()))
        calls = " with ".join(f"{format_ranks(rs)}'s {describe(self.by_rank[rs[0]])} from {_site(self.by_rank[rs[0]])}" for rs, _ in sides)
        shapes = len({describe(e) for e in self.by_rank.values()}) > 1
        odd = self.odd
        later = [r for r in self.by_rank if r not in odd] if len(odd) < len(self.by_rank) else []
        done = [r for r in later if self.by_rank[r]["done"]]
        if done:
            effect = f"the results on {format_ranks(done)} are wrong (they were reduced with another cell's tensor)"
        elif later:
            effect = f"{format_ranks(later)} wait in it, and their results will be wrong if it completes"
        else:
            effect = "the results of every rank in it are suspect"
        what = "different shapes, " if shapes else ""
        return f"collective #{self.seq} on {self.label} paired calls of different cells: {calls} ({what}{effect})."


def cross_cell(log: CollectiveEvidence, ranks: list[int], cell: int | None = None) -> CrossCell | None:
    """The latest collective (of ``cell``, when given) whose ranks' calls came from different cells."""
    found: CrossCell | None = None
    names = {g for r in ranks for g, held in log.groups_of(r).items() if held}
    shown = set(ranks)
    for group in sorted(names):
        members = [r for r in log.groups.get(group, ranks) if r in shown] or ranks
        # Latest positions first, each gathered only when reached: the walk stops at the first
        # one most ranks' records hold, and gathering every position of every rank first cost
        # more than the rest of the verdict at thousands of ranks.
        per_rank = {r: m for r in members if (m := log.seqs(r, group))}
        marks = [[e.get("cell") for e in m.values()] for m in per_rank.values()]
        one = marks[0][0] if marks else None
        if one is not None and all(ms.count(one) == len(ms) for ms in marks):
            continue  # one cell issued every call of every rank on this group: none paired across cells
        for seq in sorted({s for m in per_rank.values() for s in m}, reverse=True):
            at = {r: m[seq] for r, m in per_rank.items() if seq in m}
            marked = [e.get("cell") for e in at.values()]
            if marked[0] is not None and marked.count(marked[0]) == len(marked):
                continue  # one cell issued every call there (counted at C speed: most positions, at any size)
            cells = {issued_in(e) for e in at.values()}
            if len(at) < 2 or None in cells or len(cells) < 2:
                continue
            if cell is not None and cell not in cells:
                continue
            if found is None or _latest(log, at) > _latest(log, found.by_rank):
                found = CrossCell(group, log.group(group).label(), seq, at)
            break
    return found


def _latest(log: CollectiveEvidence, at: dict[int, CollectiveEntry]) -> float:
    return max(log.local_time(r, e) for r, e in at.items())
