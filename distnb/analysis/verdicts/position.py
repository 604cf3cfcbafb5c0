"""Where one rank is in a running cell, read off its stack and collective log, and the words
for it; the verdict rules (:mod:`distnb.analysis.verdicts`) judge every rank's position."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from distnb.analysis.agreement.evidence import peer_words
from distnb.analysis.verdicts.stacks import RankStack, parse_faulthandler, short_path
from distnb.cell_names import cell_name
from distnb.wire.record_types import P2P_OPS, CallRecord, ThreadError

__all__ = ["Place", "Position", "position_from_stack", "collective_at_death", "position_at_death", "thread_error_words", "COLLECTIVE_FUNCS"]

#: Public torch.distributed functions that block until peers arrive.
COLLECTIVE_FUNCS = {
    "all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_single", "all_gather_coalesced", "all_reduce_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce",
    "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "batch_isend_irecv", "new_group", "init_process_group", "destroy_process_group",
}


def _duration(seconds: list[float]) -> str:
    if not seconds:
        return ""
    lo, hi = min(seconds), max(seconds)
    return f" for {lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f" for {lo:.1f}–{hi:.1f} s"


class Place(str, Enum):
    """Where a rank is in the current cell (:attr:`Position.state`)."""

    FINISHED = "finished"  # left the cell, done
    FAILED = "failed"  # left it by an error
    STRANDED = "stranded"  # left it from a collective a dead peer would never finish
    DEAD = "dead"
    COMPUTING = "computing"  # running code outside a torch.distributed call
    COLLECTIVE = "collective"  # in a torch.distributed call (a collective, send/recv, group creation)
    UNRESPONSIVE = "unresponsive"  # no stack at all: its control thread did not answer
    IDLE = "idle"  # not running the cell
    PAUSED = "paused"  # waiting for the notebook (pdb, input(), the debugger panel)

    def __str__(self) -> str:
        return self.value


@dataclass
class Position:
    """Where one rank is in the current cell."""

    rank: int
    state: Place
    op: str | None = None  # the collective it waits in
    seq: int | None = None  # per-group sequence number, when known
    group: str | None = None
    shapes: str | None = None
    since: float | None = None  # seconds in the collective (or in the cell)
    line: int | None = None  # cell line
    code: str = ""  # the cell line's text
    detail: str = ""  # error summary, exit meaning …
    sizes: list[list[int]] | None = None  # input shapes of the collective, when the log knows them
    dtypes: list[str] | None = None
    args: dict[str, Any] | None = None  # src/dst/op of the collective (worker/torch_hooks/call_log.py)
    line_cell: int | None = None  # the cell ``line`` is in: an earlier one when it is in a function defined there
    func: str = ""  # the function ``line`` is in ("<module>": the cell's own code)
    running: int | None = None  # the cell the rank is running
    peers: list[CallRecord] = field(default_factory=list)  # open send/recv calls: op, peer, tag
    # The collective the rank waits for when that is not where its host is (an async work, issued
    # earlier, waited on now): ``where`` then says both.
    issued: str = ""
    label: str = ""  # the group as the user built it (``dp (ranks 1,3)``); empty: ``group <name>``
    file: str = ""  # the script ``line`` is in, for a rank running a program rather than cells (an attached job)
    # A finished rank's collectives issued per group at its cell's end (its CELL_DONE's sync): what it
    # entered, known even when its collective log has not arrived.
    seqs: dict[str, int] | None = None
    # The share of one CPU the rank's main thread used lately, as its control thread last measured
    # it (None: not known): computing (slow) against blocked outside torch.distributed.
    cpu: float | None = None
    # Uncaught exceptions of the rank's other threads in this cell: a collective such a thread was
    # to make never comes.
    threads: list[ThreadError] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = Place(self.state)  # a plain word from older records or a test reads as its Place

    def between(self) -> bool:
        """Read between two places: running the cell's code, or in a collective by its stack that
        the log holds no entry for yet (point-to-point calls and group creation have none to wait
        for). Where it will be next is not known yet."""
        return (self.state == Place.COMPUTING and self.running is not None or
                self.state == Place.COLLECTIVE and self.seq is None and self.op not in P2P_OPS and self.op != "new_group")

    def on(self) -> str:
        """`` on dp (ranks 1,3)``, `` on group 0``; empty when the group is unknown."""
        return f" on {self.label or f'group {self.group}'}" if self.group else ""

    def at(self) -> str:
        """`` at cell line 3``, `` in step() (cell 2 line 11)``, `` at cell 2 line 4``."""
        if not self.line:
            return ""
        if self.file:
            spot = f"{os.path.basename(self.file)}:{self.line}"
            return f" in {self.func}() ({spot})" if self.func and self.func != "<module>" else f" at {spot}"
        other = self.line_cell is not None and self.running is not None and self.line_cell != self.running
        if self.func and self.func != "<module>":
            cell = f"{cell_name(self.line_cell)} " if self.line_cell is not None else "cell "
            return f" in {self.func}() ({cell}line {self.line})"
        return f" at {cell_name(self.line_cell)} line {self.line}" if other else f" at cell line {self.line}"

    def death_words(self) -> str:
        """``all_reduce at cell line 2 (from the stack it printed as it died)``: a position read
        from a dead rank's last stack."""
        return f"{self.op}{self.at()} (from the stack it printed as it died)"

    def collective(self) -> str:
        """``all_reduce #4 at cell line 3``."""
        seq = f" #{self.seq}" if self.seq is not None else ""
        return f"{self.op}{seq} ({self.issued})" if self.issued else f"{self.op}{seq}" + self.at()

    def where(self, durations: list[float] | None = None) -> str:
        """Where the rank is, in words; ``durations`` (of a group of ranks) replaces its own duration;
        then what its other threads raised."""
        raised = "".join(f"; its thread {thread_error_words(t, self.running)}" for t in self.threads[:2])
        return self._place_words(durations) + raised

    def _place_words(self, durations: list[float] | None) -> str:
        at = self.at() + (f" ({self.code.strip()})" if self.code.strip() else "") if self.line else ""
        dur = _duration(durations if durations is not None else [self.since] if self.since is not None else [])
        if self.state == Place.COLLECTIVE and self.issued:
            shp = f" {self.shapes}" if self.shapes else ""
            return (f"waiting for {self.op}{f' #{self.seq}' if self.seq is not None else ''}{self.on()}{shp} "
                    f"({self.issued}){dur}, now blocked{at or ' at a host sync'}")
        if self.state == Place.COLLECTIVE and self.peers:
            return f"{' and '.join(dict.fromkeys(p2p_text(c) for c in self.peers))}{dur}{at}"
        if self.state == Place.COLLECTIVE:
            seq = f" #{self.seq}" if self.seq is not None else ""
            shp = f" {self.shapes}" if self.shapes else ""
            return f"waiting in {self.op}{seq}{self.on()}{shp}{dur}{at}"
        if self.state == Place.COMPUTING:
            return f"running Python code (not in a collective{', ' + self.detail if self.detail else ''}){dur}{at}"
        if self.state == Place.PAUSED:
            return f"{self.detail}{dur}{at}"
        if self.state == Place.FINISHED:
            # A program's rank (a job's) has no cell: what is known is how it left.
            return f"ended: {self.detail}" if self.file and self.detail else "finished the cell"
        if self.state == Place.IDLE:
            return "idle: not part of this cell"
        if self.state == Place.FAILED:
            return f"raised {self.detail}{at}"
        if self.state == Place.DEAD:
            return f"died: {self.detail}"
        if self.state == Place.UNRESPONSIVE:
            return f"not answering: {self.detail}"
        return self.state


def thread_error_words(error: ThreadError, cell: int | None = None) -> str:
    """``'loader' raised ValueError: bad shard index in work() (cell 1 line 4)`` (``cell``: the
    cell judged, whose own lines read ``at cell line 4``)."""
    where = ""
    if error["line"] is not None:
        if error["func"] not in ("", "<module>"):
            where = f" in {error['func']}() ({cell_name(error['cell'])} line {error['line']})"
        else:
            where = f" at cell line {error['line']}" if error["cell"] == cell else f" at {cell_name(error['cell'])} line {error['line']}"
    message = f": {error['evalue']}" if error["evalue"] else ""
    return f"{error['thread']!r} raised {error['ename']}{message}{where}"


def p2p_text(call: CallRecord) -> str:
    """``sending to rank 1``, ``receiving from rank 2 (tag 3)``, ``receiving from any rank``."""
    tag = call.get("args", {}).get("tag")
    return f"{'sending to' if P2P_OPS[call['op']] == 'send' else 'receiving from'} {peer_words(call)}" + (f" (tag {tag})" if tag else "")


def position_from_stack(stack: RankStack, cell: int | None = None) -> Position:
    """A rank's position read off its stack: the outermost torch.distributed collective frame,
    and the innermost cell frame (its cell, line and function) that led there."""
    main = next((t for t in stack.threads if t.main), None)
    frames = main.user_frames() if main else []
    cell_frames = [f for f in frames if f.is_cell]
    inner = cell_frames[-1] if cell_frames else None
    where: dict[str, Any] = {}
    if inner is not None:
        where = {"line": inner.lineno, "code": inner.line, "func": inner.name, "line_cell": inner.cell, "running": cell}
    elif main is not None and main.program:
        # A program's own frames are those outside the libraries (site-packages, the stdlib).
        own = [f for f in frames if short_path(f.filename) == f.filename]
        if own:
            where = {"line": own[-1].lineno, "code": own[-1].line, "func": own[-1].name, "file": own[-1].filename}
    op = next(
        (f.name for f in frames if f.filename.endswith("distributed_c10d.py") and f.name in COLLECTIVE_FUNCS),
        None,
    )
    if op is not None:
        return Position(stack.rank, Place.COLLECTIVE, op=op, **where)
    return Position(stack.rank, Place.COMPUTING, detail=_importing(frames) or _compiling(frames), cpu=stack.cpu, **where)


def position_paused(rank: int, paused: dict[str, Any], cell: int | None) -> Position:
    """A rank waiting for the notebook's line: pdb's next command, or ``input()``."""
    w = paused.get("where") or {}
    doing = {"pdb": "paused in the debugger", "panel": "paused in the debugger panel"}.get(paused.get("kind", ""), "waiting for input()")
    if w and w.get("cell") is None:  # stepped into library code
        doing += f" in {w.get('func')}() ({w.get('file')}:{w.get('line')})"
    return Position(rank, Place.PAUSED, detail=doing, since=paused.get("since"), line=w.get("line") if w.get("cell") is not None else None,
                    code=w.get("code", ""), func=w.get("func", ""), line_cell=w.get("cell"), running=cell)


def position_at_death(stderr: str, main_ident: int | None = None) -> Position | None:
    """The collective the main thread was in when faulthandler printed its stack on a fatal
    signal (SIGABRT, SIGSEGV), from a dead rank's last stderr; None when it was in none."""
    if "File " not in stderr:
        return None
    threads = parse_faulthandler(stderr, None, main_ident)
    main = next((t for t in threads if t.main), None)
    if main is None:
        return None
    pos = position_from_stack(RankStack(-1, "", "faulthandler", [main]))
    return pos if pos.state == Place.COLLECTIVE else None


def collective_at_death(stderr: str, main_ident: int | None = None) -> str | None:
    """``all_reduce at cell line 2 (…)``: :func:`position_at_death` in words."""
    pos = position_at_death(stderr, main_ident)
    return None if pos is None else pos.death_words()


def _compiling(frames: list[Any]) -> str:
    """``compiling `train_step` with torch.compile`` when the rank is inside dynamo or inductor
    (a first compile, or a recompile after a guard failed), else ``""``."""
    at = next((i for i, f in enumerate(frames) if "/torch/_dynamo/" in f.filename or "/torch/_inductor/" in f.filename), None)
    if at is None:
        return ""
    caller = next((f for f in reversed(frames[:at]) if f.is_cell), None)
    return f"compiling {'`' + caller.name + '` ' if caller and caller.name != '<module>' else ''}with torch.compile"


def _importing(frames: list[Any]) -> str:
    """``importing torch/_dynamo/__init__.py`` when the rank is inside an import, else ``""``."""
    inside = [i for i, f in enumerate(frames) if f.filename.startswith("<frozen importlib")]
    if not inside:
        return ""
    module = next((f for f in reversed(frames[inside[0]:]) if f.name == "<module>" and not f.filename.startswith("<")), None)
    return f"importing {short_path(module.filename)}" if module else "importing a module"
