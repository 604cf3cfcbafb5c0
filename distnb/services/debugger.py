"""The notebook's side of the ranks' debuggers and ``input()``: who waits for a line, and the console
that answers them.

A rank paused in pdb (``breakpoint()``, ``pdb.set_trace()``, ``%%on_ranks --pdb``, ``%dist_debug``)
or waiting in ``input()`` sends a STDIN_REQUEST (worker/process/debug.py); the tracker files it as a
:class:`Prompt` of the running cell. :class:`Debugger` is the API a front-end drives — which ranks
wait (:meth:`Debugger.pending`), send them a line (:meth:`Debugger.answer`), wait for their next
prompt (:meth:`Debugger.settle`) — and :meth:`Debugger.console` is the loop ``Pool.wait`` runs
with an ``ask`` function (``input()``: Jupyter's input box, a terminal's prompt).

Console commands, besides pdb's own (which go to the chosen ranks)::

    list                 the paused ranks: where each stands, and what the others do
    attach 2             send commands to rank 2 only (attach all: every paused rank; attach dp=0: by mesh coordinates)
    ranks 0-3: p x       one command to some ranks (also 1,3 · 0:8:2 · all · tp=1); answers grouped
    nc [RANKS]           on to just before each rank's next collective; their next ones side by side
    c all                every paused rank continues (continue all)
    detach [RANKS]       continue, ignoring this cell's remaining breakpoints on those ranks
    help                 this list (pdb's help: h)

Ranks never wait for a rank that left: ``q`` (or the end of a post-mortem) releases the ranks that
would wait for it in a collective, and a post-mortem under ``--pdb`` holds the cell's other ranks
before their next collective (services/collective_stops.py).
"""

from __future__ import annotations

import builtins
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from distnb.analysis.reports.meshes import MeshReport
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.verdict import Verdict
from distnb.config import LaunchConfig
from distnb.controller.prompts import Prompt
from distnb.controller.session import CellRecord
from distnb.controller.tracker import Tracker
from distnb.errors import NoCellError
from distnb.ranks import format_ranks, group_by, parse_ranks
from distnb.results import CellResult
from distnb.services.collective_stops import CollectiveStops, left_words
from distnb.services.mesh_ranks import mesh_ranks
from distnb.services.positions import unsettled
from distnb.states import CellStatus
from distnb.wire.peers import exec_identity
from distnb.wire.protocol import Msg
from distnb.wire.record_types import CellError

__all__ = ["SETTLE", "Ask", "Command", "Debugger", "Diagnose", "parse_command", "read_line"]

#: How the debugger reads where the other ranks are: the pool's diagnosis of a cell, right now.
Diagnose = Callable[..., Verdict]
#: The pool's device meshes (Pool.meshes): what ``attach dp=0`` resolves against.
Meshes = Callable[[], MeshReport]

Ask = Callable[[str], str]
#: Seconds the console waits for ranks to answer a command before prompting the others again
#: (a rank stepping into a collective waits for ranks that are paused: it answers only later).
SETTLE = 1.0
#: Seconds the console gives the other ranks of the cell to reach the breakpoint the first one hit,
#: so that ranks stopping together are prompted together.
GATHER = 0.25
#: How long a pause's status waits for the other ranks to reach where they will wait.
SETTLE_OTHERS = 3.0
#: Seconds ``nc`` (and a hold) waits for ranks to reach their next collective before the console
#: shows what it has; a rank that arrives later is shown when it does.
NEXT_SETTLE = 3.0
#: pdb's words that end a post-mortem (the cell then reports its error), and pdb's quit.
_RESUME = {"c", "cont", "continue", "n", "next", "s", "step", "r", "return", "unt", "until", "nc"}
_QUIT = {"q", "quit", "exit"}
_CONTINUE_ALL = {"c all", "cont all", "continue all"}

HELP = """distnb's debugger console (pdb's own commands go to the chosen ranks; pdb's help: h):
  list                 the paused ranks, where each stands, and what the others do
  attach R             send commands to rank R only (attach 1,3 · attach all · attach dp=0 by mesh coordinates)
  ranks R: CMD         one command to ranks R (0-3 · 1,3 · 0:8:2 · all · tp=1 · dp=0,tp=1); identical answers grouped
  nc [R]               on to just before the next torch.distributed collective, nothing issued (also: next collective);
                       then the paused ranks' next collectives side by side, and whether they will match
  c all                every paused rank continues (also: continue all), whatever attach chose
  detach [R]           continue, ignoring this cell's remaining breakpoints on those ranks
  q                    pdb's quit: the cell raises on that rank; ranks already waiting for it in a collective are
                       interrupted, and the others stop before any collective that needs it rather than wait
With %%on_ranks --pdb, a rank's post-mortem holds the cell's other ranks before their next collective.
Interrupt the kernel to stop the cell on every rank."""


def read_line(prompt: str) -> str:
    """``input()`` as it is when called: Jupyter's kernel replaces it with its input box."""
    return builtins.input(prompt)


@dataclass
class Command:
    """One console line: ``kind`` is send · list · attach · detach · help · next (``nc``) ·
    continue (``c all``); ``ranks`` None: the default ones."""

    kind: str
    ranks: list[int] | None = None
    text: str = ""


def parse_command(line: str, world_size: int, select: Callable[[str], list[int]] | None = None) -> Command:
    """Read a console line; raises ValueError (with what to type instead) for a bad rank spec.
    ``select`` resolves mesh coordinates (``dp=0``) to ranks."""
    words = line.strip().split(maxsplit=1)
    head, rest = (words[0], words[1] if len(words) > 1 else "") if words else ("", "")
    plain = " ".join(line.split())
    if plain in _CONTINUE_ALL:
        return Command("continue", None, "c")
    if head == "nc" or plain == "next collective" or plain.startswith("next collective "):
        spec = rest if head == "nc" else plain[len("next collective"):].strip()
        return Command("next", _ranks(spec, world_size, select) if spec else None, "nc")
    if head == "list" and not rest:  # pdb's own list is ``l`` (or ``list 10``)
        return Command("list")
    if head == "help" and not rest:
        return Command("help")
    if head == "attach":
        if not rest:
            raise ValueError("attach which rank? e.g. attach 2, attach 1,3, attach all or attach dp=0.")
        return Command("attach", _ranks(rest, world_size, select))
    if head == "detach":
        return Command("detach", _ranks(rest, world_size, select) if rest else None)
    if head == "ranks" and rest:  # (bare ``ranks`` goes to pdb: a variable of that name)
        spec, text = _split_spec(rest)
        ranks = _ranks(spec, world_size, select)
        if " ".join(text.split()) in ("nc", "next collective"):
            return Command("next", ranks, "nc")
        return Command("send", ranks, text.strip())
    return Command("send", None, line)


def _ranks(spec: str, world_size: int, select: Callable[[str], list[int]] | None) -> list[int]:
    """Rank numbers (``1,3``), or mesh coordinates (``dp=0``, ``dp=0,tp=1``) through ``select``."""
    if "=" not in spec:
        return parse_ranks(spec, world_size)
    if select is None:
        raise ValueError(f"{spec.strip()} names mesh coordinates, which need the pool's device meshes: use rank numbers here.")
    return select(spec.strip())


def _split_spec(rest: str) -> tuple[str, str]:
    """``"0:8:2: p x"`` → ``("0:8:2", "p x")``: the spec ends at the first colon followed by a space
    or the end (slices have none)."""
    for i, ch in enumerate(rest):
        if ch == ":" and (i + 1 == len(rest) or rest[i + 1] == " "):
            return rest[:i].strip(), rest[i + 1 :]
    raise ValueError(f"write the ranks, a colon and the command: ranks 0-3: p x (not {rest!r}).")


def render_answers(prompts: list[Prompt]) -> str:
    """Each rank's answer under a header naming the ranks that gave it; identical ones once."""
    blocks = []
    for ranks, text in group_by((p.rank, p.output.rstrip("\n")) for p in prompts):
        if text:
            who = f"[{format_ranks(ranks)}]"
            blocks.append(f"{who}\n{text}" if "\n" in text or len(text) > 60 else f"{who} {text}")
    return "\n".join(blocks)


class Debugger:
    """The ranks of a pool that wait for a line, and the means to answer them."""

    def __init__(self, tracker: Tracker, config: LaunchConfig, diagnose: Diagnose, meshes: Meshes | None = None) -> None:
        self._tracker = tracker
        self._config = config
        self._diagnose = diagnose
        self._meshes = meshes  # Pool.meshes; without it, ranks are chosen by number only
        self._mesh_seen: tuple[int, MeshReport] | None = None  # read once per cell: a walk of each rank's objects
        self.stops = CollectiveStops(tracker, config.world_size)

    def pending(self, result: CellResult) -> list[Prompt]:
        """Ranks of this cell waiting for a line now, in rank order."""
        return self._tracker.prompts_waiting(result)

    def answer(self, prompt: Prompt, text: str = "", *, detach: bool = False, eof: bool = False, why: str = "") -> None:
        """Send ``text`` as the line ``prompt`` waits for (``detach``: pdb continues and ignores this
        cell's remaining breakpoints; ``eof``: no line can be had)."""
        msg: dict[str, Any] = {"t": Msg.STDIN_REPLY, "id": prompt.id, "text": text}
        if detach or eof:
            msg.update(detach=detach, eof=eof, why=why)
        self._tracker.answer_prompt(prompt, exec_identity(prompt.rank), msg)

    def select(self, result: CellResult, spec: str) -> list[int]:
        """The ranks at mesh coordinates ``spec`` (``dp=0``, ``dp=0,tp=1``) of the pool's meshes."""
        assert self._meshes is not None, "mesh coordinates need the pool's meshes"
        if self._mesh_seen is None or self._mesh_seen[0] != result.cell:
            self._mesh_seen = (result.cell, self._meshes())
        return mesh_ranks(spec, self._mesh_seen[1], self._config.world_size)

    def post_mortem_rank(self, history: list[CellResult | CellRecord]) -> int:
        """The rank ``%dist_debug`` opens by default: in the last cell that raised, the rank whose
        error is not a consequence of another's (a peer's lost connection), the first to raise."""
        for cell in reversed(history):
            if isinstance(cell, CellResult):
                raised = [res for res in cell.results.values() if res.status == CellStatus.ERROR and res.error and res.error.get("ename") != "BdbQuit"]
                if raised:
                    return min(raised, key=lambda res: (_consequence(res.error or CellError()), res.finished_at or 0.0, res.rank)).rank
        raise NoCellError("no cell has raised on this pool, so there is nothing to debug post-mortem; "
                          "%%on_ranks --pdb stops in the debugger at the next error instead.")

    def settle(self, result: CellResult, ranks: list[int], timeout: float = SETTLE) -> list[int]:
        """Wait until each of ``ranks`` asks for a line again or has left the cell, at most
        ``timeout`` seconds; returns the ones still running."""
        run = self._tracker.run_of(result)

        def busy() -> list[int]:
            return [r for r in ranks if r in run.waiting_done and not _asking(run.prompts.get(r))]

        self._tracker.wait_until(lambda: not busy() or run.finished.is_set(), timeout)
        return self._tracker.under_lock(busy)

    def status(self, result: CellResult, waiting: list[Prompt]) -> str:
        """Where the paused ranks stand (with the source around), what the others do, how long the
        ranks waiting for them in a collective have before ``--pg-timeout`` ends it, and, when ranks
        are paused before a collective, every rank's next one side by side."""
        lines = []
        for ranks, (place, _) in group_by((p.rank, (p.place(), _doing(p))) for p in waiting):
            first = next(p for p in waiting if p.rank == ranks[0])
            lines.append(f"[distnb] {format_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} {_doing(first)} at {place}")
            if first.source():
                lines.append(first.source())
        positions: list[Position] = []
        paused = {p.rank for p in waiting}
        try:
            diag = self._diagnose(result, hang_after=0.0)
            # The others may be on their way to where they will wait (their stack in the cell's
            # code, or in a call whose record is not here yet): read again, a little, until they are
            # there, so the line says where they wait — on a busy machine that takes a moment.
            deadline = time.monotonic() + SETTLE_OTHERS
            while unsettled([p for p in diag.positions if p.rank not in paused]) and time.monotonic() < deadline:
                time.sleep(GATHER)
                diag = self._diagnose(result, hang_after=0.0)
        except Exception as exc:  # best effort: the prompt matters more
            lines.append(f"  (the other ranks could not be read: {exc})")
        else:
            positions = diag.positions
            lines.extend(self._others(waiting, positions))
        report = self.stops.report(result, waiting, positions)
        if report is not None:
            lines.append(report.text())
        return "\n".join(lines)

    def _others(self, waiting: list[Prompt], positions: list[Position]) -> list[str]:
        paused = {p.rank for p in waiting}
        others = [p for p in positions if p.rank not in paused and p.state != Place.IDLE]
        lines = [f"  {format_ranks(ranks)}: {text}" for ranks, text in group_by((p.rank, p.where()) for p in others)]
        blocked = [p for p in others if p.state == Place.COLLECTIVE]
        if blocked:
            waited = max(p.since or 0.0 for p in blocked)
            timeout = self._config.pg_timeout
            lines.append(f"  {format_ranks([p.rank for p in blocked])} {'waits' if len(blocked) == 1 else 'wait'} for the paused "
                         f"{'rank' if len(paused) == 1 else 'ranks'}: --pg-timeout ({timeout:.0f} s) ends "
                         f"{'its' if len(blocked) == 1 else 'their'} wait with an error in {_duration(timeout - waited)}. "
                         "Continue before then, or relaunch with a longer --pg-timeout for long sessions.")
        return lines

    def console(self, result: CellResult, ask: Ask = read_line, write: Callable[[str], None] | None = None,
                before_prompt: Callable[[], None] | None = None) -> None:
        """Answer this cell's ranks from ``ask`` until none waits for a line (the cell may still
        run). ``input()`` calls are answered first, in rank order; then pdb commands go to the
        chosen ranks (default: every paused one). ``before_prompt`` flushes live output."""
        write = write or _print
        world = self._config.world_size
        chosen: list[int] | None = None
        said: object = None
        self.settle(result, result.ranks, GATHER)
        while True:
            waiting = self.pending(result)
            if not waiting:
                return
            if before_prompt is not None:
                before_prompt()
            fresh = [p for p in waiting if not p.shown]
            for p in fresh:
                p.shown = True
            if fresh and render_answers(fresh):
                write(render_answers(fresh))
            asking = [p for p in waiting if p.kind == "input"]
            if asking:
                line = self._read(result, ask, f"[rank {asking[0].rank}] {asking[0].prompt}", waiting, write)
                if line is not None:
                    self.answer(asking[0], line)
                continue
            held, words = self.stops.hold(result, waiting)
            if words:  # a rank opened post-mortem: the others pause before their next collective
                write(words)
                self.settle(result, held, NEXT_SETTLE)
                continue
            paused = [p.rank for p in waiting]
            places = [(p.rank, p.place(), _doing(p)) for p in waiting]
            if places != said:
                said = places
                write(self.status(result, waiting))
            targets = [r for r in chosen or paused if r in paused] or paused
            shown = {p.prompt for p in waiting if p.rank in targets}
            line = self._read(result, ask, f"[{format_ranks(targets)}] {shown.pop() if len(shown) == 1 else '(Pdb) '}", waiting, write)
            if line is None:
                continue
            try:
                cmd = parse_command(line, world, (lambda spec: self.select(result, spec)) if self._meshes is not None else None)
            except ValueError as exc:
                write(f"[distnb] {exc}")
                continue
            if cmd.kind == "help":
                write(HELP)
            elif cmd.kind == "list":
                write(self.status(result, waiting))
            elif cmd.kind == "attach":
                assert cmd.ranks is not None
                chosen = [r for r in cmd.ranks if r in paused] or chosen
                away = [r for r in cmd.ranks if r not in paused]
                write(f"[distnb] {format_ranks(away)} not paused; " * bool(away)
                      + f"commands go to {format_ranks([r for r in chosen or paused if r in paused] or paused)}.")
            else:
                self._send(result, cmd, paused if cmd.kind == "continue" else targets, waiting, write)

    def _send(self, result: CellResult, cmd: Command, targets: list[int], waiting: list[Prompt], write: Callable[[str], None]) -> None:
        by_rank = {p.rank: p for p in waiting}
        ranks = cmd.ranks if cmd.ranks is not None else targets
        away = [r for r in ranks if r not in by_rank]
        if away:
            write(f"[distnb] {format_ranks(away)} {'is' if len(away) == 1 else 'are'} not paused: not sent there (list shows who is).")
        ranks = [r for r in ranks if r in by_rank]
        # Ranks about to leave the cell (q, the end of a post-mortem): the others must not wait for them.
        leaving = [r for r in ranks if _leaves(by_rank[r], cmd)]
        released = self.stops.release(result, leaving, _why(by_rank, leaving)) if leaving else ""
        for r in ranks:
            self.answer(by_rank[r], cmd.text, detach=cmd.kind == "detach")
        still = self.settle(result, ranks, NEXT_SETTLE if cmd.kind == "next" else SETTLE)
        if released:
            write(released)
        # A rank that raised and left meanwhile (a step over the failing line): released as well.
        left = [r for r in ranks if r not in leaving and result.results[r].status == CellStatus.ERROR]
        if left and (words := self.stops.release(result, left, "it raised")):
            write(words)
        if cmd.kind == "next":
            running = self.stops.running(result)
            done = [r for r in ranks if r not in still and r not in running]
            for rs, words in group_by((r, left_words(result.results[r])) for r in done):
                write(f"[distnb] {format_ranks(rs)} {words}.")
        if still and self.pending(result):
            write(f"[distnb] {format_ranks(still)} still running after {cmd.text or cmd.kind!r} (it answers when it stops again).")

    def _read(self, result: CellResult, ask: Ask, label: str, waiting: list[Prompt], write: Callable[[str], None]) -> str | None:
        """A line from ``ask``; when none can be had here, every waiting rank is let go instead."""
        try:
            return ask(label)
        except KeyboardInterrupt:
            raise  # Pool.wait interrupts the cell
        except Exception as exc:  # EOFError, OSError, IPython's StdinNotImplementedError …
            why = f"{type(exc).__name__}: {exc}".rstrip(": ")
            pdb_ranks = [p.rank for p in waiting if p.kind == "pdb"]
            input_ranks = [p.rank for p in waiting if p.kind == "input"]
            write("[distnb] no line can be read here (" + why + "): "
                  + (f"{format_ranks(pdb_ranks)} continue without the debugger (this cell's remaining breakpoints ignored)"
                     if pdb_ranks else "")
                  + ("; " if pdb_ranks and input_ranks else "")
                  + (f"input() on {format_ranks(input_ranks)} raises EOFError" if input_ranks else "")
                  + ". Run the cell where there is an input box (JupyterLab, Notebook, the IPython terminal), "
                  "or answer from Python through pool.debugger.")
            ending = [p.rank for p in waiting if p.mode == "post_mortem"]
            if ending and (words := self.stops.release(result, ending, "post-mortem ended")):
                write(words)
            for p in waiting:
                self.answer(p, detach=p.kind == "pdb", eof=p.kind == "input", why=f"the notebook could not read a line ({why})")
            return None


def _doing(prompt: Prompt) -> str:
    """``paused in the debugger``, ``in post-mortem``, ``held before all_reduce (nothing issued yet)``."""
    if prompt.mode == "post_mortem":
        return "in post-mortem"
    before = prompt.before
    if before is not None:
        return f"{'held' if before.get('why') == 'hold' else 'paused'} before {before.get('op')} (nothing issued yet)"
    return "paused in the debugger"


def _leaves(prompt: Prompt, cmd: Command) -> bool:
    """Will this line end the cell on the rank? pdb's quit always; any way on from a post-mortem."""
    if prompt.kind != "pdb":
        return False
    word = cmd.text.strip().split(maxsplit=1)[0] if cmd.text.strip() else ""
    return word in _QUIT or (prompt.mode == "post_mortem" and (cmd.kind in ("detach", "next", "continue") or word in _RESUME))


def _why(by_rank: dict[int, Prompt], leaving: list[int]) -> str:
    ended = all(by_rank[r].mode == "post_mortem" for r in leaving)
    return "post-mortem ended: the error is the cell's outcome there" if ended else "quit from the debugger (q)"


def _consequence(error: CellError) -> bool:
    """An error a rank got because a peer failed (its connection dropped), not a cause."""
    text = f"{error.get('ename')}: {error.get('evalue')}"
    return error.get("ename") in ("DistBackendError", "DistNetworkError") or any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted"))


def _asking(prompt: Prompt | None) -> bool:
    return prompt is not None and not prompt.answered


def _duration(seconds: float) -> str:
    whole = max(0, round(seconds))
    if whole < 120:
        return f"{whole} s"
    return f"{whole // 60} min {whole % 60} s" if whole < 7200 else f"{whole / 3600:.1f} h"


def _print(text: str) -> None:
    print(text, file=sys.stdout, flush=True)
