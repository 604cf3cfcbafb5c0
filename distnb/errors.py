"""Exceptions. Every message is a full sentence that says what to do next, and every error also
carries its facts as fields (``ranks``, per-rank ``errors``, ``first_death``…), so a program can
act on them without parsing the sentence."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping, Sequence

from distnb._text import fit
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.states import CellStatus

if TYPE_CHECKING:  # the result types sit above this module (results.py names the analyses)
    from distnb.results import CellResult, RankResult

__all__ = [
    "AttachError",
    "CellFailed",
    "DistnbError",
    "LaunchError",
    "LoadError",
    "NoAnswerError",
    "NoCellError",
    "NoPoolError",
    "PoolBrokenError",
    "PoolBusyError",
    "RemoteError",
    "ShutdownError",
]


class DistnbError(RuntimeError):
    """Base class for distnb's errors."""


class NoPoolError(DistnbError):
    """There is no running pool."""


class AttachError(DistnbError):
    """An attach (``%dist_attach``, ``distnb.attach``) failed or an attached job was asked what it
    can't do; the message says what to do. Nothing in the job was changed."""


class LoadError(DistnbError):
    """``%dist_load`` / ``distnb.load`` found nothing it could read; the message says what it
    looked for and what to do."""


class NoCellError(DistnbError):
    """Something asked about a cell (diagnose, wait) before any cell ran on the pool."""


class LaunchError(DistnbError):
    """The pool did not start; the message names the rank and the reason.

    ``rank`` is the first rank that failed (``None`` when the failure was not a rank's: torchrun,
    a node agent, a timeout); ``missing`` maps each rank not ready at a timeout to its stage."""

    def __init__(self, message: str, *, rank: int | None = None, missing: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.missing = dict(missing or {})


class PoolBrokenError(DistnbError):
    """A rank died; the pool can't run collectives until it is restarted.

    ``dead`` lists the dead ranks, ``first_death`` the root cause (the first to die)."""

    def __init__(self, message: str, *, dead: Sequence[int] = (), first_death: int | None = None) -> None:
        super().__init__(message)
        self.dead = list(dead)
        self.first_death = first_death


class PoolBusyError(DistnbError):
    """The ranks asked for are still running an earlier cell; ``busy`` maps each to its cell."""

    def __init__(self, message: str, *, busy: Mapping[int, int] | None = None) -> None:
        super().__init__(message)
        self.busy = dict(busy or {})

    @classmethod
    def of(cls, busy: Mapping[int, int]) -> PoolBusyError:
        """The error for ``busy`` (rank → its cell), saying what to do."""
        cells = ", ".join(map(cell_name, sorted(set(busy.values()))))
        return cls(f"{format_ranks(busy)} {'is' if len(busy) == 1 else 'are'} still running {cells}. Wait for it, see "
                   "where it is with %dist_stacks, interrupt it with %dist_interrupt, or %dist_restart.", busy=busy)


class RemoteError(DistnbError):
    """A request failed on some ranks (e.g. pulling a name that is not defined there).

    ``errors`` maps each failing rank to its error text; ``ranks`` are those ranks, sorted."""

    def __init__(self, message: str, *, errors: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(sorted((errors or {}).items()))

    @property
    def ranks(self) -> list[int]:
        return list(self.errors)


class NoAnswerError(RemoteError):
    """Ranks did not answer a request in time (``ranks``; ``timeout`` in seconds)."""

    def __init__(self, message: str, *, ranks: Sequence[int] = (), timeout: float = 0.0) -> None:
        super().__init__(message, errors={r: f"no answer within {timeout:g} s" for r in ranks})
        self.timeout = timeout


class ShutdownError(DistnbError):
    """Processes of the pool survived SIGKILL (``pids``): stuck in the kernel, e.g. on a hung GPU."""

    def __init__(self, message: str, *, pids: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.pids = list(pids)


#: How much of an error's message the one-line summary keeps (the report above it has the rest).
_MESSAGE_CHARS = 160
#: Where a signal's explanation starts: "aborted (SIGABRT: a C++ assertion or abort(), …)".
_SIGNAL_WHY = re.compile(r"\((SIG[A-Z0-9]+): ")


class CellFailed(DistnbError):
    """A cell did not succeed on every rank: a rank raised, was interrupted or died, ranks were left
    stranded by a death, or ranks were still running when the wait ended (``--timeout``, a second
    Ctrl-C). ``%%on_ranks`` raises it after the cell's report is shown, so that Run All, nbclient and
    CI stop at that cell (``--keep-going``, or ``DISTNB_KEEP_GOING=1``, carries on instead).

    ``result`` is the cell's :class:`~distnb.CellResult` (the notebook's ``_dist`` too); None for a
    cell that never reached the ranks (a SyntaxError, found before anything was sent). It shows as
    its one line, not as a traceback: the report above it already says what happened, and where."""

    def __init__(self, message: str, *, result: CellResult | None = None) -> None:
        super().__init__(message)
        self.result = result

    @classmethod
    def of(cls, result: CellResult, prefix: str = "") -> CellFailed:
        """The error for a failed ``result``, its message one line: what went wrong first (a death,
        else the earliest error, an interrupt, ranks stranded or still running), then the rest, and
        the rank the diagnosis blamed where that is another (``— root cause: rank 2, …``)."""
        return cls(prefix + _summary(result), result=result)

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines in place of a traceback (InteractiveShell.showtraceback), and
        # ipykernel sends them as the error output's traceback (ename and evalue as usual): the
        # failure reads as one line under the report, not as a second traceback of distnb's frames.
        return [f"{type(self).__name__}: {self}"]


def _summary(result: CellResult) -> str:
    ranks = [result.results[r] for r in sorted(result.results)]
    dead = [r for r in ranks if r.status == CellStatus.DEAD]
    raised = sorted((r for r in ranks if r.status == CellStatus.ERROR and r.error), key=lambda r: (r.finished_at or float("inf"), r.rank))
    cell = cell_name(result.cell)
    if dead:  # a death explains the errors of the ranks that waited for it: it leads
        first = next((r for r in dead if r.first_death), dead[0])
        order = f", rank {first.rank} first" if len(dead) > 1 else ""
        why = _without_signal_why(first.death_reason())
        lead, named = f"{cell} failed: {format_ranks(r.rank for r in dead)} died{order}: {why}", dead
    elif raised:  # the earliest error, and every rank that raised the same
        ename = (raised[0].error or {}).get("ename")
        named = [r for r in raised if (r.error or {}).get("ename") == ename]
        lead = f"{cell} failed on {format_ranks(r.rank for r in named)}: {_error_line(raised[0])}"
    else:
        lead, named = "", []
    told = {r.rank for r in named}
    rest = _by_state([r for r in ranks if r.rank not in told and r.status != CellStatus.OK])
    if not lead:
        if not rest:
            return f"{cell} failed"
        state, who = rest.pop(0)
        lead = {
            "interrupted": f"{cell} was interrupted on {who}",
            "stranded": f"{cell} failed: {who} stranded, waiting for a rank that died",
            "running": f"{cell} timed out: {who} still running after {result.elapsed:.1f} s" if result.timed_out
            else f"{cell}: stopped waiting after a second interrupt; {who} still running" if result.detached
            else f"{cell} has not finished: {who} still running",
        }.get(state, f"{cell} failed: {who} {state}")
    tail = {"interrupted": "interrupted", "stranded": "stranded", "running": "still running (timed out)" if result.timed_out else "still running"}
    line = "; ".join([lead] + [f"{who} {tail.get(state, state)}" for state, who in rest])
    # A death's true cause (gloo aborts the rank that received too much, not the one that sent
    # it) or a timeout's (the rank that never came): whom to look at, as the diagnosis blamed them.
    blamed = result.blame_words()
    return f"{line} — {blamed}" if blamed else line


def _without_signal_why(reason: str) -> str:
    """``aborted (SIGABRT: a C++ assertion or abort(), …)`` → ``aborted (SIGABRT)``: the report
    above the line explains the signal; the line keeps its name."""
    found = _SIGNAL_WHY.search(reason)
    if not found:
        return reason
    depth, end = 1, found.end()
    while end < len(reason) and depth:  # to the parenthesis that closes it: the words may hold "abort()"
        depth += {"(": 1, ")": -1}.get(reason[end], 0)
        end += 1
    return f"{reason[: found.start()]}({found[1]}){reason[end:]}"


def _error_line(rank: RankResult) -> str:
    """``ename: the first line of its message``, the message cut to a line's length."""
    error = rank.error or {}
    message = str(error.get("evalue", "")).strip().split("\n", 1)[0]
    message = fit(message, _MESSAGE_CHARS)
    ename = error.get("ename") or "an error"
    return f"{ename}: {message}" if message else ename


def _by_state(ranks: list[RankResult]) -> list[tuple[str, str]]:
    """``(state, ranks in words)`` for the ranks that did not finish well, a group per state in the
    order a reader needs them: those that raised (``raised KeyError``), were interrupted, were
    stranded, are still running."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        state = f"raised {(r.error or {}).get('ename') or 'an error'}" if r.status == CellStatus.ERROR else r.status
        groups.setdefault(state, []).append(r.rank)
    order = {"interrupted": 1, "stranded": 2, "running": 3}
    return [(state, format_ranks(rs)) for state, rs in sorted(groups.items(), key=lambda g: (order.get(g[0], 0), g[1][0]))]
