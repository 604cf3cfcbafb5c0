"""Collective entries compared across ranks: how an entry reads (``all_reduce #3 on group 0 [2]
f32``), what must match at one position of a group's sequence, and :class:`CollectiveReport`,
the ranks' sequences side by side with the first place where they disagree."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable

from distnb.analysis.agreement.collective_table import NOT_RECORDED, GroupTable, Row
from distnb.analysis.agreement.entry_words import describe, line_words
from distnb.analysis.agreement.evidence import ROOT_INPUT_ONLY, CollectiveEvidence, odd_ones, op_stem, peer_words, same_op
from distnb.analysis.agreement.groups import short_name
from distnb.analysis.agreement.pairing import cross_cell, cross_group
from distnb.cell_names import cell_name, cell_tag
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import P2P_OPS, CollectiveEntry, called_in, issued_in

__all__ = ["CollectiveReport", "Divergence", "Differs", "RECORDER_NAMES", "issued_words"]

#: distnb's recorder names (worker/torch_hooks/flight_recorder.py) in words.
RECORDER_NAMES = {"nccl": "NCCL", "fr": "gloo (and other non-NCCL)"}


def issued_words(entry: CollectiveEntry) -> str:
    """``issued in cell 3, line 4`` (the call's own cell and line when the call log matched it;
    ``issued in cell 3, line 4, in step() (cell 1 line 7)`` for a function an earlier cell
    defined), ``issued in cell 3``, or ``issued outside distnb's cells``."""
    cell = issued_in(entry)
    if cell is None:
        return "issued outside distnb's cells"
    return f"issued in {cell_name(cell)}{line_words(entry)}"


#: Ops whose input exists on the root alone: the recorder shows the scattered tensor on the source
#: rank and nothing on the others — by design, not a mismatch (DTensor's distribute_tensor scatters).


def _sizes(e: CollectiveEntry) -> Any:
    return None if e["op"] in ROOT_INPUT_ONLY else e.get("sizes")


def _dtypes(e: CollectiveEntry) -> Any:
    return None if e["op"] in ROOT_INPUT_ONLY else e.get("dtypes")


class Differs(str, Enum):
    """What differs at one position of a group's sequence: a member never made the call there, or
    the calls differ in their op, shape, dtype or arguments (the first of these, in this order)."""

    MISSING = "missing"
    OP = "op"
    SHAPE = "shape"
    DTYPE = "dtype"
    ARGS = "args"


#: What must match at one position of a group's sequence, in the order a difference is named.
_KINDS: dict[Differs, Callable[[CollectiveEntry], Any]] = {
    # One collective under the names its recorders give it: the call log's function
    # (all_gather_single, for an entry still in flight) and the recorder's (all_gather).
    Differs.OP: lambda e: op_stem(e["op"]),
    Differs.SHAPE: _sizes,
    Differs.DTYPE: _dtypes,
    Differs.ARGS: lambda e: e.get("args"),
}


def _first_difference(entries: list[CollectiveEntry]) -> Differs | None:
    """The first kind (op, shape, dtype, args) in which these entries of one position differ;
    arguments only among the entries the call log annotated."""
    views = [(e["op"], e.get("sizes"), e.get("dtypes"), e.get("args")) for e in entries]
    if views.count(views[0]) == len(views) if views else True:
        return None  # the common case, compared in C: a thousand ranks agree
    # Ops are compared by their stem below (_KINDS): names that differ only in form are no difference.
    return next((k for k, key in _KINDS.items() if len({repr(key(e)) for e in entries if k is not Differs.ARGS or "args" in e}) > 1), None)


@dataclass
class Divergence:
    group: str
    seq: int
    kind: Differs
    by_rank: dict[int, CollectiveEntry | None]
    # The same position (sequence number) on the other groups of the same role (a mesh's other dp
    # groups): ranks in step there are witnesses, so a 1-against-1 split inside one group still has
    # a majority across the mesh.
    peers: dict[int, CollectiveEntry] = field(default_factory=dict)
    label: str = ""  # the group as the user built it (``dp (ranks 0,2)``)

    def odd(self) -> list[int]:
        """The ranks of this group that stand out by majority (every rank involved on a tie),
        counting the same-role witnesses in the majority but never among the odd ones."""
        if self.kind is Differs.MISSING:
            return odd_ones({r: e is None for r, e in self.by_rank.items()})
        key = _KINDS[self.kind]
        mine = {r: key(e) for r, e in self.by_rank.items() if e is not None}
        odd = odd_ones(mine | {r: key(e) for r, e in self.peers.items() if r not in mine})
        inside = [r for r in odd if r in mine]
        return inside if inside and len(inside) < len(self.by_rank) else odd_ones(mine)

    def witnesses(self) -> str:
        """``ranks 1,3 had all_gather [36] f32 at #1 on the other dp groups``: the wider majority."""
        same = group_by((r, describe(e)) for r, e in sorted(self.peers.items()))
        return "; ".join(f"{format_ranks(rs)} had {d}" for rs, d in same) + f" at #{self.seq} on the other groups of this role"

    def text(self, members: list[int]) -> str:
        present = {r: e for r, e in self.by_rank.items() if e is not None}
        absent = [r for r, e in self.by_rank.items() if e is None]
        where = f"collective #{self.seq} on {self.label or f'group {self.group} ({format_ranks(members)})'}"
        if self.kind is Differs.MISSING:
            sample = next(iter(present.values()))
            return f"{where}: {format_ranks(present)} entered {sample['op']}, {format_ranks(absent)} never did"
        groups = group_by((r, describe(e)) for r, e in sorted(present.items()))
        what = {Differs.OP: "different ops", Differs.SHAPE: "different shapes", Differs.DTYPE: "different dtypes",
                Differs.ARGS: "different arguments"}[self.kind]
        odd = self.odd()
        witnesses = f"; {self.witnesses()}" if odd and len(odd) < len(self.by_rank) and self.peers else ""
        blame = f" (the odd one{'s' if len(odd) > 1 else ''} out: {format_ranks(odd)}{witnesses})" if odd and len(odd) < len(self.by_rank) else ""
        died = f"; {format_ranks(absent)} died inside it before {'its' if len(absent) == 1 else 'their'} entry reached distnb" if absent else ""
        return f"{where}: {what}: " + "; ".join(f"{format_ranks(rs)} {d}" for rs, d in groups) + blame + died


@dataclass
class CollectiveReport:
    log: CollectiveEvidence
    ranks: list[int]
    last: int | None = None
    page: int | None = None  # a page of the per-rank view (many ranks); None: the summary

    def __post_init__(self) -> None:
        self._shown = set(self.ranks)
        self._members: dict[str, list[int]] = {}
        self._names: list[str] | None = None
        self._divergences: list[Divergence] | None = None
        self._tables: dict[Any, GroupTable] = {}

    def members(self, group: str) -> list[int]:
        members = self._members.get(group)
        if members is None:  # asked once per rank by the analyses: worked out once per group
            members = self._members[group] = [r for r in self.log.groups.get(group, self.ranks) if r in self._shown] or self.ranks
        return members

    def group_names(self) -> list[str]:
        if self._names is None:
            seen = {g for r in self.ranks for g, held in self.log.groups_of(r).items() if held}
            self._names = sorted(seen, key=lambda g: (g != "0", g))
        return self._names

    def divergences(self) -> list[Divergence]:
        """First disagreement per group (at most one each), earliest first."""
        if self._divergences is None:  # the text and the HTML both ask; the log does not change under a report
            self._divergences = self._find_divergences()
        return list(self._divergences)

    def _find_divergences(self) -> list[Divergence]:
        out = []
        for group in self.group_names():
            members = self.members(group)
            seqs = {r: self.log.seqs(r, group) for r in members}
            top = max((max(s) for s in seqs.values() if s), default=0)
            low = min((min(s) for s in seqs.values() if s), default=1)
            for seq in range(low, top + 1):
                at = {r: seqs[r].get(seq) for r in members}
                if all(e is None for e in at.values()):
                    continue
                present = [e for e in at.values() if e is not None]
                # A rank that died inside this op before its entry reached distnb did enter it.
                inside = {r for r, e in at.items() if e is None and any(same_op(self.log.died_in.get(r), x["op"]) for x in present)
                          and (not seqs[r] or max(seqs[r]) < seq)}
                # A rank that died in this cell with its later entries unpushed: whether it got
                # here is not known (its last entry may be long past), so it is no vote either way.
                lost = {r for r, e in at.items() if e is None and r not in inside and (not seqs[r] or max(seqs[r]) < seq)
                        and (cell := self.log.died_during.get(r)) is not None and any(issued_in(x) == cell for x in present)}
                if any(e is None and r not in inside and r not in lost for r, e in at.items()):
                    # A rank whose log starts later (ring buffer), or goes on past this position (a
                    # group's numbers run without gaps: a dead rank's unpushed entry), is not "missing" it.
                    if all(e is not None or r in inside or (seqs[r] and max(seqs[r]) > seq) for r, e in at.items()):
                        continue
                    out.append(Divergence(group, seq, Differs.MISSING, at, label=self._div_label(group)))
                    break
                kind = _first_difference(present)
                if kind:
                    out.append(Divergence(group, seq, kind, at, self.same_role(group, seq), self._div_label(group)))
                    break
                if inside:
                    # A rank died inside it and the survivors agree among themselves: the same
                    # position on the other groups of this role says whether they were the odd ones.
                    peers = self.same_role(group, seq)
                    kind = _first_difference(present + list(peers.values()))
                    if kind:
                        div = Divergence(group, seq, kind, at, peers, self._div_label(group))
                        if div.odd():
                            out.append(div)
                            break
        out.sort(key=self._when)
        return out

    def paired(self, first: Divergence) -> str:
        """The first divergence as one group can't see it, in words: in the cell where it began,
        a collective over another group than its peers', or one that paired calls of different cells."""
        cells = {c for e in first.by_rank.values() if e is not None and (c := issued_in(e)) is not None}
        for cell in sorted(cells):
            crossed = cross_group(self.log, self.ranks, cell)
            if crossed is not None:
                return crossed.text()
            across = cross_cell(self.log, self.ranks, cell)
            if across is not None and across.group == first.group and across.seq <= first.seq:
                return across.text()
        return ""

    def label(self, group: str) -> str:
        """The group as the user built it, with the members this report shows."""
        info = self.log.group(group)
        return info.label() if info.ranks or info.world else f"{info.label()} ({format_ranks(self.members(group))})"

    def _div_label(self, group: str) -> str:
        """A divergence names the default group with its members (``group 0 (ranks 0-2)``)."""
        return "" if self.log.group(group).world else self.label(group)

    def same_role(self, group: str, seq: int) -> dict[int, CollectiveEntry]:
        """Each rank's entry at ``seq`` on the other groups of ``group``'s role (same mesh
        dimension, same new_group site), for a majority wider than one group."""
        role = self.log.group(group).role()
        if role.startswith("group "):  # a group known by its name alone has no peers
            return {}
        out: dict[int, CollectiveEntry] = {}
        for other in self.group_names():
            if other == group or self.log.group(other).role() != role:
                continue
            for r in self.members(other):
                e = self.log.seqs(r, other).get(seq)
                if e is not None:
                    out[r] = e
        return out

    def _when(self, d: Divergence) -> float:
        """When a divergence began, on the controller's clock (ranks' clocks may differ)."""
        return min((self.log.local_time(r, e) for r, e in d.by_rank.items() if e), default=0.0)

    def counts(self, group: str) -> dict[int, int]:
        return {r: len(self.log.seqs(r, group)) for r in self.members(group)}

    def text(self) -> str:
        if self.log.unavailable:
            return f"collective log unavailable: {self.log.unavailable}"
        groups = self.group_names()
        p2p = self._p2p_lines()
        gaps = [f"(not in this log: {RECORDER_NAMES.get(rec, rec)} collectives — {why})" for rec, why in sorted(self.log.missing.items())]
        if not groups and not p2p:
            return "\n".join([f"no collective recorded on {format_ranks(self.ranks)} yet.", *gaps])
        divs = {d.group: d for d in self.divergences()}
        tables = [self.table(group, divs.get(group)) for group in groups]
        lines = [self.headline()]
        for table in tables:
            lines.extend(table.lines(self.page))
        lines.extend(p2p)
        lines.extend(gaps)
        lost = any(e is NOT_RECORDED for table in tables for row in table.rows for e in row.by_rank.values())
        lines.append("(⏳ entered, not completed · ⏸ queued on the GPU, not started · cN: issued in cell N · — never entered · ✗ the odd one out"
                     + (" · not recorded: made, but its record died with the rank or was let go)" if lost else ")"))
        return "\n".join(lines)

    def headline(self) -> str:
        """The first line: where the sequences first disagree, or that they agree."""
        divs = self.divergences()
        first = min(divs, key=self._when) if divs else None
        paired = self.paired(first) if first is not None else None
        if paired:
            return f"first divergence: {paired}"
        if first is not None:
            return f"first divergence: {first.text(self.members(first.group))}"
        return f"the collective sequences of {format_ranks(self.ranks)} agree."

    def table(self, group: str, div: Divergence | None = None) -> GroupTable:
        """The group's shown positions, rank by rank, with its first divergence marked (built once
        per report: the text and the HTML both read it)."""
        key = (group, None if div is None else (div.group, div.seq, div.kind))
        if key not in self._tables:
            self._tables[key] = self._table(group, div)
        return self._tables[key]

    def _table(self, group: str, div: Divergence | None) -> GroupTable:
        members = self.members(group)
        seqs = {r: self.log.seqs(r, group) for r in members}
        all_seqs = sorted({s for m in seqs.values() for s in m})
        shown = all_seqs[-self.last:] if self.last else all_seqs
        info = self.log.group(group)
        title = f"group {short_name(group)}, {format_ranks(members)}" if info.world else f"{self.label(group)}, torch's group {short_name(group)}"
        odd = div.odd() if div is not None and div.kind is not Differs.MISSING else []
        top = {r: max(by_seq) if by_seq else 0 for r, by_seq in seqs.items()}
        rows = [Row(seq, {r: seqs[r].get(seq, NOT_RECORDED if seq < top[r] else None) for r in members}, div is not None and div.seq == seq, odd)
                for seq in shown]
        return GroupTable(title, members, {r: len(seqs[r]) for r in members}, rows, len(all_seqs) - len(shown))

    def paged(self, page: int) -> CollectiveReport:
        """The same report with every group shown rank by rank, ``page`` (from 1) of its members
        at a time (:data:`~distnb.analysis.agreement.collective_table.PAGE_RANKS` per page)."""
        if page < 1:
            raise ValueError(f"pages count from 1, not {page}; e.g. --page 2.")
        return replace(self, page=page)

    def _p2p_lines(self) -> list[str]:
        """The ranks' recent send/recv calls (gloo's recorder does not see them; distnb does)."""
        keep = self.last or 8
        rows = []
        for r in self.ranks:
            calls = self.log.p2p(r)[-keep:]
            if calls:
                rows.append(f"  rank {r}: " + ", ".join(
                    f"{c['op']} {'→' if P2P_OPS[c['op']] == 'send' else '←'} "
                    f"{peer_words(c)}{' ⏳' if c['end'] is None else ''}" + (f" {cell_tag(cell)}" if (cell := called_in(c)) is not None else "")
                    for c in calls))
        return ["── point-to-point (last calls per rank)", *rows] if rows else []

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())
