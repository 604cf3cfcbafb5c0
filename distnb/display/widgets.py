"""The live cell view as ipywidgets — the richer twin of the text form.

Output arrives on distnb's I/O thread, which also sends the supervisors' heartbeats and holds the
pool lock while it calls us: :meth:`CellView.feed` only appends the chunk to a buffer and counts
it. The thread that waits for the cell calls :meth:`CellView.tick` about ten times a second; each
tick assigns each Output widget's ``outputs`` at most once. Never ``with output:``, which captures
whatever the *current* thread prints and misroutes background output; and not ``append_stdout``
per chunk either: ipywidgets re-sends an Output's whole ``outputs`` tuple on every change, so n
appends cost O(n²) in memory churn and comm traffic.

Everything shown is capped (each rank's tab, the grouped view, displays), with a visible note
saying how much was left out and that the cell's result (``_dist``) keeps it.

Above :data:`~distnb.ranks.SUMMARY_ABOVE` ranks, an Output per rank (a comm each, ~0.5 ms to make)
is no view: the per-rank part is the ranks' distribution and a tab for the first rank and each
that stands out (at most :data:`LIVE_SECTIONS`), from the live result: a few widgets at any size.
"""

from __future__ import annotations

import functools
import html
import threading
import time
from typing import Any

from distnb._text import prefix_lines
from distnb.cell_names import cell_name
from distnb.display.output_buffer import SYNC_RATE, OutputBuffer, note_entry, overwrite_cr
from distnb.display.static import diagnosis_html, header_html, spread_lines, standouts
from distnb.display.text import LivePrinter, kept_per_stream
from distnb.ranks import SUMMARY_ABOVE, format_ranks
from distnb.results import CellResult, RankResult, ranks_label
from distnb.states import CellStatus

__all__ = ["CellView", "widgets_available", "TAB_LIMIT"]

#: Up to this many ranks get a tab each; beyond it a dropdown picks the rank shown.
TAB_LIMIT = 8
#: Each rank's tab shows at most this much of its output (the result keeps more).
LIVE_RANK_CHARS = 256 << 10
RANK_MAX_LINES = 5_000
#: The grouped view's caps: below the terminal's, as every update re-sends all it shows.
GROUPED_MAX_LINES = 5_000
LIVE_GROUPED_CHARS = 1 << 20
#: Above SUMMARY_ABOVE ranks: tabs shown (the first rank and the ranks that stand out), and how
#: often the distribution and the choice of ranks are refreshed (each is a pass over all ranks).
LIVE_SECTIONS = 8
SPREAD_EVERY = 0.5
#: Lines of the grouped view that not every rank printed: magenta with a leading "≠" (ANSI
#: colours render in JupyterLab, Notebook 7 and VS Code output; the mark survives without them).
DIFF_START, DIFF_END = "\x1b[35m≠ ", "\x1b[0m"


def widgets_available() -> bool:
    """True in a Jupyter kernel where ipywidgets imports; False in terminal IPython, plain
    scripts, or where ipywidgets is missing or broken (the text path is used then)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:  # import, not find_spec: an install that is there but fails to import must fall back too
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


def _displayable(bundle: dict[str, str]) -> dict[str, str]:
    """A rank's display bundle without widget views: their models live on the rank, not here."""
    out = {k: v for k, v in bundle.items() if isinstance(v, str) and not k.startswith("application/vnd.jupyter.widget")}
    out.setdefault("text/plain", "")
    return out


def _rank_entries(rr: RankResult) -> tuple[dict[str, Any], ...]:
    """A rank's tab above SUMMARY_ABOVE ranks, from its result: stdout then stderr, the first
    LIVE_RANK_CHARS in all, and a note saying where the rest is."""
    out, err = overwrite_cr(rr.stdout)[:LIVE_RANK_CHARS], overwrite_cr(rr.stderr)
    err = err[: LIVE_RANK_CHARS - len(out)]
    entries = [{"output_type": "stream", "name": name, "text": text} for name, text in (("stdout", out), ("stderr", err)) if text]
    cut = len(rr.stdout) + len(rr.stderr) - len(out) - len(err)
    if cut > 0:
        entries.append(note_entry(f"[distnb] {cut:,} more characters of rank {rr.rank}'s output not shown (a tab keeps "
                                   f"{LIVE_RANK_CHARS >> 10:,} kB); the cell's result (_dist) keeps them: _dist[{rr.rank}].stdout / .stderr."))
    return tuple(entries)


class _WidgetPrinter(LivePrinter):
    """The grouped view: a LivePrinter whose lines go to the view's grouped Output widget, with
    lines not printed by every rank marked, and a plain copy kept for the text twin."""

    def __init__(self, view: CellView, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._view = view
        self.plain: list[str] = []  # what the grouped view shows, as text (bounded by the caps)

    def _emit(self, stream: str, text: str, differs: bool) -> None:
        self.plain.append(text)
        self._view._grouped_add(stream, (DIFF_START + text + DIFF_END if differs else text) + "\n")

    def _emit_note(self, note: str) -> None:
        text = f"[distnb] {note}"
        self.plain.append(text)
        self._view._grouped_add("stderr", text + "\n")

    def _emit_display(self, ranks: list[int], bundle: dict[str, str]) -> None:
        label = f"display {format_ranks(ranks)}"
        plain = prefix_lines(label, bundle.get("text/plain", ""))
        self.plain.append(plain or f"[{label}]")
        self._view._grouped_add("stdout", f"[{label}]\n", bundle)


class CellView:
    """Header (state · elapsed · ranks done), hang diagnosis, output grouped across ranks, a
    per-rank selector, and the outcome (values, errors root cause first, memory)."""

    def __init__(
        self,
        cell: int,
        ranks: list[int],
        *,
        rank_max_chars: int = LIVE_RANK_CHARS,
        rank_max_lines: int = RANK_MAX_LINES,
        max_lines: int = GROUPED_MAX_LINES,
        max_chars: int = LIVE_GROUPED_CHARS,
        started: float | None = None,
    ) -> None:
        """``started``: when the cell started (``time.monotonic()``), if before this view."""
        import ipywidgets as w

        self.cell = cell
        self.ranks = list(ranks)
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._start = time.monotonic() if started is None else started
        self._result: CellResult | None = None
        self._diagnosis = ""
        self._handle: Any = None
        self._closed = False  # finished: later output is dropped here (the result keeps it)
        self._twin_sent = ""
        self._twin_at = 0.0
        self._rank_max = (rank_max_chars, rank_max_lines)
        self._max_chars = max_chars
        self._fed = False
        # Every widget left without a layout makes its own Layout widget (a comm and its state,
        # ~0.5 ms each, per cell): the ones that are never restyled share one, the rank tabs another.
        plain = w.Layout()
        self.header = w.HTML(layout=plain)
        self.diagnosis = w.HTML(layout=w.Layout(display="none"))  # its own: shown once a hang appears
        self.grouped = w.Output(layout=w.Layout(max_height="400px", overflow="auto"))
        tab_layout = w.Layout(max_height="300px", overflow="auto")
        self.many = len(self.ranks) > SUMMARY_ABOVE
        self.rank_outputs = {} if self.many else {r: w.Output(layout=tab_layout) for r in self.ranks}
        # Many ranks: the tabs' Outputs, each with [Output, (rank, sizes, status) shown, when, characters].
        self._sections: list[list[Any]] = [[w.Output(layout=tab_layout), None, 0.0, 0] for _ in range(LIVE_SECTIONS * self.many)]
        self._spread_at = -SPREAD_EVERY
        if self.many:
            self.spread = w.HTML(layout=plain)
            self.selector: Any = w.Tab(children=[], layout=plain)
            per_rank: Any = w.VBox([self.spread, self.selector], layout=plain)
        elif len(self.ranks) <= TAB_LIMIT:
            self.selector = w.Tab(children=[self.rank_outputs[r] for r in self.ranks], layout=plain)
            self.selector.titles = tuple(f"rank {r}" for r in self.ranks)
            per_rank = self.selector
        else:
            self.selector = w.Dropdown(options=[(f"rank {r}", r) for r in self.ranks], value=self.ranks[0], description="rank", layout=plain)
            shown = w.Box([self.rank_outputs[self.ranks[0]]], layout=plain)
            self.selector.observe(lambda ch: setattr(shown, "children", [self.rank_outputs[ch["new"]]]), names="value")
            per_rank = w.VBox([self.selector, shown], layout=plain)
        self.outcome = w.HTML(layout=plain)
        self.widget = w.VBox([
            self.header,
            self.diagnosis,
            self.grouped,
            w.Accordion(children=[per_rank], titles=("per rank",), layout=plain),
            self.outcome,
        ], layout=plain)
        self._rank_bufs = {
            r: OutputBuffer(out, rank_max_chars, rank_max_lines, functools.partial(self._rank_note, r)) for r, out in self.rank_outputs.items()
        }
        # The printer caps the grouped text; this cap only bounds displays added beside it.
        self._grouped_buf = OutputBuffer(self.grouped, 2 * max_chars, None, self._grouped_note)
        self.printer = _WidgetPrinter(self, max_lines=max_lines, max_chars=max_chars, ranks=self.ranks)
        self.update_header()

    # -- called on the I/O thread: append and count only ----------------------------------------
    def feed(self, rank: int, stream: str, text: str) -> None:
        self._fed = True  # the cell's output is the view's to show (not so with --quiet)
        buf = self._rank_bufs.get(rank)
        if buf is not None:
            with self._lock:
                if not self._closed:
                    buf.add_text(stream, text)
        self.printer.feed(rank, stream, text)

    def display_bundle(self, rank: int, bundle: dict[str, str]) -> None:
        """A rank called ``display()`` (``CellEvents.on_display``): shown at the next tick in the
        rank's tab and, grouped with identical displays of other ranks, in the grouped view."""
        bundle = _displayable(bundle)
        buf = self._rank_bufs.get(rank)
        if buf is not None:
            with self._lock:
                if not self._closed:
                    buf.add_display(bundle)
        self.printer.display_bundle(rank, bundle)

    def rank_done(self, result: RankResult) -> None:
        with self._lock:
            self._done.add(result.rank)
        self.printer.rank_done(result)

    # -- called on the waiting thread -----------------------------------------------------------
    def _grouped_add(self, stream: str, text: str, bundle: dict[str, str] | None = None) -> None:
        with self._lock:
            self._grouped_buf.add_text(stream, text)
            if bundle is not None:
                self._grouped_buf.add_display(bundle)

    def tick(self, result: CellResult | None = None) -> None:
        """Called about ten times a second while the cell runs: flush batched output; ``result``,
        the cell's live result, feeds the per-rank part above SUMMARY_ABOVE ranks."""
        self.printer.flush()
        self._sync(final=False)
        if result is not None:
            self._summarise_ranks(result, final=False)
        self.update_header()

    def _summarise_ranks(self, result: CellResult, final: bool) -> None:
        """Many ranks: the distribution, and a tab for the first rank and each that stands out, from
        the live result: a pass over the ranks every SPREAD_EVERY s at most; a tab re-rendered when
        its rank's output grew, at most every (characters / SYNC_RATE) s."""
        now = time.monotonic()
        if not self.many or (not final and now - self._spread_at < SPREAD_EVERY):
            return
        self._spread_at = now
        # traitlets sends a value only when it changed: unchanged ones cost no message.
        self.spread.value = "<pre style='margin:2px 0'>" + html.escape("\n".join(spread_lines(result, self._fed))) + "</pre>"
        chosen = [(self.ranks[0], "")] + [s for s in standouts(result, list(self.printer.odd)) if s[0] != self.ranks[0]][: LIVE_SECTIONS - 1]
        for i, (r, _) in enumerate(chosen):
            section, rr = self._sections[i], result.results[r]
            key = (r, len(rr.stdout), len(rr.stderr), rr.status)
            due = final or section[1] is None or section[1][0] != r or now - section[2] >= section[3] / SYNC_RATE
            if key != section[1] and due:
                section[0].outputs = _rank_entries(rr)
                section[1:] = [key, now, key[1] + key[2]]
        self.selector.children = tuple(section[0] for section in self._sections[: len(chosen)])
        self.selector.titles = tuple(f"rank {r}" + (f" · {why}" if why else "") for r, why in chosen)

    def _grouped_note(self) -> str:
        note = self.printer.cap_note()
        dropped = self._grouped_buf.dropped_displays
        if dropped:
            note += ("\n" if note else "") + f"[distnb] {dropped:,} display{'s' * (dropped != 1)} too large for this view; the cell's result (_dist) has them."
        return note

    def _rank_note(self, rank: int) -> str:
        buf = self._rank_bufs[rank]
        parts = []
        if buf.dropped_chars:
            max_chars, max_lines = self._rank_max
            parts.append(
                f"{buf.dropped_chars:,} more characters ({buf.dropped_lines:,} lines) of rank {rank}'s output not shown "
                f"(a tab keeps {max_chars >> 10:,} kB, {max_lines:,} lines)"
            )
        if buf.dropped_displays:
            parts.append(f"{buf.dropped_displays:,} display{'s' * (buf.dropped_displays != 1)} not shown")
        if not parts:
            return ""
        return (
            f"[distnb] {'; '.join(parts)}; the cell's result (_dist) keeps the first {kept_per_stream()} per stream: "
            f"_dist[{rank}].stdout / .stderr."
        )

    def _sync(self, final: bool) -> None:
        now = time.monotonic()
        self._grouped_buf.sync(self._lock, now, final)
        for buf in self._rank_bufs.values():
            buf.sync(self._lock, now, final)

    def set_diagnosis(self, text: str) -> None:
        self._diagnosis = text
        self.diagnosis.value = diagnosis_html(text)
        self.diagnosis.layout.display = None
        # Frontends without a widget manager (jupyter console, nbconvert) see only the text twin;
        # a hang is worth telling them while it lasts. Not on every tick: an update makes
        # JupyterLab build a new view of the widget (scroll positions reset).
        self._refresh_twin(force=False)

    def update_header(self, state: str = "running") -> None:
        with self._lock:
            done = len(self._done)
        elapsed = (self._result.elapsed if self._result else time.monotonic() - self._start)
        self.header.value = header_html(self.cell, self.ranks, state, elapsed, done)

    def finish(self, result: CellResult) -> None:
        """The cell ended, timed out or was detached: show everything buffered, the outcome and
        the final text twin; output arriving later is dropped here (the result keeps it)."""
        self._result = result
        self.printer.flush(final=True)
        with self._lock:
            self._closed = True
            self._done = {r for r, rr in result.results.items() if rr.status != CellStatus.RUNNING}
        self._sync(final=True)
        self._summarise_ranks(result, final=True)
        self.update_header(result.state)
        outcome = self.printer.outcome_text(result)
        colour = "#cf222e" if result.failed or result.running else "#24292f"
        self.outcome.value = f"<pre style='color:{colour};margin:0'>{html.escape(outcome)}</pre>" if outcome else ""
        # Re-send the bundle so saved notebooks and static renderers get the final text.
        self._refresh_twin(force=True)

    def _refresh_twin(self, force: bool) -> None:
        if self._handle is None:
            return
        now = time.monotonic()
        text = self.text()
        if not force and (text == self._twin_sent or now - self._twin_at < 1.0):
            return
        self._twin_sent, self._twin_at = text, now
        self._handle.update(self)

    def show(self) -> Any:
        """Display the view, keeping a handle so that :meth:`finish` can refresh its text twin;
        returns the handle."""
        from IPython.display import display

        self._handle = display(self, display_id=True)
        return self._handle

    # -- display --------------------------------------------------------------------------------
    def text(self) -> str:
        """The text twin: what the view shows, as text — the diagnosis, the header, the output
        (none where the view was given none, as with ``--quiet``), what the caps left out, the
        outcome. It is never larger than the view's own caps allow."""
        result = self._result
        parts = [self._diagnosis] if self._diagnosis else []
        if result is not None:
            parts.append(result.header())
        else:
            with self._lock:
                done = len(self._done)
            parts.append(f"{cell_name(self.cell)} on {ranks_label(self.ranks)}: running, {done}/{len(self.ranks)} done, "
                         f"{time.monotonic() - self._start:.2f} s")
        note = self._grouped_note()
        if result is not None and not note:
            # Everything reached the view: the result's own text, whose output is grouped over
            # the whole cell (the live view groups only lines that arrive within 0.15 s).
            output = result.output_text() if self._fed else ""
            if len(output) <= self._max_chars:
                return "\n".join(p for p in (*parts, output, result.outcome_text()) if p)
        parts.extend(list(self.printer.plain))
        parts.append(note)
        if result is not None:
            parts.append(self.printer.outcome_text(result))
        return "\n".join(p for p in parts if p)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = self.text()
        return bundle
