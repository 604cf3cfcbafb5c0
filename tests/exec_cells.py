"""What cells print when run one after another in one namespace, as a session runs them: how the
tests of the minimizer's rewrites (inlining, null contexts, dead branches) compare a program with
its rewrite on random sessions."""

from __future__ import annotations

import contextlib
import io


def printed(cells: list[str], namespace: dict[str, object] | None = None, none_on: tuple[type[BaseException], ...] = (),
            messages: bool = False) -> str | None:
    """The cells' output, each exception a cell raises printed as ``raised <type>`` (with its
    message where ``messages``) and the next cell run; None when one raises one of ``none_on``."""
    ns: dict[str, object] = dict(namespace or {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in cells:
            try:
                exec(compile(cell, "<cell>", "exec"), ns)
            except none_on:
                return None
            except Exception as exc:  # the same error must come, at the same point
                print("raised", type(exc).__name__, *([exc] if messages else []))
    return out.getvalue()
