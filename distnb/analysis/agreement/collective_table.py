"""One group's collective sequences laid out for reading: a column per rank up to a handful of
ranks, the majority's sequence with the ranks that differ (and how) above it.

A column per rank is the clearest view of 4 ranks and no view at all of 1,024 (a 40,000-character
line per collective). Above :data:`~distnb.ranks.SUMMARY_ABOVE` members each position reads as
what most ranks did there, then the ranks that did otherwise — never dropped, named; the column
view stays available page by page (:meth:`GroupTable.page`). Both text and HTML
(``display/html.py``) render from the same :class:`GroupTable`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from distnb._text import fit
from distnb.analysis.agreement.entry_words import describe, state_mark
from distnb.cell_names import cell_tag
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by
from distnb.wire.record_types import CollectiveEntry

__all__ = ["COLUMN_MAX", "GroupTable", "Row", "cell_text", "MAX_MINORITIES", "NOT_RECORDED", "PAGE_RANKS"]

#: Ranks per page of the per-rank view: a page as wide as the view of 8 ranks is today.
PAGE_RANKS = 8
#: Kinds of difference named at one position before "… and N more" (each names its ranks).
MAX_MINORITIES = 4
#: The widest column of the per-rank view: an entry with long arguments is cut at a word, before
#: its cell's tag (the HTML table shows it whole).
COLUMN_MAX = 40


#: A position a rank got past (a group's numbers run without gaps: it holds a later one) whose entry
#: distnb does not hold — it died with the rank before it was sent, or the log let it go: made,
#: not "never entered".
NOT_RECORDED: CollectiveEntry = {"id": -1, "op": "not recorded", "done": True}


def cell_text(e: CollectiveEntry | None, odd: bool = False, width: int | None = None) -> str:
    """``all_reduce [2] f32 ⏳ In[3]``: one rank's entry at one position, as the tables show it;
    within ``width`` characters, the words cut before the cell's tag, which stays whole."""
    if e is None:
        return "—"
    text = ("✗ " if odd else "") + describe(e) + state_mark(e)
    tag = f" {cell_tag(e['cell'])}" if e.get("cell") is not None else ""
    return (text if width is None else fit(text, max(1, width - len(tag)))) + tag


def _key(e: CollectiveEntry | None) -> Any:
    """What makes two entries read the same in a table, cheaper than writing them out: ranks
    are grouped by it first, and each group's entry is described once."""
    if e is None:
        return None
    return (e["op"], str(e.get("sizes")), str(e.get("dtypes")), str(e.get("args")) if e.get("args") else "",
            e["done"], bool(e.get("queued")), e.get("cell"))


def _view(e: CollectiveEntry | None) -> tuple[Any, ...] | None:
    """The fields a table shows, as a tuple compared in C (lists inside compare element-wise)."""
    if e is None:
        return None
    get = e.get  # bound once: this runs for every rank at every position shown
    return (e["op"], get("sizes"), get("dtypes"), e["done"], get("cell"), get("queued"), get("args"))


def _by_entry(by_rank: dict[int, CollectiveEntry | None]) -> list[list[int]]:
    """The ranks grouped by entries that read the same, in order of first appearance. Compared
    with each kind seen so far (C-speed equality: a position has one kind or a few); past a few
    kinds, by a written-out key instead."""
    views = list(map(_view, by_rank.values()))
    if views and views.count(views[0]) == len(views):
        return [list(by_rank)]  # the common case, decided in C: every rank did the same
    reps: list[tuple[tuple[Any, ...] | None, list[int]]] = []
    keyed: dict[Any, list[int]] = {}
    out: list[list[int]] = []
    for (r, e), view in zip(by_rank.items(), views):
        for rep, ranks in reps:
            if view == rep:
                ranks.append(r)
                break
        else:
            if len(reps) < 8:
                reps.append((view, [r]))
                out.append(reps[-1][1])
                continue
            key = _key(e)
            if key not in keyed:
                keyed[key] = []
                out.append(keyed[key])
            keyed[key].append(r)
    return out


@dataclass
class Row:
    """One position of the group's sequence: who did what there."""

    seq: int
    by_rank: dict[int, CollectiveEntry | None]
    divergence: bool = False  # the first divergence of the group is here
    odd: list[int] = field(default_factory=list)  # the odd ranks of that divergence

    @functools.cached_property
    def _sides(self) -> list[tuple[list[int], str]]:
        groups = _by_entry(self.by_rank)
        groups.sort(key=lambda g: -len(g))
        out = []
        for ranks in groups:
            flag = self.divergence and bool(set(ranks) & set(self.odd))
            out.append((ranks, cell_text(self.by_rank[ranks[0]], flag)))
        return out

    def sides(self) -> list[tuple[list[int], str]]:
        """The ranks grouped by what they did here, the most common first; each with its words."""
        return self._sides

    @property
    def open(self) -> bool:
        """Some rank entered it and has not completed it (each side's entries read alike)."""
        firsts = [self.by_rank[ranks[0]] for ranks, _ in self.sides()]
        return any(e is not None and not e["done"] for e in firsts)


@dataclass
class GroupTable:
    """A group's positions (the shown ones), with its members and their counts."""

    title: str
    members: list[int]
    counts: dict[int, int]
    rows: list[Row]
    hidden: int = 0  # older positions left out (``last``)

    @property
    def summarised(self) -> bool:
        return len(self.members) > SUMMARY_ABOVE

    def count_words(self) -> str:
        """``rank 0 51, rank 1 51 collectives`` (a few ranks) or ``51 collectives on ranks
        0-16,18-1023; 50 on rank 17`` (many)."""
        if not self.summarised:
            return ", ".join(f"rank {r} {self.counts[r]}" for r in self.members) + " collectives"
        groups = sorted(group_by((r, self.counts[r]) for r in self.members), key=lambda g: -len(g[0]))
        head = f"{groups[0][1]} collectives on {format_ranks(groups[0][0])}"
        return head + "".join(f"; {n} on {format_ranks(rs)}" for rs, n in groups[1:])

    def header(self) -> str:
        shown = f" (last {len(self.rows)} shown)" if self.hidden else ""
        return f"── {self.title}: {self.count_words()}{shown}"

    def page(self, number: int) -> list[int]:
        """The members on page ``number`` (from 1) of the per-rank view."""
        return self.members[(number - 1) * PAGE_RANKS: number * PAGE_RANKS]

    @property
    def pages(self) -> int:
        return max(1, -(-len(self.members) // PAGE_RANKS))

    def column_lines(self, columns: list[int]) -> list[str]:
        """A column per rank (``columns``), a line per position."""
        cells = [[cell_text(row.by_rank.get(r), row.divergence and r in row.odd) for r in columns] for row in self.rows]
        # Wide enough for the entries shown (arguments make them longer), within reason.
        width = min(COLUMN_MAX, max([24, *(len(c) + 2 for line in cells for c in line)]))
        lines = ["    #  " + "".join(f"rank {r}".ljust(width) for r in columns)]
        for row, line in zip(self.rows, cells):
            mark = "  ◀ first divergence" if row.divergence else ""
            fitted = [c if len(c) < width else cell_text(row.by_rank.get(r), row.divergence and r in row.odd, width - 1)
                      for r, c in zip(columns, line)]
            lines.append(f"  {row.seq:>3}  " + "".join(c.ljust(width) for c in fitted) + mark)
        return lines

    def summary_lines(self) -> list[str]:
        """A line per position: what most ranks did, then the ranks that did otherwise."""
        lines = [f"    #  most ranks ({len(self.members)} in the group) · the ranks that differ"]
        for row in self.rows:
            sides = row.sides()
            (most, words), others = sides[0], sides[1:]
            who = "" if not others else f" ({format_ranks(most)})"
            rest = "; ".join(f"{format_ranks(rs)}: {w}" for rs, w in others[:MAX_MINORITIES])
            if len(others) > MAX_MINORITIES:
                left = sum(len(rs) for rs, _ in others[MAX_MINORITIES:])
                rest += f"; … {left} more ranks in {len(others) - MAX_MINORITIES} other ways (--per-rank shows each)"
            mark = "  ◀ first divergence" if row.divergence else ""
            lines.append(f"  {row.seq:>3}  {words}{who}" + (f" · {rest}" if rest else "") + mark)
        return lines

    def lines(self, page: int | None = None) -> list[str]:
        """The section: the summary above a handful of members unless a ``page`` of the
        per-rank view is asked for."""
        if page is None and self.summarised:
            return [self.header(), *self.summary_lines()]
        if page is None:
            return [self.header(), *self.column_lines(self.members)]
        columns = self.page(page)
        if not columns:
            return [self.header(), f"  (no page {page}: {self.pages} pages of {PAGE_RANKS} ranks)"]
        note = f"  (page {page} of {self.pages}: {format_ranks(columns)}" + (f"; --page {page + 1} for the next)" if page < self.pages else ")")
        return [self.header(), note, *self.column_lines(columns)]
