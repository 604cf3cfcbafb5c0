"""A verdict in words: its headline (the rule's sentence, then the root cause) and its text (the
headline, then one line per place the ranks are in). The one module that writes a root cause
(:class:`~distnb.analysis.root_cause.RootCause`) as words; the cell's report, the live
view, ``CellFailed``, ``%dist_status`` and attached or loaded jobs all show these words."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distnb.analysis.root_cause import Named, RootCause
from distnb.ranks import format_ranks, group_by

if TYPE_CHECKING:
    from distnb.analysis.verdicts.verdict import Blame, Verdict

__all__ = ["MAX_PLACES", "blame_words", "headline", "root_cause_words", "verdict_text"]

#: Places (ranks grouped by where they are) a verdict lists before "… and N more".
MAX_PLACES = 8


def root_cause_words(root: RootCause) -> str:
    """``Root cause: likely rank 2's call (%dist_collectives shows the others').``"""
    ranks = format_ranks(list(root.ranks))
    named = {Named.RANKS: ranks, Named.CALL: f"{ranks}'s call", Named.ERROR: f"the error on {ranks}",
             Named.PENDING_CALL: f"{ranks}'s call from an earlier cell, left pending there"}[root.names]
    return ("Root cause: " + ("likely " if root.likely else "") + named + (f" ({root.how})" if root.how else "")
            + (f", {root.note}" if root.note else "") + (f"; {root.then}" if root.then else "") + ".")


def blame_words(blame: Blame) -> str:
    """``root cause: likely rank 2``: whom a failed cell's one line (``CellFailed``) names."""
    return f"root cause: {'likely ' if blame.likely else ''}{format_ranks(list(blame.ranks))}"


def headline(said: str, root: RootCause | None) -> str:
    """The rule's sentence, then its root cause."""
    return f"{said} {root_cause_words(root)}" if root is not None else said


def verdict_text(verdict: Verdict) -> str:
    """The headline, then one line per place the ranks are in (ranks in the same place share a
    line whatever their waits), the culprits' places first above :data:`MAX_PLACES`."""
    lines = [f"[distnb] {verdict.summary}"]
    by_rank = {p.rank: p for p in verdict.positions}
    places = group_by((p.rank, p.where([])) for p in verdict.positions)
    left: list[tuple[list[int], Any]] = []
    if len(places) > MAX_PLACES:
        culprits = set(verdict.culprits)
        keep = sorted(places, key=lambda g: (not set(g[0]) & culprits, -len(g[0])))[:MAX_PLACES]
        left = [g for g in places if g not in keep]
        places = [g for g in places if g in keep]
    for ranks, _ in places:
        durations = [since for r in ranks if (since := by_rank[r].since) is not None]
        lines.append(f"  {format_ranks(ranks)}: {by_rank[ranks[0]].where(durations)}")
    if left:
        lines.append(f"  … and {sum(len(rs) for rs, _ in left)} more ranks in {len(left)} other places (each: .positions)")
    lines.extend(verdict.details)
    return "\n".join(lines)
