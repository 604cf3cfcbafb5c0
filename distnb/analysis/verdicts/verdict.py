"""A verdict is data: what is wrong (:class:`Kind`), whether the cell hangs, runs slow or failed
(:class:`VerdictState`), who caused it and who suffers it, where in the notebook, which records prove it
and how sure distnb is. Words come last (:mod:`distnb.analysis.render`); the live view,
the cell's report and ``CellFailed`` all read the same verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from distnb.analysis.render import headline, verdict_text
from distnb.analysis.root_cause import RootCause

__all__ = ["CALLED_FROM", "call_and_caller", "Blame", "Certainty", "Evidence", "Kind", "Site", "VerdictState", "Verdict"]


class VerdictState(str, Enum):
    """The situation of the cell's ranks (the old ``Diagnosis.kind`` strings, so comparisons with
    them still hold)."""

    OK = "ok"  # nothing wrong seen (yet)
    RUNNING = "running"  # ranks compute with nobody waiting: nothing to judge
    SLOW = "slow"  # ranks wait, and will likely get through
    HANG = "hang"  # ranks wait for something that will not come
    PAUSED = "paused"  # ranks wait for the notebook (pdb, input(), the debugger panel)
    FAILED = "failed"  # over: a rank died or raised, with a cause found
    DESYNC = "desync"  # over on every rank, but their calls disagreed: wrong results, or the next sync hangs

    def __str__(self) -> str:
        return self.value


class Kind(str, Enum):
    """What broke the agreement between ranks, as a class of causes."""

    NONE = "none"  # nothing wrong found
    RAISED = "raised"  # a rank raised an error of its own and left the cell
    DIED = "died"  # a rank's process died
    CALL_MISSING = "call_missing"  # ranks did not make a call the rest of its group made
    CALL_EXTRA = "call_extra"  # ranks made a call the rest of its group did not
    LOOP_COUNT = "loop_count"  # ranks repeated the same calls (a loop) another number of times
    MISMATCH = "mismatch"  # the same position of a group's sequence: another op, shape, dtype or argument
    WRONG_GROUP = "wrong_group"  # a call over another group (mesh dimension) than its peers'
    P2P_UNMATCHED = "p2p_unmatched"  # a send or receive with no partner (another peer, a missing side)
    CROSS_CELL = "cross_cell"  # one collective paired calls of different cells (a call left pending)
    GROUP_CREATION = "group_creation"  # new_group out of step across ranks
    NOT_IN_CELL = "not_in_cell"  # a collective needs ranks the cell does not run on
    UNRESPONSIVE = "unresponsive"  # a rank gives no stack at all
    STILL_RUNNING = "still_running"  # ranks compute while the others wait for them
    COMPILING = "compiling"  # ranks still in torch.compile while others wait
    IMPORTING = "importing"  # ranks still importing modules while others wait
    SLOW_COLLECTIVE = "slow_collective"  # every rank in the same collective or transfer
    STRAGGLER = "straggler"  # a rank late at most collectives, beyond the noise
    PAUSED = "paused"  # ranks paused in a debugger (not a fault)
    UNKNOWN = "unknown"  # ranks hang and the records do not say why

    def __str__(self) -> str:
        return self.value


class Certainty(str, Enum):
    CERTAIN = "certain"  # the records prove it
    LIKELY = "likely"  # inferred: ``Verdict.reason`` says from what

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Blame:
    """Whom a failure's root cause names, and how sure the records make it: the data behind the
    words ``CellResult.root_cause`` holds, read by whatever names the rank again (the one line of
    ``CellFailed``) so that nothing parses the words back."""

    ranks: tuple[int, ...]
    certainty: Certainty

    @classmethod
    def of(cls, ranks: Iterable[int], certainty: Certainty) -> Blame | None:
        """Blame on ``ranks``; None when there are none to name."""
        named = tuple(ranks)
        return cls(named, certainty) if named else None

    @property
    def likely(self) -> bool:
        return self.certainty is Certainty.LIKELY


#: A :class:`Site`'s ``what`` for the line of the judged cell that called the function (an earlier
#: cell's) holding the call: the second site, after the call's own.
CALLED_FROM = "where the cell called it"


def call_and_caller(sites: list[Site]) -> list[Site]:
    """The call's own site, then the judged cell's line that called its function (when the
    call sits in a function an earlier cell defined): where an ``if`` or a loop may decide it."""
    return sites[:1] + [s for s in sites[1:2] if s.what == CALLED_FROM]


@dataclass(frozen=True)
class Site:
    """A place in the notebook: cell (distnb's number; ``label`` the notebook's In[n]), line, the
    function it is in, and the line's text."""

    cell: int | None
    line: int | None
    func: str = ""
    code: str = ""
    what: str = ""  # what happens there, in a few words: "the call", "under `if rank == 0:`"


@dataclass(frozen=True)
class Evidence:
    """Which constraint broke, and the records that show it: ``records`` per rank, each a short
    description of the record (an entry, a call, a stack line) that the rule read."""

    constraint: str  # e.g. "the n-th call on a group matches on every member"
    records: dict[int, str] = field(default_factory=dict)
    group: str | None = None  # the group the constraint is about
    seq: int | None = None  # the position in that group's sequence
    fields: tuple[str, ...] = ()  # what differs (op, shape, dtype, op argument, split sizes, group, peer)


@dataclass
class Verdict:
    """The diagnosis of a cell: ``kind`` of cause, ``state`` of the ranks, ``culprits`` (whose
    code or process caused it), ``victims`` (who suffers it: waiting, aborted), ``sites`` (where),
    ``evidence`` and ``certainty``. ``said`` and ``details`` are the rule's words, made from the
    data; ``root`` whom the root cause names (its words are the renderer's); ``positions`` are
    the ranks' places, for the per-rank lines."""

    state: VerdictState
    kind: Kind
    said: str  # the rule's sentence, without the root cause (``summary`` is both, in words)
    culprits: list[int] = field(default_factory=list)
    victims: list[int] = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)
    evidence: Evidence | None = None
    certainty: Certainty = Certainty.LIKELY
    reason: str = ""  # why only likely: what was inferred, from what
    positions: list[Any] = field(default_factory=list)  # analysis.position.Position, per rank
    details: list[str] = field(default_factory=list)  # more lines under the per-rank ones
    rule: str = ""  # the rule that found it (for tests and the corpus' confusion table; nothing branches on it)
    #: Whether it names a cause the cell's own report (its errors and deaths) does not say: a
    #: verdict that a rank died or raised is said there, and is not repeated as the root cause.
    beyond_report: bool = True
    explained: bool = False  # the cell's code shows why (a condition on the rank, a loop): no need to record paths
    root: RootCause | None = None  # whom the root cause names, when the rule could name one

    @property
    def summary(self) -> str:
        """The headline: the rule's sentence, then the root cause (:func:`~distnb.analysis.render.headline`)."""
        return headline(self.said, self.root)

    @property
    def is_problem(self) -> bool:
        return self.state in (VerdictState.HANG, VerdictState.SLOW, VerdictState.FAILED, VerdictState.DESYNC) or \
            self.kind not in (Kind.NONE, Kind.PAUSED)

    def text(self) -> str:
        """The headline, then one line per place the ranks are in (:func:`~distnb.analysis.render.verdict_text`)."""
        return verdict_text(self)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())
