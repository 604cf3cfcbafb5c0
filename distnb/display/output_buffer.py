"""What one Output widget shows, kept on distnb's side: appended to from any thread, assigned to
the widget at most once per sync, capped in characters and lines with a note saying what the caps
left out, and synced at a pace its size sets (ipywidgets re-sends an Output's whole ``outputs`` on
each change). Progress bars' carriage returns overwrite as a terminal's would."""

from __future__ import annotations

import html
import itertools
import threading
from typing import Any, Callable

__all__ = ["OutputBuffer", "SYNC_RATE", "note_entry", "overwrite_cr"]

#: An Output widget is re-sent whole on each change, so one is synced at most every
#: (characters it shows) / SYNC_RATE seconds: about SYNC_RATE characters a second per widget
#: however long the cell runs, instead of a full copy ten times a second.
SYNC_RATE = 1 << 20


def note_entry(note: str) -> dict[str, Any]:
    return {
        "output_type": "display_data",
        "data": {"text/plain": note, "text/html": f"<div style='color:#9a6700;font-family:monospace;white-space:pre-wrap'>{html.escape(note)}</div>"},
        "metadata": {},
    }


def overwrite_cr(text: str) -> str:
    """Text as a terminal leaves it: within a line, what follows a carriage return overwrites what
    came before (progress bars). A trailing "\r" stays, so the next chunk overwrites that line."""
    if "\r" not in text:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if "\r" in line:
            body = line.rstrip("\r")
            lines[i] = body[body.rfind("\r") + 1 :] + line[len(body) :]
    return "\n".join(lines)


class OutputBuffer:
    """What one Output widget shows, kept on our side so each sync assigns ``outputs`` once.

    ``add_*`` run on any thread with the view's lock held and only append and count (the backlog
    is bounded too, in case nobody syncs); :meth:`sync` runs on the waiting thread, merges text
    into the last entry (so the tuple stays short), applies progress-bar overwrites, then the caps.
    """

    def __init__(self, widget: Any, max_chars: int, max_lines: int | None, note: Callable[[], str]) -> None:
        self.widget = widget
        self._note = note  # the note shown under the output: what the caps left out, and where it is
        self.max_chars = max_chars
        self.max_lines = max_lines
        self.entries: list[dict[str, Any]] = []
        self.pending: list[tuple[str, Any]] = []  # ("stdout"/"stderr", text) or ("display", bundle)
        self.pending_chars = 0
        self.shown_chars = 0
        self.shown_lines = 0
        # Under the view's lock: set and counted from both threads.
        self.full = False
        self.dropped_chars = 0
        self.dropped_lines = 0
        self.dropped_displays = 0
        self._shown_note = ""
        self._last_sync = 0.0
        self._synced_chars = 0
        self.syncs = 0  # how many times ``outputs`` was assigned (tests check the batching)

    def add_text(self, stream: str, text: str) -> None:
        keep = "" if self.full else text[: self.max_chars - self.pending_chars]
        if len(keep) < len(text):
            # Full, or nobody syncs (the waiting thread is gone or far behind): only count from
            # here on, so memory stays bounded and what is shown stays a clean prefix.
            self.full = True
            rest = text[len(keep) :]
            self.dropped_chars += len(rest)
            self.dropped_lines += rest.count("\n")
        if keep:
            self.pending.append((stream, keep))
            self.pending_chars += len(keep)

    def add_display(self, bundle: dict[str, str]) -> None:
        size = sum(len(v) for v in bundle.values())
        if self.full or self.pending_chars + size > self.max_chars:
            self.dropped_displays += 1
            return
        self.pending.append(("display", bundle))
        self.pending_chars += size

    def sync(self, lock: threading.Lock, now: float, final: bool) -> None:
        with lock:
            if not final and now - self._last_sync < self._synced_chars / SYNC_RATE:
                return  # it waits in pending (bounded) until the widget is due
            pending, self.pending, self.pending_chars = self.pending, [], 0
        for kind, group in itertools.groupby(pending, key=lambda p: p[0]):
            if kind == "display":
                for _, bundle in group:
                    size = sum(len(v) for v in bundle.values())
                    if self.shown_chars + size > self.max_chars:
                        with lock:
                            self.dropped_displays += 1  # too big for what is left; smaller output may still fit
                        continue
                    self.entries.append({"output_type": "display_data", "data": dict(bundle), "metadata": {}})
                    self.shown_chars += size
            else:
                self._add_stream(lock, kind, "".join(t for _, t in group))  # one copy per run, not per chunk
        note = self._note()  # after the caps above, which may have just left something out
        if not pending and note == self._shown_note:
            return
        outputs = tuple(self.entries) + ((note_entry(note),) if note else ())
        self.widget.outputs = outputs
        self._shown_note = note
        self._last_sync = now
        self._synced_chars = self.shown_chars + len(note)
        self.syncs += 1

    def _add_stream(self, lock: threading.Lock, name: str, text: str) -> None:
        last = self.entries[-1] if self.entries else None
        if last is None or last.get("output_type") != "stream" or last.get("name") != name:
            last = None
        old = last["text"] if last is not None else ""
        cut = old.rfind("\n") + 1
        head, tail = old[:cut], old[cut:]  # the last, unfinished line may be overwritten by a "\r"
        combined = overwrite_cr(tail + text)
        base_chars = self.shown_chars - len(tail)
        keep = combined[: max(0, self.max_chars - base_chars)]
        n = keep.count("\n")
        if self.max_lines is not None and self.shown_lines + n > self.max_lines:
            idx = -1
            for _ in range(self.max_lines - self.shown_lines):  # end after the last line that fits
                idx = keep.find("\n", idx + 1)
            keep, n = keep[: idx + 1], self.max_lines - self.shown_lines
        if len(keep) < len(combined):
            rest = combined[len(keep) :]
            with lock:
                self.full = True
                self.dropped_chars += len(rest)
                self.dropped_lines += rest.count("\n")
        self.shown_chars = base_chars + len(keep)
        self.shown_lines += n
        if last is not None:
            # A new dict: traitlets sees a change only if the new tuple differs from the old.
            self.entries[-1] = {**last, "text": head + keep}
        elif keep:
            self.entries.append({"output_type": "stream", "name": name, "text": keep})
