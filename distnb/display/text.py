"""Live plain-text rendering of a running cell's output, for terminals, nbconvert and CI logs.

Output arrives on distnb's I/O thread (which also sends the supervisors' heartbeats, with the pool
lock held), so :meth:`LivePrinter.feed` only appends the chunk to a list. Splitting into lines,
grouping and printing happen in :meth:`LivePrinter.flush` on the thread that waits for the cell
(in Jupyter, the kernel's main thread), so they land in the right cell. Lines that several ranks
print at about the same time are printed once with their rank set; above
:data:`~distnb.ranks.SUMMARY_ABOVE` ranks, lines that differ only in their numbers are one line too
(:func:`~distnb._text.merge_rows`: the range over the ranks, the odd ranks named).

Everything is bounded: the lines shown (``max_lines``/``max_chars``), the backlog between two
flushes, each unfinished line (its head and tail are kept, the middle counted), and output that
arrives after the view finished (dropped: the cell's result keeps it).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TextIO

from distnb._text import MERGED_NOTE, Repeats, merge_rows, prefix_lines, size
from distnb.analysis.verdicts.failures import CrashDumpFold
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by, rank_span
from distnb.results import RankResult
from distnb.states import CellStatus, RankState

if TYPE_CHECKING:
    from distnb.results import CellResult

__all__ = ["LINE_KEEP", "LivePrinter", "StartProgress", "kept_per_stream", "stage_counts", "stage_summary"]

#: Of a very long line, this many characters of its start and of its end are shown.
LINE_KEEP = 4096
#: Rank displays shown live per cell; more are counted (the result keeps them all).
MAX_DISPLAYS = 50
#: Ranks the summaries single out (``LivePrinter.odd``) that are remembered, the first ones.
MAX_ODD = 64
#: Small tail pieces are merged up to this size, so a trickle of 1-byte chunks does not pile up
#: millions of tiny strings (merging copies at most this much per chunk: still linear).
_MERGE_BELOW = 1024


_STAGE_ORDER = ("ready", "connected", "started", "launched", "dead")


def stage_counts(stages: Mapping[int, RankState]) -> dict[str, list[int]]:
    """The ranks in each start-up stage, furthest first (``idle`` is called ``ready`` here):
    what a progress line shows, and what tells that it changed."""
    counts: dict[str, list[int]] = {}
    for rank, stage in sorted(stages.items()):
        counts.setdefault("ready" if stage == RankState.IDLE else stage.value, []).append(rank)
    return {name: counts[name] for name in _STAGE_ORDER if name in counts}


def stage_summary(stages: Mapping[int, RankState], elapsed: float) -> str:
    """``launching 4 ranks (3.2 s): ready 2 · connected 1 · started 1``."""
    parts = [f"{name} {rank_span(ranks)}" for name, ranks in stage_counts(stages).items()]
    return f"launching {len(stages)} ranks ({elapsed:.1f} s): " + " · ".join(parts)


def kept_per_stream() -> str:
    """How much output the pool keeps per rank and stream in a cell's result, in words."""
    from distnb.controller.tracker import OUTPUT_KEEP_BYTES  # the tracker's constant: the note can't drift from it

    return size(OUTPUT_KEEP_BYTES)


def _hidden(n: int) -> str:
    return f" … [{n:,} characters not shown] … "


def clip_line(line: str) -> str:
    """A complete line as a terminal would leave it (text before a carriage return is overwritten,
    as progress bars do), cut to its first and last :data:`LINE_KEEP` characters."""
    if "\r" in line:
        line = line.rstrip("\r")
        line = line[line.rfind("\r") + 1 :]
    if len(line) > 2 * LINE_KEEP:
        line = line[:LINE_KEEP] + _hidden(len(line) - 2 * LINE_KEEP) + line[-LINE_KEEP:]
    return line


class _LineBuffer:
    """One rank's unfinished line on one stream.

    Its first and last :data:`LINE_KEEP` characters are kept and the middle only counted, so a
    100 MB line without a newline costs O(LINE_KEEP) memory and O(n) time overall (``str +=`` on
    a growing line would copy the whole line for every chunk: quadratic).
    """

    __slots__ = ("head", "head_len", "tail", "tail_len", "total", "cr")

    def __init__(self) -> None:
        self._clear()
        self.cr = False  # the kept text ends with a carriage return: what comes next overwrites it

    def _clear(self) -> None:
        self.head: list[str] = []
        self.head_len = 0
        self.tail: deque[str] = deque()
        self.tail_len = 0
        self.total = 0

    def add(self, piece: str) -> None:
        """Append text that holds no newline."""
        if not piece:
            return
        body = piece.rstrip("\r")
        cut = body.rfind("\r")
        if cut >= 0:  # "\rnew text" overwrites the line so far (progress bars): keep only the latest
            self._clear()
            body = body[cut + 1 :]
        elif self.cr and body:
            self._clear()
        if len(body) != len(piece):
            self.cr = True
        elif body:
            self.cr = False
        self._append(body)

    def _append(self, body: str) -> None:
        if not body:
            return
        self.total += len(body)
        room = LINE_KEEP - self.head_len
        if room > 0:
            self.head.append(body[:room])
            self.head_len += min(room, len(body))
            body = body[room:]
            if not body:
                return
        if self.tail and len(self.tail[-1]) < _MERGE_BELOW:
            self.tail[-1] += body
        else:
            self.tail.append(body)
        self.tail_len += len(body)
        # Drop whole pieces from the left while the rest still covers LINE_KEEP characters; the
        # boundary piece is trimmed only when the line is rendered, so no chunk is copied twice.
        while self.tail and self.tail_len - len(self.tail[0]) >= LINE_KEEP:
            self.tail_len -= len(self.tail.popleft())

    def text(self) -> str:
        head = "".join(self.head)
        tail = "".join(self.tail)[-LINE_KEEP:]
        hidden = self.total - len(head) - len(tail)
        return head + (_hidden(hidden) if hidden > 0 else "") + tail


class LivePrinter:
    """Buffers per-rank output from any thread; :meth:`flush` prints grouped lines.

    ``ranks``: the cell's ranks; when given, lines not printed by every (living) rank of the cell
    are passed to :meth:`_emit` with ``differs=True`` (the widget view marks them; printed text
    keeps its ``[rank 1] …`` label, which already says whose line it is).
    """

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        hold: float = 0.15,
        max_lines: int = 20_000,
        max_chars: int = 4 << 20,
        ranks: Iterable[int] | None = None,
    ) -> None:
        self._out = out
        self._err = err
        self._hold = hold
        self._max_lines = max_lines
        self._max_chars = max_chars
        # Shared with the I/O thread (under _lock): raw chunks, displays and notes not yet flushed.
        self._lock = threading.Lock()
        self._raw: list[tuple[int, str, str]] = []
        self._raw_chars = 0
        self._displays: list[tuple[int, dict[str, str]]] = []
        self._notes: list[str] = []
        self._oldest: float | None = None
        self._saturated = False  # the view is full (or the backlog is): later chunks are only counted
        self._dropped: dict[tuple[int, str], bool] = {}  # (rank, stream) → its last dropped text ended mid-line
        self._closed = False  # after the final flush nothing more is kept
        self._expected: set[int] | None = set(ranks) if ranks is not None else None
        # A cell on many ranks merges lines that differ only in numbers even in a flush that
        # holds few of them, so that its view reads the same from one flush to the next.
        self._many = self._expected is not None and len(self._expected) > SUMMARY_ABOVE
        self.merged = False  # a merged line was shown (MERGED_NOTE said once, with the first)
        self.odd: dict[int, None] = {}  # ranks the merged lines singled out, in order (a view gives them a tab)
        # Only the flushing thread touches these.
        self._flush_lock = threading.Lock()
        self._partial: dict[tuple[int, str], _LineBuffer] = {}
        # A rank killed by a signal streams Python's crash dump (20 lines and more) just before its
        # death report says it, cut to the cell's frames: streamed, it is folded to its first line.
        self._dumps: dict[int, CrashDumpFold] = {}
        self._repeats = Repeats()
        self.lines_printed = 0
        self.chars_printed = 0
        self.capped = 0  # rank output lines not shown because of the caps (under _lock)
        self.displays_seen = 0
        self.displays_shown = 0
        self.displays_capped = 0
        self.announced: set[str] = set()

    # -- called on the I/O thread: append and count, nothing more --------------------------------
    def feed(self, rank: int, stream: str, text: str) -> None:
        """Called on the I/O thread for each chunk of output."""
        if not text:
            return
        with self._lock:
            if self._closed:
                return  # the view is done; the cell's result keeps the output
            if not self._saturated and (
                self._raw_chars + len(text) > self._max_chars
                or self.lines_printed >= self._max_lines
                or self.chars_printed >= self._max_chars
            ):
                # Full, or the flushing thread is far behind: from here on only count, so that
                # memory stays bounded and what was shown stays a clean prefix of the output.
                self._saturated = True
            if self._saturated:
                self.capped += text.count("\n")
                self._dropped[(rank, stream)] = not text.endswith("\n")
                return
            self._raw.append((rank, stream, text))
            self._raw_chars += len(text)
            if self._oldest is None:
                self._oldest = time.monotonic()

    def display_bundle(self, rank: int, bundle: dict[str, str]) -> None:
        """A rank called ``display()``: shown by the next :meth:`flush` (its text/plain, labelled)."""
        with self._lock:
            if self._closed:
                return
            self.displays_seen += 1
            if len(self._displays) >= MAX_DISPLAYS:
                self.displays_capped += 1
                return
            self._displays.append((rank, bundle))
            if self._oldest is None:
                self._oldest = time.monotonic()

    def rank_done(self, result: RankResult) -> None:
        """Called on the I/O thread as each rank finishes; a death is announced at once."""
        if result.status == CellStatus.DEAD:
            with self._lock:
                self._notes.append(result.death_text())
                if self._expected is not None:
                    # Its silence from now on is no difference worth marking in the others' lines.
                    self._expected.discard(result.rank)

    # -- called on the waiting thread -----------------------------------------------------------
    def flush(self, final: bool = False) -> None:
        """Print what is ready; ``final`` prints everything, partial lines included, and closes
        the printer (later output is dropped: the cell's result has it)."""
        with self._flush_lock:
            self._flush(final)

    def _flush(self, final: bool) -> None:
        with self._lock:
            notes, self._notes = self._notes, []
        for note in notes:
            self.announced.add(note)
            self._emit_note(note)
        with self._lock:
            if not final and (self._oldest is None or time.monotonic() - self._oldest < self._hold):
                return  # let other ranks catch up so identical lines group
            raw, self._raw, self._raw_chars, self._oldest = self._raw, [], 0, None
            displays, self._displays = self._displays, []
            expected = None if self._expected is None else set(self._expected)
            dropped = dict(self._dropped) if final else {}
            if final:
                self._closed = True
        pending = self._split(raw)
        capped = 0
        if final:
            for key, buf in sorted(self._partial.items()):
                # A line whose end was dropped is counted with the dropped text, not printed cut.
                if key not in dropped and buf.total:
                    pending.setdefault(key[0], []).append((key[1], buf.text()))
            capped += sum(dropped.values())  # unfinished last lines among the dropped text
            self._partial.clear()
        for stream in ("stdout", "stderr"):
            per_rank = {r: [line for s, line in ls if s == stream] for r, ls in sorted(pending.items())}
            if stream == "stderr":
                per_rank = {r: self._dumps.setdefault(r, CrashDumpFold(r)).lines(ls) for r, ls in per_rank.items()}
            written, per_rank = per_rank, {r: self._repeats.fold(stream, r, ls) for r, ls in per_rank.items()}
            if self.lines_printed < self._max_lines:  # past the cap nothing is "printed above"
                for r, ls in written.items():
                    self._repeats.printed(stream, r, ls)
            # Line i of every rank that has one, grouped: extra lines on one rank don't split the rest.
            for i in range(max((len(ls) for ls in per_rank.values()), default=0)):
                items = [(r, ls[i]) for r, ls in per_rank.items() if i < len(ls)]
                rows: list[tuple[list[int], str]]
                if self._many or len(items) > SUMMARY_ABOVE:
                    merged = merge_rows(items)
                    if merged.merged and not self.merged:
                        self.merged = True
                        self._emit_note(MERGED_NOTE.removeprefix("[distnb] "))
                    for r in merged.odd[: max(0, MAX_ODD - len(self.odd))]:
                        self.odd[r] = None
                    rows = merged
                else:
                    rows = group_by(items)
                for ranks, line in rows:
                    text = f"[{format_ranks(ranks)}{' stderr' if stream == 'stderr' else ''}] {line}"
                    if self.lines_printed >= self._max_lines or self.chars_printed >= self._max_chars:
                        capped += len(ranks)
                        continue
                    self.lines_printed += 1
                    self.chars_printed += len(text)
                    self._emit(stream, text, expected is not None and not expected <= set(ranks))
        for ranks, bundle in group_by(displays):
            if self.displays_shown >= MAX_DISPLAYS or self.chars_printed >= self._max_chars:
                with self._lock:
                    self.displays_capped += len(ranks)
                continue
            self.displays_shown += len(ranks)
            self.chars_printed += len(bundle.get("text/plain", ""))
            self._emit_display(ranks, bundle)
        if capped:
            with self._lock:
                self.capped += capped

    def _split(self, raw: list[tuple[int, str, str]]) -> dict[int, list[tuple[str, str]]]:
        """Raw chunks → each rank's complete lines, in order; unfinished lines stay buffered."""
        pending: dict[int, list[tuple[str, str]]] = {}
        for rank, stream, text in raw:
            *lines, rest = text.split("\n")
            if lines:
                buf = self._partial.pop((rank, stream), None)
                if buf is not None:
                    buf.add(lines[0])
                    lines[0] = buf.text()
                else:
                    lines[0] = clip_line(lines[0])
                out = pending.setdefault(rank, [])
                out.append((stream, lines[0]))
                out.extend((stream, clip_line(line)) for line in lines[1:])
            if rest:
                self._partial.setdefault((rank, stream), _LineBuffer()).add(rest)
        return pending

    # -- where things go: printed here; the widget view overrides these --------------------------
    def _emit(self, stream: str, text: str, differs: bool) -> None:
        target = (self._err or sys.stderr) if stream == "stderr" else (self._out or sys.stdout)
        print(text, file=target)

    def _emit_note(self, note: str) -> None:
        print(f"[distnb] {note}", file=self._err or sys.stderr)

    def _emit_display(self, ranks: list[int], bundle: dict[str, str]) -> None:
        text = prefix_lines(f"display {format_ranks(ranks)}", bundle.get("text/plain", ""))
        if text:
            print(text, file=self._out or sys.stdout)

    # -- after the cell -------------------------------------------------------------------------
    def cap_note(self) -> str:
        """What the caps left out and where it is; "" when nothing was."""
        with self._lock:
            capped, displays = self.capped, self.displays_capped
        parts = []
        if capped:
            parts.append(
                f"{capped:,} more output lines were not shown (the view keeps {self._max_lines:,} lines, "
                f"{self._max_chars >> 20 or 1} MB)"
            )
        if displays:
            parts.append(f"{displays:,} display{'s' * (displays != 1)} not shown (the view keeps {MAX_DISPLAYS})")
        if not parts:
            return ""
        where = []
        if capped:
            where.append(f"each rank's first {kept_per_stream()} per stream in _dist[rank].stdout / .stderr")
        if displays:
            where.append("every display in _dist[rank].displays")
        return f"[distnb] {'; '.join(parts)}; the cell's result (_dist) keeps {' and '.join(where)}."

    def outcome_text(self, result: CellResult) -> str:
        """The cell's outcome without what was already shown live: death notes and, when every
        display of the cell was shown, the displays."""
        outcome = result.outcome_text()
        for note in self.announced:
            outcome = _remove_once(outcome, note)
        displays = sum(len(r.displays) for r in result.results.values())
        if displays and self.displays_seen == displays and not self.displays_capped:
            # The same blocks CellResult.outcome_text writes (tests/test_widgets.py checks they match).
            for block in result.display_texts():
                outcome = _remove_once(outcome, block)
        return outcome.strip("\n")


def _remove_once(text: str, part: str) -> str:
    if not part:
        return text
    if part + "\n" in text:
        return text.replace(part + "\n", "", 1)
    return text.replace(part, "", 1)


class StartProgress:
    """One updating line while the pool starts (a display handle in a kernel, lines elsewhere)."""

    def __init__(self, in_kernel: bool) -> None:
        self._start = time.monotonic()
        self._handle: Any = None
        self._in_kernel = in_kernel
        self._last: dict[str, list[int]] = {}

    def __call__(self, stages: dict[int, RankState]) -> None:
        counts = stage_counts(stages)
        if counts == self._last:
            return
        self._last = counts
        text = stage_summary(stages, time.monotonic() - self._start)
        if self._in_kernel:
            from IPython.display import display

            bundle = {"text/plain": text}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        else:
            print(text)
