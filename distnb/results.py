"""What a cell gives back: its result per rank and in all (each with a plain-text form that stands
alone and names its ranks), and the callbacks that stream it while it runs. (What replay and export
keep of old cells and pushes is the session log's: ``controller/session.py``.)"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distnb._processes import signal_meaning
from distnb._text import MAX_ROWS, MERGED_NOTE, Rows, merge_lines, merge_rows, prefix_lines
from distnb.analysis.render import blame_words
from distnb.analysis.reports.nccl_dumps import watchdog_cause
from distnb.analysis.verdicts.failures import cut_message, differing_messages, fold_crash_dump, holders_words, is_timeout, salient_lines
from distnb.analysis.verdicts.records import is_consequence
from distnb.analysis.verdicts.verdict import Blame, Verdict
from distnb.cell_names import cell_name, name_cells_in
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by
from distnb.states import CellStatus
from distnb.wire.record_types import CellError, NumericsRecord, SyncState, ThreadError

__all__ = [
    "CellEvents",
    "CellResult",
    "RankResult",
    "ranks_label",
]


_DIGITS = re.compile(r"\d+")
#: Above SUMMARY_ABOVE ranks: deaths told in full (the first first), and error groups shown with
#: their traceback; the others are one line each, grouped, and the result keeps every one.
MAX_POST_MORTEMS = 3
MAX_TRACEBACKS = 3
#: A header names its ranks in at most about this many characters: every 8th of 4,096 ranks is
#: ~2,500 of them, past a title's length (the result's ``ranks`` lists them all).
HEADER_RANKS_CHARS = 200


def ranks_label(ranks: list[int]) -> str:
    """A cell's ranks for its header: ``ranks 0-1023``, or for a scattered set past
    HEADER_RANKS_CHARS, ``512 ranks (0,8,16,…)``."""
    label = format_ranks(ranks)
    if len(label) <= HEADER_RANKS_CHARS:
        return label
    return f"{len(ranks):,} ranks ({label.removeprefix('ranks ')[:HEADER_RANKS_CHARS].rsplit(',', 1)[0]},…)"


def _output_size(r: RankResult) -> int:
    return len(r.stdout) + len(r.stderr) + sum(len(v) for d in r.displays for v in d.values())


class _Output:
    """A text field that grows chunk by chunk and is joined when read.

    A rank's output reaches the notebook in as many chunks as the rank made writes (20,000 for a
    loop that prints 20,000 lines): adding each chunk to a ``str`` copied everything before it,
    which took ~1 s of such a cell at 8 ranks."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = "_" + name

    def __get__(self, obj: object | None, objtype: type | None = None) -> str:
        if obj is None:
            return ""  # the dataclass's default
        parts: list[str] = obj.__dict__[self._key]
        n = len(parts)
        if n <= 1:
            return parts[0] if parts else ""
        # The I/O thread may append meanwhile: replace only the chunks joined, each step atomic.
        joined = "".join(parts[:n])
        parts[:n] = [joined]
        return joined

    def __set__(self, obj: object, value: str) -> None:
        obj.__dict__[self._key] = [value] if value else []


@dataclass
class CellEvents:
    """Callbacks for a running cell; all are called on distnb's I/O thread and must be quick."""

    on_output: Callable[[int, str, str], None] | None = None  # (rank, "stdout"/"stderr", text)
    on_display: Callable[[int, dict[str, str]], None] | None = None
    on_rank_done: Callable[[RankResult], None] | None = None


@dataclass
class RankResult:
    """What one rank did with one cell."""

    rank: int
    status: CellStatus = CellStatus.RUNNING
    stdout: _Output = _Output()
    stderr: _Output = _Output()
    value: dict[str, str] | None = None
    error: CellError | None = None
    duration: float | None = None
    displays: list[dict[str, str]] = field(default_factory=list)
    returncode: int | None = None
    finished_at: float | None = None
    output_truncated: int = 0
    released: int = 0  # characters of output let go after the cell, as later cells came (see distnb.controller.session)
    stderr_tail: str = ""  # a dead rank's last stderr lines (from its supervisor)
    memory: dict[str, Any] | None = None  # RSS/CUDA/NVML sampled at the cell's start and end
    first_death: bool = False
    collective: str = ""  # the collective a dead (or stranded) rank was in, from its last polled log
    cause: str = ""  # why it died when no exit code tells (its machine lost)
    direct: bool = False  # its CELL_DONE came straight from the rank (a silent cell), not via its supervisor
    profile: dict[str, Any] | None = None  # with --profile: what worker/recorders/profiling.py measured
    comms: dict[str, Any] | None = None  # with --comms: what worker/torch_hooks/comms.py accounted
    numerics: NumericsRecord | None = None  # with --numerics: the rank's ops (worker/torch_hooks/numerics.py)
    sync: SyncState | None = None  # collectives issued per group at the cell's end (worker/torch_hooks/group_state.py)
    paths: dict[str, Any] | None = None  # which notebook lines ran, as transitions (worker/recorders/paths.py)
    compiles: dict[str, Any] | None = None  # torch.compile's frames compiled, recompiles, graph breaks (worker/torch_hooks/compile_record.py)
    threads: list[ThreadError] = field(default_factory=list)  # the rank's other threads' uncaught exceptions in the cell
    imported: list[str] = field(default_factory=list)  # torch's modules it imported first (a fresh rank's zygote loads them)

    def add_output(self, stream: str, text: str) -> None:
        """Append ``text`` to ``stream`` (``"stdout"`` or ``"stderr"``) without copying what is there."""
        self.__dict__["_" + stream].append(text)

    def death_reason(self) -> str:
        """Why the rank died, in words: its signal or exit code, and the cause where one is known."""
        why = signal_meaning(self.returncode) if self.returncode is not None else ""
        return f"{why}; {self.cause}" if why and self.cause else why or self.cause or "gone without an exit report"

    def death_text(self) -> str:
        """Post-mortem of a rank that died during the cell."""
        first = " first" if self.first_death else ""
        text = f"rank {self.rank} died{first}: {self.death_reason()}"
        watchdog = watchdog_cause(self.stderr_tail or self.stderr)
        if watchdog:
            text += f" — {watchdog}"
        if self.collective:
            text += f", while in {self.collective}"
        tail = "\n".join(salient_lines(self.stderr_tail or self.stderr))
        if tail:
            text += f"; its last stderr lines:\n{prefix_lines(f'rank {self.rank} stderr', tail)}"
        return text

    @property
    def value_text(self) -> str | None:
        return None if self.value is None else self.value.get("text/plain", "")


@dataclass
class CellResult:
    """The outcome of one cell on a set of ranks (``Pool.run``'s return value)."""

    cell: int
    code: str
    ranks: list[int]
    results: dict[int, RankResult]
    started: float = field(default_factory=time.time)
    elapsed: float = 0.0
    timed_out: bool = False
    user_interrupted: bool = False  # Ctrl-C (or pool.interrupt from the waiting thread) while the notebook waited
    detached: bool = False  # the caller stopped waiting (second interrupt) with ranks busy
    notes: list[str] = field(default_factory=list)
    # Who caused a death when it was not the rank that died (a mismatch gloo aborted a neighbour
    # for), or a timeout (the ranks that never came): in words, shown right after the
    # post-mortems, and as data (``blamed``), which the one line of CellFailed names.
    root_cause: str = ""
    blamed: Blame | None = None
    # Ranks that finished the cell with different collective or group-creation counts
    # (sync_check.CountMismatch), and the words for them, with the entries involved.
    desync: list[Any] = field(default_factory=list)
    desync_note: str = ""
    # The first decision in the notebook's code that ranks took differently (analysis/paths.py), in
    # words: after a failure or desync, why; in a cell that finished alike, a quiet note.
    path_note: str = ""
    # torch.compile did something else on some ranks in this cell (analysis/compiles.py), in words.
    compile_note: str = ""
    # The diagnosis of the ended cell when it failed or desynced (services.inspector.conclude):
    # what the report, the live view and CellFailed name as its cause.
    verdict: Verdict | None = None
    # Memory of ranks still running when another ran out of memory (asked live at that moment).
    live_memory: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The notebook's In[n] of the cell that ran it (%%on_ranks), None from Python: what export's
    # --cells and its summary speak in.
    label: int | None = None

    # -- convenience ----------------------------------------------------------------------------
    def __getitem__(self, rank: int) -> RankResult:
        return self.results[rank]

    @property
    def ok(self) -> bool:
        return all(r.status == CellStatus.OK for r in self.results.values())

    def blame_words(self) -> str:
        """Whom the diagnosis blamed, in the renderer's words (``root cause: likely rank 2``); "" for none."""
        return blame_words(self.blamed) if self.blamed is not None else ""

    @property
    def imported(self) -> list[str]:
        """torch's modules any rank imported first in this cell, in order, once each."""
        return list(dict.fromkeys(m for r in self.results.values() for m in r.imported))

    @property
    def running(self) -> list[int]:
        return sorted(r.rank for r in self.results.values() if r.status == CellStatus.RUNNING)

    @property
    def failed(self) -> list[int]:
        return sorted(r.rank for r in self.results.values() if r.status in (CellStatus.ERROR, CellStatus.INTERRUPTED, CellStatus.DEAD))

    @property
    def values(self) -> dict[int, str | None]:
        """Each rank's last-expression value as text (``None`` where there was none)."""
        return {r: res.value_text for r, res in sorted(self.results.items())}

    @property
    def stdout(self) -> dict[int, str]:
        return {r: res.stdout for r, res in sorted(self.results.items())}

    # -- text -----------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """running · timed out · detached · ok · failed"""
        if self.running:
            return "timed out" if self.timed_out else ("detached" if self.detached else "running")
        return "ok" if self.ok else "failed"

    def header(self) -> str:
        done = sum(1 for r in self.results.values() if r.status != CellStatus.RUNNING)
        return f"{cell_name(self.cell)} on {ranks_label(self.ranks)}: {self.state}, {done}/{len(self.ranks)} done, {self.elapsed:.2f} s"

    def output_rows(self) -> list[tuple[str, Rows]]:
        """Each stream's output as rows of ``(ranks, line)``, each line once for the ranks that
        share it (above SUMMARY_ABOVE ranks, lines that differ only in numbers merged, with the
        odd ranks named: :func:`~distnb._text.merge_lines`)."""
        out = []
        for stream in ("stdout", "stderr"):
            items = [(r.rank, fold_crash_dump(text, r.rank) if r.status == CellStatus.DEAD and stream == "stderr" else text)
                     for r in self._ordered() for text in [str(getattr(r, stream))] if text]
            out.append((stream, merge_lines(items)))
        return out

    def output_text(self, rows: list[tuple[str, Rows]] | None = None) -> str:
        """The output grouped across ranks; ``rows``: :meth:`output_rows`, where the caller has them."""
        parts: list[str] = []
        merged = False
        for stream, lines in self.output_rows() if rows is None else rows:
            suffix = "" if stream == "stdout" else " stderr"
            parts.extend(f"[{format_ranks(ranks)}{suffix}] {line}" for ranks, line in lines)
            merged = merged or lines.merged
        if merged:
            parts.append(MERGED_NOTE)
        return "\n".join(parts)

    def outcome_text(self) -> str:
        """Values, errors, deaths and still-running ranks: everything but the streamed output."""
        parts = self.display_texts()
        parts.extend(self._value_texts())
        # Root cause first: a death usually explains the errors of the ranks that waited for it.
        dead = [r for r in sorted(self._ordered(), key=lambda r: not r.first_death) if r.status == CellStatus.DEAD]
        if self.root_cause:  # a death's true cause (a victim of gloo's abort) or a timeout's blame
            parts.append(self.root_cause)
        parts.extend(self._death_texts(dead))
        if dead:
            others = group_by(
                (r.rank, f"raised {r.error['ename']}" if r.error else f"stranded in {r.collective}" if r.status == CellStatus.STRANDED
                 else {"ok": "finished the cell", "running": "still running"}.get(r.status, r.status))
                for r in self._ordered() if r.status != CellStatus.DEAD
            )
            if others:
                parts.append("what became of the others: " + "; ".join(
                    f"{format_ranks(rs)} {'is' if len(rs) == 1 else 'are'} {what}" if what == "still running" else f"{format_ranks(rs)} {what}"
                    for rs, what in others))
        parts.extend(self._error_texts())
        stale = {n: k for r in self.results.values() if r.error for n, k in (r.error.get("stale") or {}).items()}
        if stale:
            ranks = [r.rank for r in self.results.values() if r.error and r.error.get("stale")]
            parts.append(f"[distnb] likely why {format_ranks(ranks)} failed on a closed group: a rebuild of the process group "
                         f"(an interrupt, a regroup) closed the one these still hold — {holders_words(stale)}.")
        if self.desync_note:
            parts.append("[distnb] desync at the end of the cell: " + self.desync_note)
        if self.path_note:
            parts.append("[distnb] " + self.path_note)
        if self.compile_note:
            parts.append("[distnb] " + self.compile_note)
        if any(r.error and "OutOfMemoryError" in r.error.get("ename", "") for r in self.results.values()):
            from distnb.analysis.reports.memory import MemoryReport

            samples = {r.rank: r.memory for r in self._ordered() if r.memory}
            # Ranks still blocked (waiting for the one that failed) have no end-of-cell sample:
            # their memory as asked the moment the error arrived stands in for it.
            merged = {**self.live_memory, **samples}
            parts.append("out of memory — every rank's memory for comparison:\n" + MemoryReport(merged, [(self.cell, merged)]).text())
        if any(r.error and is_timeout(r.error) for r in self.results.values()):
            parts.append(
                "a collective timed out: this process group is now unusable. %dist_regroup (pool.regroup()) "
                "builds a fresh one and keeps every rank's state; %dist_restart --replay starts over."
            )
        line = self.memory_text()
        if line:
            parts.append(line)
        if self.running:
            why = "timed out" if self.timed_out else "been running"
            parts.append(
                f"{format_ranks(self.running)} {'has' if len(self.running) == 1 else 'have'} {why} "
                f"after {self.elapsed:.1f} s ({cell_name(self.cell)}); see where with %dist_stacks, "
                "interrupt with %dist_interrupt, or restart with %dist_restart."
            )
        parts.extend(self.notes)
        return "\n".join(p for p in parts if p)

    def comms(self) -> Any:
        """With ``comms=True`` (``%%on_ranks --comms``): collectives per module, mesh dimension and
        rank, and the DTensor redistributes (a :class:`~distnb.analysis.reports.comms.CommsReport`)."""
        from distnb.analysis.reports.comms import CommsReport

        if not any(r.comms for r in self.results.values()):
            raise ValueError(f"{cell_name(self.cell)} was not run with comms=True (%%on_ranks --comms), or no rank finished it.")
        return CommsReport.of(self.cell, {r: res.comms for r, res in sorted(self.results.items())})

    def numerics(self, agree: Any = (), rtol: float = 0.0, atol: float = 0.0) -> Any:
        """With ``numerics=True``: the first op where ranks that must agree part, where NaN/Inf was
        born (a :class:`~distnb.analysis.reports.numerics.NumericsReport`); ``agree``: groups of ranks
        that ran the same data ("0-3", [[0, 1], [2, 3]], a mesh dimension "tp"); ``rtol``/``atol``: sums within them agree."""
        from distnb.analysis.reports.numerics import compare_numerics

        if not any(r.numerics for r in self.results.values()):
            raise ValueError(f"cell {self.cell} was not run with numerics=True (%%on_ranks --numerics), or no rank finished it.")
        return compare_numerics(self.cell, {r: res.numerics for r, res in sorted(self.results.items())}, agree, rtol, atol)

    def memory_text(self) -> str:
        """The compact memory line: peak range across ranks and any imbalance."""
        from distnb.analysis.reports.memory import memory_line

        return memory_line({r.rank: r.memory for r in self._ordered() if r.memory})

    def _many(self) -> bool:
        return len(self.results) > SUMMARY_ABOVE

    def display_texts(self) -> list[str]:
        """The displays' text forms, each once for the ranks that made it (``[display ranks 0-3]
        <Figure>``); above SUMMARY_ABOVE ranks, one-line texts that differ only in numbers merged."""
        displays = [(r.rank, d.get("text/plain", "")) for r in self._ordered() for d in r.displays]
        many = len({r for r, _ in displays}) > SUMMARY_ABOVE and not any("\n" in t for _, t in displays)
        return [prefix_lines(f"display {format_ranks(ranks)}", text) for ranks, text in (merge_rows(displays) if many else group_by(displays))]

    def _value_texts(self) -> list[str]:
        values = [(r.rank, r.value_text or "") for r in self._ordered() if r.value is not None]
        many = len(values) > SUMMARY_ABOVE
        # Many one-line values (a loss per rank): merged as output lines are, odd ranks named.
        rows = merge_rows(values) if many and not any("\n" in t for _, t in values) else group_by(values)
        out = []
        for n, (ranks, text) in enumerate(rows):
            if many and n == MAX_ROWS:
                rest = [r for rs, _ in rows[n:] for r in rs]
                out.append(f"Out[{format_ranks(rest)}]: ⋯ {len(rows) - n:,} other values, each of fewer ranks: _dist.values[rank]")
                break
            label = f"Out[{format_ranks(ranks)}]:"
            out.append(f"{label} {text}" if "\n" not in text else f"{label}\n{text}")
        if isinstance(rows, Rows) and rows.merged:
            out.append("[distnb] values that differ only in their numbers are shown once, as output lines are: ⟨lo … hi⟩ is their "
                       "range, ⟨rank⟩ each rank's own number; each rank's own value: _dist.values[rank].")
        return out

    def _death_texts(self, dead: list[RankResult]) -> list[str]:
        """Each death's post-mortem; above SUMMARY_ABOVE ranks, the first few in full and the rest
        a line per cause (a lost node's eight ranks, a job killed whole)."""
        if not self._many() or len(dead) <= MAX_POST_MORTEMS:
            return [r.death_text() for r in dead]
        out = [r.death_text() for r in dead[:MAX_POST_MORTEMS]]
        rows = merge_rows([(r.rank, r.death_reason()) for r in dead[MAX_POST_MORTEMS:]])
        out.extend(f"{format_ranks(ranks)} died too: {why}" for ranks, why in rows)
        out.append("[distnb] each dead rank's post-mortem: _dist[rank].death_text()")
        return out

    def _error_texts(self) -> list[str]:
        errored = [r for r in self.results.values() if r.error and r.status in (CellStatus.ERROR, CellStatus.INTERRUPTED)]
        # Root cause first: the rank that failed earliest leads.
        errored.sort(key=lambda r: (r.finished_at or float("inf"), r.rank))
        # Same error up to its numbers (f"rank {rank} …", "cuda:2" vs "cuda:3"): one group, one
        # traceback, and each rank's own message under it when they differ. Many ranks' tracebacks
        # are grouped up to their numbers too (a path or a device that names the rank).
        many = self._many()
        keyed = [(r.rank, (e["ename"], e.get("line"), _DIGITS.sub("#", tb) if many else tb, _DIGITS.sub("#", e["evalue"])))
                 for r in errored for e in [r.error or {}] for tb in [e["traceback"].replace(e["evalue"], "")]]
        out = []
        # A peer's closed connection, an interrupt: said in a line when something else caused it.
        caused = any(r.status == CellStatus.DEAD for r in self.results.values()) or any(
            not is_consequence(f"{e.get('ename')}: {e.get('evalue')}") for r in errored for e in [r.error or {}])
        for n, (ranks, (ename, *_)) in enumerate(group_by(keyed)):
            errors = [self.results[r].error or {} for r in ranks]
            line = next((e.get("line") for e in errors if e.get("line")), None)
            where = f" at cell line {line}" if line else ""
            evalue = errors[0].get("evalue") or ""
            if caused and is_consequence(f"{ename}: {evalue}"):
                said = cut_message(evalue.splitlines()[0], 160) if evalue.strip() else ""  # a KeyboardInterrupt says nothing
                out.append(f"── {ename} on {format_ranks(ranks)}{where}, a consequence{': ' + said if said else ''} "
                           f"(its traceback: _dist[{ranks[0]}].error['traceback'])")
                continue
            if many and n >= MAX_TRACEBACKS:
                message = (errors[0].get("evalue") or "").split("\n", 1)[0][:200]
                out.append(f"── {ename} on {format_ranks(ranks)}{where}: {message} (its traceback: _dist[{ranks[0]}].error['traceback'])")
                continue
            text = f"── {ename} on {format_ranks(ranks)}{where} ──\n{name_cells_in(errors[0]['traceback'].rstrip())}"
            messages = [(r, e.get("evalue", "")) for r, e in zip(ranks, errors)]
            text += _merged_messages(ename, messages) if len(ranks) > SUMMARY_ABOVE else differing_messages(ename, messages)
            out.append(text)
        return out

    def output_bytes(self) -> int:
        """Characters of output this result holds: every rank's stdout, stderr and displays."""
        return sum(_output_size(r) for r in self.results.values())

    def release_output(self) -> None:
        """Let the output go (stdout, stderr, displays), counted in each rank's ``released``; values,
        errors and memory stay. The session log does this to old cells of a chatty session."""
        for r in self.results.values():
            r.released += _output_size(r)
            r.stdout = r.stderr = ""
            r.displays = []

    def truncation_note(self) -> str:
        """Which ranks' output went past what a result keeps (the rest was counted, not stored),
        or was let go after the cell."""
        notes = []
        cut = [(r.rank, r.output_truncated) for r in self._ordered() if r.output_truncated]
        if cut:
            what = _per_rank_counts(cut)
            notes.append(f"[distnb] output past the first MiB per rank and stream was not kept ({what} characters); "
                         "write large output to a file on the ranks instead.")
        gone = [(r.rank, r.released) for r in self._ordered() if r.released]
        if gone:
            what = _per_rank_counts(gone)
            notes.append(f"[distnb] this cell's output was let go as later cells wrote more ({what} characters), to keep "
                         "the notebook's memory bounded; the notebook's own copy of the cell still shows it.")
        return "\n".join(notes)

    def text(self) -> str:
        body = "\n".join(p for p in (self.output_text(), self.truncation_note(), self.outcome_text()) if p)
        return self.header() + ("\n" + body if body else "")

    def _ordered(self) -> list[RankResult]:
        return [self.results[r] for r in sorted(self.results)]

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def _per_rank_counts(counts: list[tuple[int, int]]) -> str:
    """``rank 0: 1,200, rank 3: 800``; above SUMMARY_ABOVE ranks their total and the largest."""
    if len(counts) <= SUMMARY_ABOVE:
        return ", ".join(f"rank {r}: {n:,}" for r, n in counts)
    top, most = max(counts, key=lambda c: c[1])
    return f"{format_ranks([r for r, _ in counts])}: {sum(n for _, n in counts):,} in all, the most rank {top}: {most:,}"


#: Lines of many ranks' differing error messages shown under their traceback.
_MESSAGE_ROWS = 12


def _merged_messages(ename: str, messages: list[tuple[int, str]]) -> str:
    """Many ranks' messages of one error, their lines merged as output lines are (``device
    ⟨0 … 7⟩``): the many-rank form of :func:`~distnb.analysis.verdicts.failures.differing_messages`."""
    if len({m for _, m in messages}) < 2:
        return ""
    rows = merge_lines(messages)
    lines = [f"  [{format_ranks(ranks)}] {line}" for ranks, line in rows[:_MESSAGE_ROWS]]
    if len(rows) > _MESSAGE_ROWS:
        lines.append(f"  ⋯ {len(rows) - _MESSAGE_ROWS:,} more lines: _dist[rank].error['evalue']")
    return f"\n  the {ename} messages differ:\n" + "\n".join(lines)
