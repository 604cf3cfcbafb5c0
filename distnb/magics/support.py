"""What every distnb magic shares: argument parsing whose errors say where to read the flags,
distnb's errors as UsageErrors, the current pool, and figures and reports shown inline."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from distnb.analysis.memory import figure_png
from distnb.errors import DistnbError
from distnb.pool import Pool, current_pool

__all__ = ["parse", "pool_or_usage_error", "show_checks", "show_figure", "usage_errors"]


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


def show_checks(reports: list[Any]) -> None:
    """Each report as its table in a kernel (HTML, divergent entries coloured), as text elsewhere."""
    from IPython.display import display

    for report in reports:
        display(report)


def pool_or_usage_error() -> Pool:
    """The pool the magics act on, or a UsageError saying how to start one."""
    with usage_errors():
        return current_pool()
