"""The live cell view as ipywidgets — the richer twin of the text form.

Output arrives on distnb's I/O thread. Per-rank ``Output`` widgets are appended to with
``append_stdout``/``append_stderr`` (thread-safe state updates), never with ``with output:``, which
captures whatever the *current* thread prints and misroutes background output.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from distnb.display.text import LivePrinter
from distnb.ranks import format_ranks
from distnb.results import CellResult, RankResult

__all__ = ["CellView", "widgets_available", "TAB_LIMIT"]

#: Up to this many ranks get a tab each; beyond it a dropdown picks the rank shown.
TAB_LIMIT = 8

_STATE_COLOURS = {"running": "#1f6feb", "ok": "#1a7f37", "failed": "#cf222e", "timed out": "#9a6700", "detached": "#9a6700"}


def widgets_available() -> bool:
    """True in a Jupyter kernel with ipywidgets; False in terminal IPython, nbconvert-less scripts."""
    import importlib.util

    if importlib.util.find_spec("ipywidgets") is None:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class _Stream:
    """A file-like object that appends to an Output widget (used by LivePrinter)."""

    def __init__(self, output: Any, stream: str) -> None:
        self._append = output.append_stdout if stream == "stdout" else output.append_stderr

    def write(self, text: str) -> int:
        if text:
            self._append(text)
        return len(text)

    def flush(self) -> None:
        pass


class CellView:
    """Header (state · elapsed · ranks done), hang diagnosis, output grouped across ranks, a
    per-rank selector, and the outcome (values, errors root cause first, memory)."""

    def __init__(self, cell: int, ranks: list[int]) -> None:
        import ipywidgets as w

        self.cell = cell
        self.ranks = list(ranks)
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._start = time.monotonic()
        self._result: CellResult | None = None
        self._diagnosis = ""
        self._handle: Any = None
        self.header = w.HTML()
        self.diagnosis = w.HTML(layout=w.Layout(display="none"))
        self.grouped = w.Output(layout=w.Layout(max_height="400px", overflow="auto"))
        self.rank_outputs = {r: w.Output(layout=w.Layout(max_height="300px", overflow="auto")) for r in self.ranks}
        if len(self.ranks) <= TAB_LIMIT:
            self.selector: Any = w.Tab(children=[self.rank_outputs[r] for r in self.ranks])
            for i, r in enumerate(self.ranks):
                self.selector.set_title(i, f"rank {r}")
            per_rank: Any = self.selector
        else:
            self.selector = w.Dropdown(options=[(f"rank {r}", r) for r in self.ranks], value=self.ranks[0], description="rank")
            shown = w.Box([self.rank_outputs[self.ranks[0]]])
            self.selector.observe(lambda ch: setattr(shown, "children", [self.rank_outputs[ch["new"]]]), names="value")
            per_rank = w.VBox([self.selector, shown])
        self.outcome = w.HTML()
        self.widget = w.VBox([
            self.header,
            self.diagnosis,
            self.grouped,
            w.Accordion(children=[per_rank], titles=("per rank",)),
            self.outcome,
        ])
        self.printer = LivePrinter(out=_Stream(self.grouped, "stdout"), err=_Stream(self.grouped, "stderr"))
        self.update_header()

    # -- called from any thread -----------------------------------------------------------------
    def feed(self, rank: int, stream: str, text: str) -> None:
        out = self.rank_outputs.get(rank)
        if out is not None:
            (out.append_stdout if stream == "stdout" else out.append_stderr)(text)
        self.printer.feed(rank, stream, text)

    def rank_done(self, result: RankResult) -> None:
        with self._lock:
            self._done.add(result.rank)
        self.printer.rank_done(result)

    # -- called from the waiting thread ---------------------------------------------------------
    def tick(self, _result: CellResult | None = None) -> None:
        self.printer.flush()
        self.update_header()

    def set_diagnosis(self, text: str) -> None:
        self._diagnosis = text
        first, _, rest = text.partition("\n")
        self.diagnosis.value = (
            "<div style='border-left:4px solid #cf222e;padding:4px 8px;background:#fff5f5'>"
            f"<b>{html.escape(first)}</b><pre style='margin:2px 0'>{html.escape(rest)}</pre></div>"
        )
        self.diagnosis.layout.display = None

    def update_header(self, state: str = "running") -> None:
        with self._lock:
            done = len(self._done)
        elapsed = (self._result.elapsed if self._result else time.monotonic() - self._start)
        colour = _STATE_COLOURS.get(state, "#57606a")
        self.header.value = (
            f"<b>cell {self.cell}</b> on {html.escape(format_ranks(self.ranks))} · "
            f"<span style='color:{colour}'><b>{html.escape(state)}</b></span> · {elapsed:.2f} s · "
            f"{done}/{len(self.ranks)} ranks done"
        )

    def finish(self, result: CellResult) -> None:
        self._result = result
        self.printer.flush(final=True)
        with self._lock:
            self._done = {r for r, rr in result.results.items() if rr.status != "running"}
        self.update_header(result.header().split(": ", 1)[1].split(",")[0])
        outcome = result.outcome_text()
        for note in self.printer.announced:
            outcome = outcome.replace(note, "").strip("\n")
        colour = "#cf222e" if result.failed or result.running else "#24292f"
        self.outcome.value = f"<pre style='color:{colour};margin:0'>{html.escape(outcome)}</pre>" if outcome else ""
        if self._handle is not None:
            # Re-send the bundle so saved notebooks and static renderers get the final text.
            self._handle.update(self)

    def show(self) -> None:
        """Display the view, keeping a handle so that :meth:`finish` can refresh its text twin."""
        from IPython.display import display

        self._handle = display(self, display_id=True)

    # -- display --------------------------------------------------------------------------------
    def text(self) -> str:
        body = self._result.text() if self._result is not None else f"cell {self.cell} on {format_ranks(self.ranks)}: running"
        return f"{self._diagnosis}\n{body}" if self._diagnosis else body

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = self.text()
        return bundle
