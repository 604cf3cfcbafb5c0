"""Desync caught at the end of a cell, before anything hangs.

When a cell has finished on all its ranks, each rank's count of collectives per group and of
groups created (``worker/torch_hooks/group_state.py``, a few µs per cell) are compared. A rank-conditional
collective that every rank got past — NCCL returns once the kernel is queued, gloo's
``async_op=True`` too — leaves one rank ahead on that group: the next synchronisation on it will
hang, or pair the wrong collectives. The check is pure data; :func:`mismatch_text` puts it in
words with the entries involved, from the collective log.
"""

from __future__ import annotations

from dataclasses import dataclass

from distnb.analysis.agreement.cell_source import because
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.evidence import CollectiveEvidence
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import CollectiveEntry, SyncState

__all__ = ["CountMismatch", "carry_over", "count_mismatches", "mismatch_text"]


@dataclass(frozen=True)
class CountMismatch:
    """Ranks that disagree on how many collectives they issued on ``group`` (``group`` None:
    on how many process groups they created)."""

    group: str | None
    counts: dict[int, int]
    since: int | None = None  # the cell where this very mismatch was first seen
    repeated: bool = False  # already reported in full at cell ``since``
    # As many collectives on the group, but other ones (an op argument, a shape, a dtype): the
    # ranks' digests of the cell's calls differ, grouped here rank → group of equal digests.
    calls: dict[int, int] | None = None

    @property
    def ahead(self) -> list[int]:
        top = max(self.counts.values())
        return sorted(r for r, n in self.counts.items() if n == top)

    @property
    def behind(self) -> list[int]:
        top = max(self.counts.values())
        return sorted(r for r, n in self.counts.items() if n < top)

    @property
    def low(self) -> int:
        return min(self.counts.values())

    @property
    def extra(self) -> int:
        return max(self.counts.values()) - self.low


def count_mismatches(syncs: dict[int, SyncState | None]) -> list[CountMismatch]:
    """Every group on which the ranks that know it issued different numbers of collectives,
    and a difference in groups created; ``syncs`` holds each rank's end-of-cell state."""
    known = {r: s for r, s in syncs.items() if s}
    if len(known) < 2:
        return []
    out = []
    groups = sorted({g for s in known.values() for g in s.get("seqs", {})}, key=lambda g: (g != "0", g))
    for g in groups:
        counts = {r: int(s["seqs"][g]) for r, s in known.items() if g in s.get("seqs", {})}
        if len(counts) > 1 and len(set(counts.values())) > 1:
            out.append(CountMismatch(g, counts))
    for g in groups:
        counts = {r: int(s["seqs"][g]) for r, s in known.items() if g in s.get("seqs", {})}
        digests = {r: s["digests"][g] for r, s in known.items() if g in s.get("digests", {}) and r in counts}
        if len(set(counts.values())) == 1 and len(digests) > 1 and len(set(digests.values())) > 1:
            kinds = {d: i for i, d in enumerate(dict.fromkeys(digests.values()))}
            out.append(CountMismatch(g, counts, calls={r: kinds[d] for r, d in digests.items()}))
    created = {r: int(s["created"]) for r, s in known.items() if s.get("created") is not None}
    if len(set(created.values())) > 1:
        out.append(CountMismatch(None, created))
    return out


def carry_over(found: list[CountMismatch], before: list[CountMismatch], cell: int) -> list[CountMismatch]:
    """``found`` with ``since`` set on the mismatches already reported (same group, same counts):
    a desync left standing is named once in full, then in a short line per cell."""
    seen = {(m.group, tuple(sorted(m.counts.items()))): m for m in before if m.calls is None}
    out = []
    for m in found:
        if m.calls is not None:  # this cell's calls: said in full, never carried over
            out.append(CountMismatch(m.group, m.counts, cell, calls=m.calls))
            continue
        old = seen.get((m.group, tuple(sorted(m.counts.items()))))
        out.append(CountMismatch(m.group, m.counts, cell) if old is None else CountMismatch(m.group, m.counts, old.since, repeated=True))
    return out


def _extra(log: CollectiveEvidence, m: CountMismatch) -> list[CollectiveEntry]:
    """The collectives the (first) rank ahead issued beyond the others, as far as the log holds them."""
    return sorted((e for e in log.entries.get(m.ahead[0], {}).values() if e["group"] == m.group and not e["p2p"] and e["seq"] > m.low),
                  key=lambda e: e["seq"])


def _entries(log: CollectiveEvidence, m: CountMismatch) -> list[str]:
    """The extra collectives of the rank(s) ahead, in words, as far as the log holds them."""
    out = []
    for e in _extra(log, m)[:3]:
        where = f"{cell_name(e['call_cell'])} line {e['line']}" if e.get("line") and e.get("call_cell") is not None else \
            cell_name(e['cell']) if e.get("cell") is not None else ""
        out.append(f"{describe(e)} #{e['seq']}" + (f" ({where})" if where else "") + ("" if e["done"] else ", not completed"))
    return out


def mismatch_text(m: CountMismatch, log: CollectiveEvidence | None = None, sources: dict[int, str] | None = None) -> str:
    """Who is ahead, by what, what happens next, and the evidence the cells' code (``sources``,
    by cell number) gives for why."""
    ahead, behind = format_ranks(m.ahead), format_ranks(m.behind)
    name = (log.group(m.group).label() if log is not None else f"group {m.group}") if m.group is not None else ""
    if m.calls is not None:
        sides = " against ".join(format_ranks(rs) for rs, _ in group_by(sorted(m.calls.items())))
        return (f"{sides} made as many collectives on {name} but not the same ones (another reduce op, root, shape or dtype): "
                "nothing hung, and the results differ. %dist_collectives shows each rank's calls.")
    verb = "has" if len(m.ahead) == 1 else "have"
    if m.repeated:
        unit = ("collective" if m.group is not None else "process group created") + ("s" if m.extra > 1 else "")
        on = f" on {name}" if m.group is not None else ""
        return (f"{ahead} {'is' if len(m.ahead) == 1 else 'are'} still {m.extra} {unit} ahead of {behind}{on} "
                f"(since {cell_name(m.since)}; see %dist_collectives).")
    if m.group is None:
        return (f"{ahead} {verb} created {m.extra} process group{'s' if m.extra > 1 else ''} more than {behind}: every rank must "
                "call new_group the same times in the same order (even ranks outside the group), or the next new_group hangs "
                "or pairs the wrong groups.")
    what = _entries(log, m) if log is not None else []
    issued = f"issued {m.extra} collective{'s' if m.extra > 1 else ''} on {name}"
    if what:
        issued += f" ({'; '.join(what)}{' …' if m.extra > len(what) else ''})"
    uneven = len(set(m.counts.values())) > 2
    counts = " (counts: " + ", ".join(f"rank {r} {n}" for r, n in sorted(m.counts.items())) + ")" if uneven else ""
    why = _why(log, m, sources or {}) if log is not None else ""
    return (f"{ahead} {issued} that {behind} did not{counts}: the next synchronisation on {name} will hang, or pair "
            f"the wrong collectives. {why or 'Where: %dist_collectives shows each rank’s calls.'}")


def _why(log: CollectiveEvidence, m: CountMismatch, sources: dict[int, str]) -> str:
    """The evidence the cell's code gives for the first extra call (its line, the ``if`` or loop
    around it, a pending ``async_op=True`` work), as a sentence; "" when there is none."""
    first = next((e for e in _extra(log, m) if e.get("line") and e.get("call_cell") is not None), None)
    cell, line = (first.get("call_cell"), first.get("line")) if first is not None else (None, None)
    if first is None or cell is None or not line:
        return ""
    code = sources.get(cell)
    out = []
    text = code.splitlines()[line - 1] if code and line <= len(code.splitlines()) else ""
    if not first["done"] and "async_op=True" in text.replace(" ", ""):
        out.append("it was issued with async_op=True and its work is still pending (never waited on)")
    cause = because(code, line, cell)
    if cause:
        out.append(cause)
    return ("Evidence: " + "; ".join(out) + ".") if out else ""
