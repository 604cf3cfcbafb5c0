"""Stack reports: where every rank is right now, grouped across ranks."""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass, field
from typing import Any

from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by

__all__ = ["Frame", "ThreadStack", "RankStack", "StackReport", "parse_faulthandler", "short_path"]

_DISTNB_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # distnb/
# Frames that only say "Python started a thread/module": noise in every stack.
_BOOTSTRAP = ("<frozen runpy>", "/runpy.py", "/threading.py")


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    name: str
    line: str = ""

    @property
    def is_cell(self) -> bool:
        return self.filename.startswith("<cell-")

    @property
    def cell(self) -> int | None:
        """The cell a frame's code came from (``<cell-3>`` → 3)."""
        try:
            return int(self.filename[len("<cell-") : -1]) if self.is_cell else None
        except ValueError:
            return None

    @property
    def is_internal(self) -> bool:
        return self.filename.startswith(_DISTNB_DIR) or "/distnb/worker/" in self.filename or self.filename.endswith(_BOOTSTRAP)

    def text(self) -> str:
        where = f"{cell_name(self.cell)} line {self.lineno}" if self.is_cell else f"{short_path(self.filename)}:{self.lineno}"
        return f"{where} in {self.name}" + (f": {self.line.strip()}" if self.line.strip() else "")


def short_path(path: str) -> str:
    """``…/site-packages/torch/x.py`` → ``torch/x.py``."""
    for marker in ("site-packages/", "dist-packages/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    m = _STDLIB_RE.search(path)
    return path[m.end() :] if m else path


@dataclass
class ThreadStack:
    name: str
    main: bool
    frames: list[Frame]  # outermost first
    # The main thread runs the user's own program (an attached job), not distnb's serve loop.
    program: bool = False

    def user_frames(self) -> list[Frame]:
        if self.main and not self.program:
            # On the main thread everything outside a cell is distnb's serve loop.
            first = next((i for i, f in enumerate(self.frames) if f.is_cell), None)
            return [] if first is None else [f for f in self.frames[first:] if not f.is_internal]
        return [f for f in self.frames if not f.is_internal]


@dataclass
class RankStack:
    rank: int
    state: str  # idle · running cell k · dead: … · no answer (durations apart, in state_since)
    source: str  # "control thread", "faulthandler", or why there is no stack
    threads: list[ThreadStack] = field(default_factory=list)
    annotation: str = ""  # e.g. the collective the rank is in
    native: str = ""
    state_since: float | None = None  # seconds in that state (a running cell)
    annotation_since: float | None = None  # seconds in that collective, by the rank's clock
    paused: dict[str, Any] | None = None  # waiting for the notebook's line (pdb, input()): kind, where, since
    cpu: float | None = None  # the share of one CPU its main thread used lately (None: not known)

    @property
    def state_text(self) -> str:
        return self.state + (f" for {self.state_since:.1f} s" if self.state_since is not None else "")

    @property
    def annotation_text(self) -> str:
        return self.annotation + (f" for {self.annotation_since:.1f} s" if self.annotation and self.annotation_since is not None else "")

    def signature(self) -> tuple[Any, ...]:
        """What makes two ranks' stacks 'the same' for grouping: where, never for how long."""
        return (
            self.state,
            self.annotation,
            tuple((t.name, tuple((f.filename, f.lineno, f.name) for f in t.user_frames())) for t in self.threads),
        )

    def body(self) -> list[str]:
        lines = []
        for t in self.threads:
            frames = t.user_frames()
            if len(self.threads) > 1 or not t.main:
                lines.append(f"  thread {t.name}{' (main)' if t.main else ''}:")
            if not frames:
                lines.append("    (idle: waiting for a cell)" if t.main and not t.program else "    (no Python frames outside distnb)")
            lines.extend(f"    {f.text()}" for f in frames)
        if self.native:
            lines.append("  native (py-spy):")
            lines.extend(f"    {line}" for line in self.native.rstrip().splitlines())
        return lines


@dataclass
class StackReport:
    """Stacks of a set of ranks; ranks with identical stacks are shown once."""

    ranks: list[RankStack]

    def __getitem__(self, rank: int) -> RankStack:
        by_rank: dict[int, RankStack] | None = self.__dict__.get("_by_rank")
        if by_rank is None or len(by_rank) != len(self.ranks):  # built once; again if ranks were added
            by_rank = self.__dict__["_by_rank"] = {r.rank: r for r in self.ranks}
        return by_rank[rank]

    def groups(self) -> list[tuple[list[int], RankStack]]:
        by_sig = group_by((r.rank, r.signature()) for r in self.ranks)
        first = {r.rank: r for r in self.ranks}
        return [(ranks, first[ranks[0]]) for ranks, _sig in by_sig]

    def text(self) -> str:
        out = [f"stacks of {format_ranks([r.rank for r in self.ranks])} (most recent call last)"]
        for ranks, rs in self.groups():
            head = f"── {format_ranks(ranks)}: {rs.state_text}"
            if rs.annotation:
                head += f" — {rs.annotation_text}"
            if rs.source != "control thread":
                head += f" [{rs.source}]"
            out.append(head)
            out.extend(rs.body())
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def frames_from_wire(frames: list[tuple[str, int | None, str, str]]) -> list[Frame]:
    # A frame between two instructions that carry no location (a call being set up, code a tool
    # generated) has no line number (None on Python 3.11+): 0, "no line", rather than no stack.
    return [Frame(fn, int(ln) if ln is not None else 0, name, line or "") for fn, ln, name, line in frames]


_STDLIB_RE = re.compile(r"/lib/python3\.\d+/")
_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
#: One thread's dump (``all_threads=False``): the rank's SIGUSR1 dump is its main thread's own.
_ONE_THREAD_RE = re.compile(r"^Stack \(most recent call first\):")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str, cell_sources: dict[str, str] | None = None, main_ident: int | None = None) -> list[ThreadStack]:
    """Parse ``faulthandler.dump_traceback`` output (most recent call first) into stacks: every
    thread's, or the one thread's of a dump without thread headers (taken as the main thread: the
    rank's SIGUSR1 dump is made on, and of, its main thread)."""
    threads: list[ThreadStack] = []
    current: list[Frame] | None = None
    for raw in text.splitlines():
        m = _THREAD_RE.match(raw)
        if m or _ONE_THREAD_RE.match(raw):
            current = []
            name = m.group(2) if m else (hex(main_ident) if main_ident is not None else "MainThread")
            threads.append(ThreadStack(name=name, main=False, frames=current))
            continue
        m = _FRAME_RE.match(raw)
        if m and current is not None:
            filename, lineno, name = m.group(1), int(m.group(2)), m.group(3)
            current.append(Frame(filename, lineno, name, _source_line(filename, lineno, cell_sources)))
    for t in threads:
        t.frames.reverse()
        t.main = main_ident is not None and t.name.startswith("0x") and int(t.name, 16) == main_ident
    if threads and not any(t.main for t in threads):
        threads[-1].main = True  # faulthandler lists the oldest thread, the main one, last
    threads.sort(key=lambda t: not t.main)
    return threads


def _source_line(filename: str, lineno: int, cell_sources: dict[str, str] | None) -> str:
    if cell_sources and filename in cell_sources:
        lines = cell_sources[filename].splitlines()
        return lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    return linecache.getline(filename, lineno)
