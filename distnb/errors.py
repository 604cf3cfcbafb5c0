"""Exceptions. Every message is a full sentence that says what to do next, and every error also
carries its facts as fields (``ranks``, per-rank ``errors``, ``first_death``…), so a program can
act on them without parsing the sentence."""

from __future__ import annotations

from typing import Mapping, Sequence

from distnb.ranks import format_ranks

__all__ = [
    "DistnbError",
    "LaunchError",
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
        cells = ", ".join(map(str, sorted(set(busy.values()))))
        return cls(f"{format_ranks(busy)} {'is' if len(busy) == 1 else 'are'} still running cell {cells}. Wait for it, see "
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
