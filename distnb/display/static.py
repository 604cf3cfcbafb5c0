"""A finished cell as one static output: what stays in the notebook once the cell is over.

Widgets are live objects in the kernel (a comm each, kept until closed) and only a running kernel
can draw them; a saved notebook reopened without one, nbconvert, and GitHub's viewer see only
what an output carries itself. So a finished cell shows — and leaves behind — one display with a
self-contained ``text/html`` form (header, grouped output, ``<details>`` per rank, the outcome)
and its ``text/plain`` twin, built from the :class:`~distnb.results.CellResult` alone.

Above :data:`~distnb.ranks.SUMMARY_ABOVE` ranks a ``<details>`` per rank is no view (1,024 of
them) and would make the notebook grow with the world size: the per-rank part becomes the ranks'
distribution (status, duration, output size, each extreme's rank named) and a section for each
rank that stands out (failed, odd output, slowest, most output; at most :data:`MAX_RANK_SECTIONS`),
and the whole saved view is held to :data:`SCALED_SAVED_BYTES`, saying what it left out and where
the result keeps it.
"""

from __future__ import annotations

import base64
import functools
import html
import re
from typing import Any, Callable

from distnb._text import Rows
from distnb.cell_names import cell_name
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by
from distnb.results import CellResult, ranks_label
from distnb.states import CellStatus

__all__ = ["MAX_RANK_SECTIONS", "SCALED_SAVED_BYTES", "StaticCell", "SAVED_GROUPED_CHARS", "SAVED_RANK_CHARS",
           "diagnosis_html", "header_html", "spread_lines", "standouts"]

#: What a finished cell keeps in the notebook file: the grouped output and each rank's section are
#: cut past these (the result, ``_dist``, keeps more), so a chatty cell can't bloat the .ipynb.
SAVED_GROUPED_CHARS = 256 << 10
SAVED_RANK_CHARS = 32 << 10
#: Displays (plots) a finished cell embeds, in all.
DISPLAY_MAX_BYTES = 8 << 20
#: Above SUMMARY_ABOVE ranks the saved view — HTML and text each — takes at most this many bytes
#: (UTF-8) whatever the world size, besides the displays the ranks made themselves (a plot rank 0
#: drew is the user's own, as at 4 ranks): at most SCALED_DISPLAYS distinct ones, SCALED_DISPLAY_BYTES in all.
SCALED_SAVED_BYTES = 64 << 10
SCALED_DISPLAYS = 4
SCALED_DISPLAY_BYTES = 1 << 20
#: Ranks that get a section of their own above SUMMARY_ABOVE ranks, and each section's bytes.
MAX_RANK_SECTIONS = 8
_SECTION_BYTES = 2 << 10
#: How SCALED_SAVED_BYTES is shared (bytes each); what is left covers the header and markup.
_DIAGNOSIS_BYTES = 4 << 10
_OUTPUT_BYTES = 22 << 10
_NOTES_BYTES = 2 << 10
_SPREAD_BYTES = 4 << 10
_OUTCOME_BYTES = 8 << 10
_HIST = " ▁▂▃▄▅▆▇█"

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


def _fit(text: str, limit: int, render: Callable[[str], str] = str, note: Callable[[int], str] | None = None) -> tuple[str, int]:
    """``render(text)`` in at most ``limit`` UTF-8 bytes: the text cut (at a line end where one is
    near) until its rendering fits — escaping and wide characters make it longer than the text —
    ending with ``note(characters left out)`` once cut. Returns the rendering and that count."""
    out = render(text)
    size, keep = len(out.encode()), len(text)
    while size > limit and keep:
        keep = int(keep * limit / size * 0.95)  # shrink by the overshoot: two or three rounds
        kept, _ = _cut(text, keep)
        keep = len(kept)
        out = render(kept + ("\n" + note(len(text) - keep) if note else ""))
        size = len(out.encode())
    return out, len(text) - keep


def _left_out(what: str, where: str) -> Callable[[int], str]:
    return lambda n: f"[distnb] {n:,} more characters of {what} are not in this saved view: {where}."


_DIAGNOSIS_LEFT = _left_out("the diagnosis", "%dist_stacks and %dist_collectives show where the ranks are now")
_OUTPUT_LEFT = _left_out("grouped output", "the cell's result (_dist) keeps them, _dist[rank].stdout / .stderr")
_OUTCOME_LEFT = _left_out("the outcome", "the cell's result keeps it, _dist.outcome_text()")
_SPREAD_LEFT = _left_out("the per-rank summary", "the cell's result keeps every rank's, _dist[rank].status / .duration")
_NOTES_LEFT = _left_out("these notes", "the cell's result keeps them, _dist.truncation_note()")


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.3g} ms"


def _who(ranks: list[int]) -> str:
    """The rank at an extreme: ``rank 3``, or ``rank 3 and 1,020 others`` where many share it."""
    return f"rank {ranks[0]}" + (f" and {len(ranks) - 1:,} others" if len(ranks) > 1 else "")


def _spread(values: dict[int, float], show: Callable[[float], str], of: int) -> str:
    """``min 98.0 ms (rank 3) · median 130 ms · max 4.02 s (rank 17)`` over the ranks' values
    (``of``: how many ranks the cell has, some of which may have no value)."""
    ordered = sorted(values.values())
    lo, hi = ordered[0], ordered[-1]
    at_lo = [r for r, v in values.items() if v == lo]
    at_hi = [r for r, v in values.items() if v == hi]
    if lo == hi:
        return f"{show(lo)} on every rank" if len(values) == of else f"{show(lo)} on each of {len(values):,} ranks"
    return f"min {show(lo)} ({_who(at_lo)}) · median {show(ordered[len(ordered) // 2])} · max {show(hi)} ({_who(at_hi)})"


def _histogram(values: list[float], bins: int = 24) -> str:
    """The values' histogram as one line of block characters, min to max: the plot a text form can
    carry (a matplotlib PNG costs ~45 ms and its import ~0.5 s, past a trivial cell's budget)."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return ""
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / (hi - lo) * bins))] += 1
    top = max(counts)
    return "".join(_HIST[-(-8 * c // top)] for c in counts)  # any rank at all shows at least ▁


def spread_lines(result: CellResult, output: bool = True) -> list[str]:
    """Above SUMMARY_ABOVE ranks, the ranks of a cell as a distribution: each status with its
    ranks (every rank accounted for), the duration and output size with the extreme ranks named,
    and the duration's histogram (min to max, left to right)."""
    rs = result.results
    statuses = sorted(group_by((r, rs[r].status) for r in sorted(rs)), key=lambda g: -len(g[0]))
    lines = [f"per rank ({len(rs):,} ranks): " + " · ".join(f"{status} {len(ranks):,} ({format_ranks(ranks)})" for ranks, status in statuses)]
    took = {r: rr.duration for r, rr in rs.items() if rr.duration is not None}
    if took:
        hist = _histogram(list(took.values()))
        lines.append(f"  duration  {_spread(took, _secs, len(rs))}" + (f"   ▕{hist}▏" if hist else ""))
    if output:
        chars = {r: float(len(rr.stdout) + len(rr.stderr)) for r, rr in rs.items()}
        if any(chars.values()):
            lines.append(f"  output    {_spread(chars, lambda n: f'{n:,.0f}', len(rs))} characters")
    return lines


def standouts(result: CellResult, odd: list[int], limit: int = MAX_RANK_SECTIONS) -> list[tuple[int, str]]:
    """The ranks a summary gives a section of their own, with why, at most ``limit``: the failed
    (the first to die or raise first), those still running while most finished, those whose
    output the summary singled out (``odd``: nan, a line of their own), then the slowest, the one
    with the most output and the fastest — where the ranks differ at all."""
    rs = result.results
    why: dict[int, list[str]] = {}

    def add(rank: int, reason: str) -> None:
        if rank in why or len(why) < limit:
            why.setdefault(rank, []).append(reason)

    failed = [rr for rr in rs.values() if rr.status not in ("ok", "running")]
    failed.sort(key=lambda rr: (not rr.first_death, rr.status != CellStatus.DEAD, rr.finished_at or float("inf"), rr.rank))
    for rr in failed:
        add(rr.rank, f"raised {rr.error['ename']}" if rr.error else "died first" if rr.first_death else {"dead": "died"}.get(rr.status, rr.status))
    running = sorted(r for r, rr in rs.items() if rr.status == CellStatus.RUNNING)
    if len(running) < len(rs) / 2:  # the few still at it while most finished: stragglers, or stuck
        for r in running:
            add(r, "still running")
    for r in dict.fromkeys(odd):
        add(r, "odd output")
    took = {r: rr.duration for r, rr in rs.items() if rr.duration is not None}
    chars = {r: float(len(rr.stdout) + len(rr.stderr)) for r, rr in rs.items()}
    # An extreme stands out only well away from the median: "slowest" by a millisecond is noise.
    for values, reason, high, floor in ((took, "slowest", True, 0.05), (chars, "most output", True, 256), (took, "fastest", False, 0.05)):
        if values:
            ordered = sorted(values.values())
            median = ordered[len(ordered) // 2]
            r = max(values, key=lambda r: (values[r], -r)) if high else min(values, key=lambda r: (values[r], r))
            gap = values[r] - median if high else median - values[r]
            if gap > floor and gap > median / 2:
                add(r, reason)
    return [(r, ", ".join(reasons)) for r, reasons in why.items()]


def header_html(cell: int, ranks: list[int], state: str, elapsed: float, done: int) -> str:
    """The cell's header line, the same live (widgets.py) and finished."""
    colour = STATE_COLOURS.get(state, "#57606a")
    return (f"<b>{cell_name(cell)}</b> on {html.escape(ranks_label(ranks))} · "
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
        self.many = len(result.results) > SUMMARY_ABOVE

    # The text and the HTML form both show these: computed once.
    @functools.cached_property
    def _rows(self) -> list[tuple[str, Rows]]:
        return self.result.output_rows() if self.output else []

    @functools.cached_property
    def _grouped(self) -> tuple[str, str]:
        text, cut = _cut(self.result.output_text(self._rows) if self.output else "", SAVED_GROUPED_CHARS)
        note = (f"[distnb] {cut:,} more characters of grouped output not shown here; "
                "the cell's result (_dist) keeps them: _dist[rank].stdout / .stderr.") if cut else ""
        return text, note

    @functools.cached_property
    def _full_outcome(self) -> str:
        return self.result.outcome_text()

    @functools.cached_property
    def _standouts(self) -> list[tuple[int, str]]:
        return standouts(self.result, [r for _, rows in self._rows for r in rows.odd]) if self.output else []

    def text(self) -> str:
        if self.many:
            return self._scaled_text()
        result = self.result
        output, note = self._grouped
        parts = [self.diagnosis, result.header(), output, note, result.truncation_note(), self._full_outcome]
        return "\n".join(p for p in parts if p)

    def _scaled_text(self) -> str:
        """The text form above SUMMARY_ABOVE ranks: each part held to its share of SCALED_SAVED_BYTES."""
        result = self.result
        output, note = self._grouped
        parts = [_fit(self.diagnosis, _DIAGNOSIS_BYTES, note=_DIAGNOSIS_LEFT)[0], result.header(),
                 _fit(output, _OUTPUT_BYTES, note=_OUTPUT_LEFT)[0],
                 _fit("\n".join(p for p in (note, result.truncation_note()) if p), _NOTES_BYTES, note=_NOTES_LEFT)[0]]
        spread = spread_lines(result, self.output)
        if self._standouts:
            spread.append("  stand out: " + " · ".join(f"{format_ranks(ranks)} ({why})" for ranks, why in group_by(self._standouts)))
        parts.append(_fit("\n".join(spread), _SPREAD_BYTES, note=_SPREAD_LEFT)[0])
        parts.append(_fit(self._full_outcome, _OUTCOME_BYTES, note=_OUTCOME_LEFT)[0])
        return "\n".join(p for p in parts if p)

    def html(self) -> str:
        if self.many:
            return self._scaled_html()
        result = self.result
        done = sum(1 for r in result.results.values() if r.status != CellStatus.RUNNING)
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

    def _scaled_html(self) -> str:
        """The HTML form above SUMMARY_ABOVE ranks: the per-rank part as the ranks' distribution and
        the sections of the ranks that stand out; each part held to its share of SCALED_SAVED_BYTES."""
        result = self.result
        done = sum(1 for r in result.results.values() if r.status != CellStatus.RUNNING)
        out = [f"<div class='distnb-cell'><div>{header_html(result.cell, result.ranks, result.state, result.elapsed, done)}</div>"]
        if self.diagnosis:
            out.append(_fit(self.diagnosis, _DIAGNOSIS_BYTES, diagnosis_html, _DIAGNOSIS_LEFT)[0])
        output, note = self._grouped
        if output:
            out.append(_fit(output, _OUTPUT_BYTES, _pre, _OUTPUT_LEFT)[0])
        notes = "\n".join(p for p in (note, result.truncation_note()) if p)
        if notes:
            out.append(_fit(notes, _NOTES_BYTES, lambda t: _pre(t, "#57606a"), _NOTES_LEFT)[0])
        out.extend(self._displays(SCALED_DISPLAYS, SCALED_DISPLAY_BYTES))
        spread = _fit("\n".join(spread_lines(result, self.output)), _SPREAD_BYTES, _pre, _SPREAD_LEFT)[0]
        sections = "".join(self._rank(r, why, _SECTION_BYTES) for r, why in self._standouts)
        others = len(result.results) - len(self._standouts)
        printed = self.output and any(rr.stdout or rr.stderr for rr in result.results.values())
        left = (f"[distnb] {'the other' if self._standouts else 'the'} {others:,} ranks' own output is not in this saved view: "
                "_dist[rank].stdout / .stderr.") if printed and others else ""
        title = f"per rank: {len(result.results):,} ranks" + (f", {len(self._standouts)} stand out" if self._standouts else "")
        out.append(f"<details><summary>{title}</summary>{spread}{sections}{_pre(left, '#57606a') if left else ''}</details>")
        outcome = self._outcome()
        if outcome:
            colour = "#cf222e" if result.failed or result.running else ""
            out.append(_fit(outcome, _OUTCOME_BYTES, lambda t: _pre(t, colour), _OUTCOME_LEFT)[0])
        out.append("</div>")
        return "".join(out)

    def _rank(self, rank: int, why: str = "", limit: int = 0) -> str:
        """A rank's section: its status, duration (and, for a rank that stands out, why) over its
        output, cut to ``limit`` bytes of HTML when given, else to SAVED_RANK_CHARS characters."""
        rr = self.result.results[rank]
        text = rr.stdout + (("\n" if rr.stdout and not rr.stdout.endswith("\n") else "") + rr.stderr if rr.stderr else "")
        took = f" · {rr.duration:.2f} s" if rr.duration is not None else ""
        reason = f" — {html.escape(why)}" if why else ""
        if limit:
            body, cut = _fit(text, limit, lambda t: _pre(t) if t else _pre("(no output)", "#57606a"))
        else:
            text, cut = _cut(text, SAVED_RANK_CHARS)
            body = _pre(text) if text else _pre("(no output)", "#57606a")
        if cut:
            body += _pre(f"[distnb] {cut:,} more characters not shown here: _dist[{rank}].stdout / .stderr.", "#57606a")
        return f"<details><summary>rank {rank} · {html.escape(rr.status)}{took}{reason}</summary>{body}</details>"

    def _displays(self, count: int | None = None, budget: int = DISPLAY_MAX_BYTES) -> list[str]:
        shown: list[str] = []
        left = budget
        items = [(k, d) for k in sorted(self.result.results) for d in self.result.results[k].displays]
        # Grouped by a hashable form: dicts would be compared with every group so far (quadratic).
        groups = [(ranks, dict(key)) for ranks, key in group_by((k, tuple(sorted(d.items()))) for k, d in items)]
        if count is not None and len(groups) > count:
            rest = [r for ranks, _ in groups[count:] for r in ranks]
            shown.append(_pre(f"[distnb] {len(groups) - count:,} more displays (of {format_ranks(rest)}) are not in this saved view: "
                              "_dist[rank].displays.", "#57606a"))
            groups = groups[:count]
        for ranks, bundle in groups:
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
