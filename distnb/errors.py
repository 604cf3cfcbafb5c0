"""Exceptions. Every message is a full sentence that says what to do next."""

from __future__ import annotations

__all__ = ["DistnbError", "LaunchError", "NoPoolError", "PoolBrokenError", "PoolBusyError", "RemoteError"]


class DistnbError(RuntimeError):
    """Base class for distnb's errors."""


class NoPoolError(DistnbError):
    """There is no running pool."""


class LaunchError(DistnbError):
    """The pool did not start; the message names the rank and the reason."""


class PoolBrokenError(DistnbError):
    """A rank died; the pool can't run collectives until it is restarted."""


class PoolBusyError(DistnbError):
    """The ranks asked for are still running an earlier cell."""


class RemoteError(DistnbError):
    """A request failed on a rank (e.g. pulling a name that is not defined there)."""
