"""Whom a verdict's root cause names, as data: the ranks, what of theirs is the cause (the ranks
themselves, their call, their error), how sure the records make it and how they single them out.
:mod:`distnb.analysis.render` writes it as words; nothing else does, and nothing reads
the words back (``Verdict.culprits`` and :class:`~distnb.analysis.verdicts.verdict.Blame` carry
the ranks wherever they are needed again)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

__all__ = ["Named", "RootCause"]


class Named(str, Enum):
    """What of the ranks the root cause is."""

    RANKS = "ranks"  # the ranks themselves (their code, their process)
    CALL = "call"  # their call, against the others' calls there
    ERROR = "error"  # the error they raised
    PENDING_CALL = "pending_call"  # their call of an earlier cell, left pending there

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RootCause:
    """The root cause of a failure: ``ranks`` (their ``names``), ``likely`` where the records only
    point at them; ``how`` the records single them out (said in parentheses), ``note`` what else
    is known of them (after a comma), ``then`` what follows from it for the other ranks."""

    ranks: tuple[int, ...]
    names: Named = Named.RANKS
    likely: bool = False
    how: str = ""
    note: str = ""
    then: str = ""

    @classmethod
    def of(cls, ranks: Iterable[int], names: Named = Named.RANKS, likely: bool = False, how: str = "", note: str = "",
           then: str = "") -> RootCause:
        return cls(tuple(ranks), names, likely, how, note, then)
