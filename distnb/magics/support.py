"""What every distnb magic shares: argument parsing whose errors say where to read the flags,
distnb's errors as UsageErrors, the current pool, figures and reports shown inline, and a failed
cell raised once it is shown (so Run All stops there) unless the user keeps going."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from distnb.analysis.reports.memory import figure_png
from distnb.errors import CellFailed, DistnbError
from distnb.jobs.attached import AttachedJob
from distnb.jobs.bare import BareJob
from distnb.jobs.loaded import LoadedJob
from distnb.jobs.looking import current_job
from distnb.jobs.pools import current_pool
from distnb.pool import Pool

if TYPE_CHECKING:
    from distnb.results import CellResult

__all__ = ["KEEP_GOING_ENV", "Progress", "keep_going", "notebook_cell_number",
           "parse", "pool_or_usage_error", "show_checks", "show_figure", "stop_if_failed", "unquote",
           "usage_errors", "views_or_usage_error"]

#: The session's setting: set (``%env DISTNB_KEEP_GOING=1``), a failed cell does not raise, as if
#: every cell had ``--keep-going``. Read at each failure, so setting it mid-session takes effect.
KEEP_GOING_ENV = "DISTNB_KEEP_GOING"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def notebook_cell_number(shell: Any) -> int | None:
    """The In[n] IPython gave the cell now running, or None (a silent run, or a magic called from
    Python outside any cell).

    Read from the ExecutionResult IPython made for this cell before running it, never from
    ``shell.execution_count``: that counter moves *before* the cell runs from IPython 9 on and after
    it before, so read during a cell it is the next cell's number on 9 and this one's on 8.
    """
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(result, "execution_count", None)
    info = getattr(result, "info", None)
    if info is not None and (getattr(info, "silent", False) or not getattr(info, "store_history", True)):
        return None  # IPython 9 numbers a cell it keeps out of the history too; it has no In[n]
    return count if isinstance(count, int) else None


class Progress:
    """A long magic's progress line: updated in place in a notebook (one display, rewritten), a
    line each time its text before the first " · " changes (or every 10th update) in a terminal."""

    def __init__(self) -> None:
        from IPython import get_ipython

        shell = get_ipython()
        self._handle: Any = None
        self._live = shell is not None and getattr(shell, "kernel", None) is not None
        self._said, self._n = "", 0

    def say(self, text: str) -> None:
        self._n += 1
        if self._live:
            from IPython.display import display

            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
            return
        head = text.split(" · ", 1)[0]
        if head != self._said or self._n % 10 == 0:
            self._said = head
            print(text, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Turn distnb's own errors into UsageError: a clear message, no traceback."""
    try:
        yield
    except (DistnbError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def show_figure(fig: Any) -> None:
    """A matplotlib Figure inline as PNG (no %matplotlib inline needed)."""
    from IPython.display import Image, display

    display(Image(data=figure_png(fig), format="png"))


#: Each magic's arguments for an empty line, parsed once: argparse costs ~0.1 ms a cell, and most
#: ``%%on_ranks`` cells have no flags.
_DEFAULTS: dict[Any, Any] = {}


def parse(magic: Any, line: str) -> Any:
    """``parse_argstring`` whose errors end with where to read the flags."""
    if not line.strip():
        func = getattr(magic, "__func__", magic)
        if func not in _DEFAULTS:
            _DEFAULTS[func] = parse_argstring(magic, "")
        return copy.copy(_DEFAULTS[func])
    try:
        return parse_argstring(magic, line)
    except UsageError as exc:
        name = magic.__name__
        prefix = "%%" if name == "on_ranks" else "%"
        raise UsageError(f"{str(exc).rstrip('.')}. Run {prefix}{name}? for its flags.") from None


def unquote(value: str) -> str:
    """A flag's value without the quotes IPython's argument split leaves on it (``-c "p x"``)."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value


def show_checks(reports: list[Any]) -> None:
    """Each report as its table in a kernel (HTML, divergent entries coloured), as text elsewhere."""
    from IPython.display import display

    for report in reports:
        display(report)


def pool_or_usage_error() -> Pool:
    """The pool the magics act on, or a UsageError saying how to start one (or, attached to a job
    or looking into a loaded one, that it is read-only)."""
    job = current_job()
    if job is not None:
        raise UsageError(f"this notebook is {job.describe()}, read-only: it runs no cells and is not changed from "
                         "here (%dist_status, %dist_stacks, %dist_collectives, %dist_timeline, %dist_memory and %dist_env look into it); "
                         "%dist_detach first to use a pool.")
    with usage_errors():
        return current_pool()


def views_or_usage_error() -> Pool | AttachedJob | BareJob | LoadedJob:
    """What the read-only views look into: the job attached or loaded when there is one, else the pool."""
    job = current_job()
    if isinstance(job, (AttachedJob, BareJob, LoadedJob)):
        return job
    return pool_or_usage_error()


def keep_going(flag: bool) -> bool:
    """Whether a failed cell should let the notebook go on: the cell's ``--keep-going``, else the
    session's ``DISTNB_KEEP_GOING``."""
    if flag:
        return True
    value = os.environ.get(KEEP_GOING_ENV, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise UsageError(f"{KEEP_GOING_ENV}={os.environ[KEEP_GOING_ENV]!r} is neither on nor off: set it to 1 to keep going past "
                     f"failed cells, or to 0 (or unset it) to stop at them, e.g. %env {KEEP_GOING_ENV}=1.")


def stop_if_failed(result: CellResult, flag: bool, prefix: str = "") -> None:
    """Raise :class:`~distnb.CellFailed` for a cell that did not succeed on every rank (raised,
    interrupted, died, stranded, or still running when the wait ended), unless ``flag``
    (``--keep-going``) or the session's setting keeps going. Called after the cell's report is
    shown: the exception adds one line under it, and stops Run All, nbclient and CI there."""
    if not result.ok and not keep_going(flag):
        raise CellFailed.of(result, prefix)
