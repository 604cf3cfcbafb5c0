"""The ranks' next collectives side by side, before any is issued, and whether they will match.

A rank paused before a collective (pdb's ``nc``, the console's hold; worker/torch_hooks/call_log.py) has told
what it is about to call: op, group, the arguments that must agree, input shapes and dtypes, the
cell line. Ranks already waiting inside a collective say the same from their log. Compared group by
group, a mismatch is named before anything hangs: "rank 1 is about to call barrier where ranks
0,2,3 call all_reduce on group 0: continuing would hang" — as is a group that needs a rank that will
never come (it finished the cell, left it, or runs elsewhere first), and a send without its receive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import odd_ones
from distnb.analysis.agreement.groups import GroupInfo
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import P2P_OPS

__all__ = ["NextCall", "NextReport", "compare_next"]

#: Up to this many ranks the table has a row per rank; above, rows of ranks alike, the majority first.
PER_RANK_UP_TO = 8
#: Ops whose input shapes and dtypes must be the same on every rank of the group.
SAME_SHAPE = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "gather", "scatter"}


@dataclass(frozen=True)
class NextCall:
    """One rank's next collective: paused before it (nothing issued), or ``inside`` it already."""

    rank: int
    op: str
    group: str  # torch's name of the group
    label: str  # the group as the user built it: ``group 0``, ``tp (ranks 0,1)``
    role: str  # what ranks in step share while their groups differ (a mesh dimension …)
    members: tuple[int, ...] | None = None
    args: tuple[tuple[str, Any], ...] | None = ()  # src, dst, the reduce op …, sorted (None: not known)
    sizes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    place: str = ""  # ``cell 7 line 5 (dist.all_reduce(t))``
    inside: bool = False

    @classmethod
    def stopped_before(cls, rank: int, before: dict[str, Any], group: GroupInfo, place: str) -> NextCall:
        """A rank paused before a collective, from what call_log's wrapper told of it (op, args,
        sizes, dtypes) and its group as the caller names it."""
        return cls(rank, str(before.get("op")), group.name, group.label(), group.role(), group.ranks,
                   tuple(sorted((before.get("args") or {}).items())), tuple(tuple(s) for s in before.get("sizes", [])),
                   tuple(before.get("dtypes", [])), place)

    def what(self) -> str:
        """``all_reduce [4] f32``, ``broadcast [2] f32 src=1``."""
        return describe({"op": self.op, "sizes": [list(s) for s in self.sizes], "dtypes": list(self.dtypes), "args": dict(self.args or ())})

    def key(self, shapes: bool, args: bool = True) -> tuple[Any, ...]:
        """What must agree across the group's ranks (shapes and arguments only where every side
        knows them: a rank waiting inside a collective may not)."""
        return (self.op,) + ((self.args,) if args else ()) + ((self.sizes, self.dtypes) if shapes and self.op in SAME_SHAPE else ())


@dataclass
class NextReport:
    """The table and the verdict: ``problems`` (each a sentence ending in what continuing does),
    ``notes`` (what is not known yet), ``ok`` when nothing will go wrong that can be seen."""

    rows: list[tuple[list[int], str]]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    headline: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        width = max((len(format_ranks(rs)) for rs, _ in self.rows), default=0)
        lines = ["[distnb] next collectives (ranks paused before theirs have issued nothing yet):"]
        lines += [f"  {format_ranks(rs):<{width}}  {text}" for rs, text in self.rows]
        lines += [f"[distnb] {p}" for p in self.problems] or ([f"[distnb] {self.headline}"] if self.headline else [])
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


def _is(ranks: list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _verb(ranks: list[int], inside: bool) -> str:
    """``call``, ``calls``, ``wait in``, ``waits in``."""
    one = len(ranks) == 1
    return ("waits in" if one else "wait in") if inside else ("calls" if one else "call")


def _row(c: NextCall, by_role: bool) -> str:
    where = f"  at {c.place}" if c.place else ""
    return f"{c.what()} on {c.role if by_role else c.label}{' (already waiting in it)' if c.inside else ''}{where}"


def _rows(calls: dict[int, NextCall], gone: dict[int, str], unknown: dict[int, str]) -> list[tuple[list[int], str]]:
    texts = {**{r: w for r, w in unknown.items()}, **{r: w for r, w in gone.items()}}
    many = len(calls) + len(texts) > PER_RANK_UP_TO
    texts.update({r: _row(c, many) for r, c in calls.items()})
    if not many:
        return [([r], texts[r]) for r in sorted(texts)]
    return sorted(group_by(sorted(texts.items())), key=lambda g: -len(g[0]))  # the majority leads


def _difference(a: NextCall, b: NextCall) -> str:
    """What continuing does when these two sides of one group disagree."""
    if a.op != b.op:
        return "continuing would hang"
    if a.args != b.args and a.args is not None and b.args is not None:
        names = sorted({k for k, _ in set(a.args) ^ set(b.args)})
        return f"they disagree on {', '.join(names)}: continuing would hang or give wrong results"
    return f"their input {'shapes' if a.sizes != b.sizes else 'dtypes'} differ: continuing would fail or hang"


def _within(label: str, cs: list[NextCall]) -> list[str]:
    """A group's ranks that will not match: the odd ones against the majority, by what they call."""
    shapes, args = not any(c.inside for c in cs), all(c.args is not None for c in cs)
    odd = set(odd_ones({c.rank: c.key(shapes, args) for c in cs}))
    if not odd:
        return []
    normal = [c for c in cs if c.rank not in odd]
    sides = group_by((c.rank, c.key(shapes, args)) for c in cs if c.rank in odd)
    by_rank = {c.rank: c for c in cs}
    if not normal:  # a tie: nothing says which side is wrong
        keys = {c.rank: c.key(shapes, args) for c in cs}
        parts = [f"{format_ranks(rs)} {_verb(rs, by_rank[rs[0]].inside)} {by_rank[rs[0]].what()}" for rs, _ in group_by(keys.items())]
        other = next(c for c in cs if keys[c.rank] != keys[cs[0].rank])
        return [f"on {label}, {'; '.join(parts)}: {_difference(cs[0], other)}."]
    verb = _verb([c.rank for c in normal], all(c.inside for c in normal))
    out = []
    for rs, _ in sides:
        mine = by_rank[rs[0]]
        doing = f"{'waits' if len(rs) == 1 else 'wait'} in" if mine.inside else f"{_is(rs)} about to call"
        out.append(f"{format_ranks(rs)} {doing} {mine.what()} where {format_ranks([c.rank for c in normal])} {verb} "
                   f"{normal[0].what()} on {label}: {_difference(mine, normal[0])}.")
    return out


def _missing(cs: list[NextCall], calls: dict[int, NextCall], gone: dict[int, str], unknown: dict[int, str],
             seen: set[frozenset[str]], released: set[int]) -> tuple[list[str], list[str]]:
    """The group's members that are not about to join it: those that never will (distnb stops the
    ranks that need one it released), those first elsewhere (each waiting for the other: a hang),
    those not known yet."""
    first = cs[0]
    if first.members is None:
        return [], []
    here = [c.rank for c in cs]
    verb = "wait" if all(c.inside for c in cs) else "would wait"
    problems, notes = [], []
    absent = [m for m in first.members if m not in here]
    for rs, (words, let_go) in group_by((m, (gone[m], m in released)) for m in absent if m in gone):
        if let_go:
            problems.append(f"{format_ranks(here)} need {format_ranks(rs)} on {first.label}, which {words}: rather than let "
                            f"{'it' if len(here) == 1 else 'them'} wait, distnb ends the cell there (interrupted, nothing issued).")
        else:
            problems.append(f"{format_ranks(here)} {verb} on {first.label} for {format_ranks(rs)}, which {words}: continuing would hang.")
    for m in (m for m in absent if m in calls and calls[m].op not in P2P_OPS):  # (a send or receive: _p2p)
        other = calls[m]
        pair = frozenset({first.group, other.group})
        if other.members is not None and not set(other.members) & set(here):
            notes.append(f"{format_ranks(here)} {verb} on {first.label} until {format_ranks([m])} has done {other.op} on {other.label}.")
        elif pair not in seen:
            seen.add(pair)
            problems.append(f"{format_ranks([m])} {'waits in' if other.inside else 'is about to call'} {other.what()} on {other.label} "
                            f"where {format_ranks(here)} {_verb(here, first.inside)} {first.what()} on {first.label}: "
                            "each waits for the other, continuing would hang.")
    for rs, words in group_by((m, unknown[m]) for m in absent if m in unknown):
        notes.append(f"{format_ranks(rs)} {words}: whether {'it joins' if len(rs) == 1 else 'they join'} {first.op} on {first.label} is not known yet.")
    return problems, notes


def _roles(cs: list[NextCall]) -> list[str]:
    """Ranks in step calling on groups of another role than most (a mesh dimension mixed up): each
    group may agree within itself and the ranks still wait on each other across groups."""
    odd = odd_ones({c.rank: (c.op, c.role) for c in cs})
    if not odd or len(odd) == len(cs):  # all alike, or a tie (pipeline stages may differ by design)
        return []
    normal = [c for c in cs if c.rank not in odd]
    by_rank = {c.rank: c for c in cs}
    return [f"{format_ranks(rs)} {_is(rs)} about to call {by_rank[rs[0]].what()} on {by_rank[rs[0]].label} where "
            f"{format_ranks([c.rank for c in normal])} {_verb([c.rank for c in normal], False)} {normal[0].what()} on {normal[0].role}: "
            "the ranks disagree on the group "
            "(a mesh dimension mixed up?), so continuing likely hangs."
            for rs, _ in group_by((r, (by_rank[r].op, by_rank[r].role)) for r in odd)]


def _p2p(c: NextCall, calls: dict[int, NextCall], gone: dict[int, str]) -> str:
    """A send or receive whose partner is about to do something else, or will never come."""
    side = P2P_OPS[c.op]
    peer = dict(c.args or ()).get("dst" if side == "send" else "src")
    if peer is None:
        return ""
    doing = f"{format_ranks([c.rank])} {'waits to' if c.inside else 'is about to'} {'send to' if side == 'send' else 'receive from'} rank {peer}"
    if peer in gone:
        return f"{doing}, which {gone[peer]}: continuing would hang."
    other = calls.get(peer)
    if other is None:
        return ""
    theirs = dict(other.args or ()).get("src" if side == "send" else "dst")
    if other.op in P2P_OPS and P2P_OPS[other.op] != side and theirs in (c.rank, None):
        return ""
    return f"{doing}, which {'waits in' if other.inside else 'is about to call'} {other.what()} on {other.label}: they do not pair, continuing would hang."


def compare_next(calls: dict[int, NextCall], gone: dict[int, str] | None = None, unknown: dict[int, str] | None = None,
            released: set[int] | None = None) -> NextReport:
    """``calls``: each rank's next collective; ``gone``: ranks that will call none in this cell, in
    words (``finished the cell without another collective``); ``unknown``: ranks whose next one is
    not known yet (``is still running``); ``released``: the gone ranks distnb does not let the
    others wait for (they left from their debugger: services/collective_stops.py)."""
    gone, unknown, released = gone or {}, unknown or {}, released or set()
    report = NextReport(_rows(calls, gone, unknown))
    groups: dict[str, list[NextCall]] = {}
    for c in sorted(calls.values(), key=lambda c: c.rank):
        if c.op not in P2P_OPS:
            groups.setdefault(c.group, []).append(c)
    seen: set[frozenset[str]] = set()
    for cs in groups.values():
        report.problems += _within(cs[0].label, cs)
        problems, notes = _missing(cs, calls, gone, unknown, seen, released)
        report.problems += problems
        report.notes += notes
    report.problems += [p for c in calls.values() if c.op in P2P_OPS and (p := _p2p(c, calls, gone))]
    if not report.problems:
        report.problems += _roles([c for c in calls.values() if c.op not in P2P_OPS])
    if calls and not report.problems:
        kinds = {(c.op, c.role, c.args) for c in calls.values()}
        if len(kinds) == 1:
            c = next(iter(calls.values()))
            report.headline = (f"they match: {format_ranks(calls)} {_is(list(calls))} about to call {c.what()} on "
                               f"{c.label if len({x.group for x in calls.values()}) == 1 else c.role}. "
                               "c all issues it everywhere; nc stops again before the next one.")
        else:
            report.headline = "each group's ranks agree on what they call next: nothing here waits for a rank that won't come."
    return report
