"""The pools this process holds, and the one the magics act on (the last one started).

A registry apart from :mod:`distnb.pool`, so that the magics, the debugger panel's bridge and the
extension's unload ask it, not the pool module's private names; it holds pools weakly (a pool
nobody refers to is collected) and stops every live one when the interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import TYPE_CHECKING

from distnb.errors import NoPoolError
from distnb.states import PoolState

if TYPE_CHECKING:
    from distnb.pool import Pool

__all__ = ["add_pool", "current_or_none", "current_pool", "live_pools", "set_current"]

_live: weakref.WeakSet[Pool] = weakref.WeakSet()
_current: Pool | None = None


def add_pool(pool: Pool) -> None:
    """A new pool: stopped with the interpreter if still running then."""
    _live.add(pool)


def set_current(pool: Pool | None) -> None:
    """The pool the magics act on from now (None: none)."""
    global _current
    _current = pool


def current_or_none() -> Pool | None:
    """The current pool while it runs, else None."""
    if _current is None or _current.state in (PoolState.STOPPED, PoolState.NEW):
        return None
    return _current


def current_pool() -> Pool:
    """The pool the magics act on; raises :class:`NoPoolError` when none is running."""
    pool = current_or_none()
    if pool is None:
        raise NoPoolError("no pool is running; start one with %dist_launch -n 4 (or distnb.launch(nproc=4)).")
    return pool


def live_pools() -> list[Pool]:
    """Every pool of this process not yet collected, running or not."""
    return list(_live)


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_live):
        with contextlib.suppress(Exception):
            pool.shutdown()
