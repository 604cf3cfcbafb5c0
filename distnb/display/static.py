"""A finished cell as one static output: what stays in the notebook once the cell is over.

Widgets are live objects in the kernel (a comm each, kept until closed) and only a running kernel
can draw them; a saved notebook reopened without one, nbconvert, and GitHub's viewer see only
what an output carries itself. So a finished cell shows — and leaves behind — one display with a
self-contained ``text/html`` form (header, grouped output, ``<details>`` per rank, the outcome)
and its ``text/plain`` twin, built from the :class:`~distnb.results.CellResult` alone.
"""

from __future__ import annotations

import base64
import functools
import html
import re
from typing import Any

from distnb.ranks import format_ranks, group_by
from distnb.results import CellResult

__all__ = ["StaticCell", "SAVED_GROUPED_CHARS", "SAVED_RANK_CHARS", "diagnosis_html", "header_html"]

#: What a finished cell keeps in the notebook file: the grouped output and each rank's section are
#: cut past these (the result, ``_dist``, keeps more), so a chatty cell can't bloat the .ipynb.
SAVED_GROUPED_CHARS = 256 << 10
SAVED_RANK_CHARS = 32 << 10
#: Displays (plots) a finished cell embeds, in all.
DISPLAY_MAX_BYTES = 8 << 20

STATE_COLOURS = {"running": "#1f6feb", "ok": "#1a7f37", "failed": "#cf222e", "timed out": "#9a6700", "detached": "#9a6700"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PRE = "<pre style='margin:2px 0;white-space:pre-wrap'>"


def _cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` up to ``limit`` characters (at a line end where one is near) and how many were left out."""
    if len(text) <= limit:
        return text, 0
    end = text.rfind("\n", limit // 2, limit)
    end = limit if end < 0 else end
    return text[:end], len(text) - end


def _pre(text: str, colour: str = "") -> str:
    style = f" style='color:{colour}'" if colour else ""
    return f"{_PRE}<span{style}>{html.escape(_ANSI.sub('', text))}</span></pre>"


def header_html(cell: int, ranks: list[int], state: str, elapsed: float, done: int) -> str:
    """The cell's header line, the same live (widgets.py) and finished."""
    colour = STATE_COLOURS.get(state, "#57606a")
    return (f"<b>cell {cell}</b> on {html.escape(format_ranks(ranks))} · "
            f"<span style='color:{colour}'><b>{html.escape(state)}</b></span> · {elapsed:.2f} s · {done}/{len(ranks)} ranks done")


def diagnosis_html(text: str) -> str:
    """A hang diagnosis: its headline in bold, the per-rank lines under it."""
    first, _, rest = text.partition("\n")
    return ("<div style='border-left:4px solid #cf222e;padding:4px 8px;background:#fff5f5'>"
            f"<b>{html.escape(first)}</b>{_pre(rest) if rest else ''}</div>")


def _display_html(bundle: dict[str, str]) -> str:
    """The richest form of one display that a static page can show without running anything."""
    for mime in ("image/png", "image/jpeg"):
        data = bundle.get(mime)
        if data:
            data = data if isinstance(data, str) else base64.b64encode(data).decode()
            return f"<img src='data:{mime};base64,{data.strip()}' style='max-width:100%'>"
    if bundle.get("text/html"):
        return bundle["text/html"]
    return _pre(bundle.get("text/plain", ""))


class StaticCell:
    """The finished cell's view without widgets: ``text/html`` and its ``text/plain`` twin.

    ``diagnosis``: the live diagnosis the view showed (a hang), kept at the top; ``output``: False
    where the cell's output was not the view's to show (``--quiet``)."""

    def __init__(self, result: CellResult, diagnosis: str = "", output: bool = True) -> None:
        self.result = result
        self.diagnosis = diagnosis
        self.output = output

    # The text and the HTML form both show these: computed once.
    @functools.cached_property
    def _grouped(self) -> tuple[str, str]:
        text, cut = _cut(self.result.output_text() if self.output else "", SAVED_GROUPED_CHARS)
        note = (f"[distnb] {cut:,} more characters of grouped output not shown here; "
                "the cell's result (_dist) keeps them: _dist[rank].stdout / .stderr.") if cut else ""
        return text, note

    @functools.cached_property
    def _full_outcome(self) -> str:
        return self.result.outcome_text()

    def text(self) -> str:
        result = self.result
        output, note = self._grouped
        parts = [self.diagnosis, result.header(), output, note, result.truncation_note(), self._full_outcome]
        return "\n".join(p for p in parts if p)

    def html(self) -> str:
        result = self.result
        done = sum(1 for r in result.results.values() if r.status != "running")
        out = [f"<div class='distnb-cell'><div>{header_html(result.cell, result.ranks, result.state, result.elapsed, done)}</div>"]
        if self.diagnosis:
            out.append(diagnosis_html(self.diagnosis))
        output, note = self._grouped
        if output:
            out.append(_pre(output))
        for line in (note, result.truncation_note()):
            if line:
                out.append(_pre(line, "#57606a"))
        out.extend(self._displays())
        if self.output and any(r.stdout or r.stderr for r in result.results.values()):
            out.append(f"<details><summary>per rank</summary>{''.join(self._rank(r) for r in sorted(result.results))}</details>")
        outcome = self._outcome()
        if outcome:
            out.append(_pre(outcome, "#cf222e" if result.failed or result.running else ""))
        out.append("</div>")
        return "".join(out)

    def _rank(self, rank: int) -> str:
        rr = self.result.results[rank]
        text, cut = _cut(rr.stdout + (("\n" if rr.stdout and not rr.stdout.endswith("\n") else "") + rr.stderr if rr.stderr else ""),
                         SAVED_RANK_CHARS)
        took = f" · {rr.duration:.2f} s" if rr.duration is not None else ""
        body = _pre(text) if text else _pre("(no output)", "#57606a")
        if cut:
            body += _pre(f"[distnb] {cut:,} more characters not shown here: _dist[{rank}].stdout / .stderr.", "#57606a")
        return f"<details><summary>rank {rank} · {html.escape(rr.status)}{took}</summary>{body}</details>"

    def _displays(self) -> list[str]:
        shown: list[str] = []
        left = DISPLAY_MAX_BYTES
        items = [(k, d) for k in sorted(self.result.results) for d in self.result.results[k].displays]
        for ranks, bundle in group_by(items):
            piece = _display_html(bundle)
            if len(piece) > left:
                shown.append(_pre(f"[distnb] a display of {format_ranks(ranks)} is too large to keep here; _dist[rank].displays has it.", "#57606a"))
                continue
            left -= len(piece)
            shown.append(f"<div><small>display {html.escape(format_ranks(ranks))}</small>{piece}</div>")
        return shown

    def _outcome(self) -> str:
        """The outcome less the displays' text (shown above as themselves)."""
        result = self.result
        if not any(r.displays for r in result.results.values()):
            return self._full_outcome
        from dataclasses import replace

        bare = {r: replace(rr, displays=[]) for r, rr in result.results.items()}
        return replace(result, results=bare).outcome_text()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}

    def __repr__(self) -> str:
        return self.text()
