"""What a ``%%on_ranks`` cell shows in a kernel with widgets, and what it leaves behind.

Most cells finish within a fraction of a second. Building the widget view for them costs more
than the cell (about 20 widgets, a comm each) and, kept, grows the kernel without bound. So the
view is made only when it helps: once the cell has run past :data:`LIVE_AFTER` seconds, or needs
the user (a rank paused in the debugger, a hang to report). Until then output is only buffered;
going live replays it into the widgets. Every cell, live or not, ends as one
:class:`~distnb.display.static.StaticCell` output in place of the view, and the view's widgets
are closed: nothing of a finished cell stays alive in the kernel, and a saved notebook shows it
without one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from distnb.display.static import StaticCell
from distnb.results import CellResult, RankResult

__all__ = ["CellDisplay", "LIVE_AFTER", "close_tree"]

#: Seconds a cell runs before its live widget view is built.
LIVE_AFTER = 0.5
#: Output buffered before the view goes live, in characters: past it the next tick makes the view
#: (the result keeps the output either way).
BUFFER_CHARS = 1 << 20


def close_tree(root: Any) -> int:
    """Close ``root`` and every widget it holds (children, layouts, styles): their comms close and
    ipywidgets forgets them. Returns how many were closed."""
    from ipywidgets import Widget

    seen: set[int] = set()
    stack = [root]
    while stack:
        widget = stack.pop()
        if id(widget) in seen:
            continue
        seen.add(id(widget))
        for name in widget.keys:
            value = getattr(widget, name, None)
            stack.extend(v for v in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(v, Widget))
        widget.close()
    return len(seen)


class CellDisplay:
    """A cell's view: buffered, then (maybe) live widgets, then one static output.

    The I/O thread calls :meth:`feed`, :meth:`display_bundle` and :meth:`rank_done`; the thread
    waiting for the cell calls :meth:`tick`, :meth:`set_diagnosis`, :meth:`go_live` and
    :meth:`finish`."""

    def __init__(self, ranks: list[int], *, output: bool = True, live_after: float = LIVE_AFTER) -> None:
        self.cell = -1
        self.ranks = list(ranks)
        self._output = output
        self._live_after = live_after
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._pending: list[tuple[str, tuple[Any, ...]]] = []  # events before the view exists
        self._buffered = 0
        self._view: Any = None
        self._handle: Any = None
        self._finished = False
        self._diagnosis = ""

    @property
    def live(self) -> bool:
        return self._view is not None

    # -- I/O thread -----------------------------------------------------------------------------
    def _event(self, kind: str, *args: Any) -> None:
        with self._lock:
            if self._finished:
                return  # later output: the result keeps it
            view = self._view
            if view is None:
                self._pending.append((kind, args))
                if kind == "feed":
                    self._buffered += len(args[2])
                return
        getattr(view, kind)(*args)

    def feed(self, rank: int, stream: str, text: str) -> None:
        self._event("feed", rank, stream, text)

    def display_bundle(self, rank: int, bundle: dict[str, str]) -> None:
        self._event("display_bundle", rank, bundle)

    def rank_done(self, result: RankResult) -> None:
        self._event("rank_done", result)

    # -- the waiting thread ---------------------------------------------------------------------
    def tick(self, result: CellResult | None = None) -> None:
        if self._view is None and (time.monotonic() - self._start >= self._live_after or self._buffered > BUFFER_CHARS):
            self.go_live()
        if self._view is not None:
            self._view.tick(result)

    def go_live(self) -> None:
        """Build the widget view now, with everything the cell sent so far, and show it."""
        if self._view is not None or self._finished:
            return
        from distnb.display.widgets import CellView

        view = CellView(self.cell, self.ranks, started=self._start)
        with self._lock:  # the I/O thread waits meanwhile, so no event is lost or reordered
            for kind, args in self._pending:
                getattr(view, kind)(*args)
            self._pending, self._buffered = [], 0
            self._view = view
        self._handle = view.show()

    def set_diagnosis(self, text: str, keep: bool = True) -> None:
        """Show ``text`` in the live view. ``keep=False``: what healthy ranks are doing now (a long
        cell's activity, a slow collective) — live only, never left in the cell's saved output."""
        if keep:
            self._diagnosis = text
        self.go_live()
        if self._view is not None:
            self._view.set_diagnosis(text)

    def finish(self, result: CellResult) -> StaticCell:
        """The cell ended (or timed out, or was detached): show its static form in place of the
        view and close the view's widgets. Returns what was shown."""
        with self._lock:
            self._finished = True
            view, self._view, self._pending = self._view, None, []
        static = StaticCell(result, self._diagnosis, self._output)
        if self._handle is not None:
            self._handle.update(static)
        else:
            # Straight to the front-end: display() would first ask IPython's dozen formatters about
            # an object whose bundle is already complete (about 1 ms of a 10 ms cell).
            from IPython.display import publish_display_data

            publish_display_data(static._repr_mimebundle_())
        if view is not None:
            close_tree(view.widget)
        return static
