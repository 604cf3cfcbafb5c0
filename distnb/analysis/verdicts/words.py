"""Phrases every verdict's words share: a call, its site, a group, a verb for one rank or many."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sized

from distnb.analysis.agreement.calls import Call
from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.cell_names import cell_name

if TYPE_CHECKING:
    from distnb.analysis.verdicts.records import Records

__all__ = ["call_words", "group_words", "ranks_verb", "site_of_call", "site_words"]


def call_words(call: Call | None) -> str:
    """``all_reduce #4 [2632] f32`` (its position on its group when known)."""
    if call is None:
        return "a call"
    words = call.words()
    seq = f" #{call.seq}" if call.seq is not None else ""
    op, _, rest = words.partition(" ")
    return f"{op}{seq}" + (f" {rest}" if rest else "")


def site_of_call(call: Call | None, rec: Records) -> str:
    """`` at cell 5 line 7`` (`` in step() (cell 5 line 7)``), or `` (issued from C++: DDP,
    FSDP, …)`` for a call with no Python site."""
    if call is None:
        return ""
    if call.line is None:
        return " (issued inside torch, e.g. by DDP or FSDP)"
    return site_words(call.site_cell, call.line, call.func, rec)


def site_words(cell: int | None, line: int, func: str, rec: Records) -> str:
    """`` at cell line 7`` (the judged cell), `` at cell 5 line 7``, `` in step() (cell 5 line 7)``."""
    if func not in ("", "<module>"):
        return f" in {func}() ({cell_name(cell)} line {line})"
    # The judged cell's own lines read as the stack's do ("at cell line 4"); an earlier cell's name it.
    return f" at cell line {line}" if cell == rec.judged_cell else f" at {cell_name(cell)} line {line}"


def group_words(log: CollectiveReport, group: str) -> str:
    """``group 0``, ``dp (ranks 1,3)``: the group as the user built it."""
    return log.label(group)


def ranks_verb(ranks: Sized, verb: str) -> str:
    """``waits``/``wait``: the verb for one rank or several."""
    return f"{verb}s" if len(ranks) == 1 else verb
