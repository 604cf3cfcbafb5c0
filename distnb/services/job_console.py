"""``%dist_debug`` on an attached job: a pdb-like console on one rank of a live job, at the frame it
stands in now.

Two parts, so that it works on the rank that matters most, a hung one:

- **Looks** (PEEK, worker/process/peek.py): ``where``, ``up``/``down``, ``list``, ``p``/``pp``,
  ``args``, ``locals`` and any other line (``!stmt``) are answered by the rank's control thread
  against the main thread's frames as they stand, without stopping it. A rank blocked in a
  collective is in native code, where no debugger can pause it, and its frames stand still there.
- **Steps** (debugpy, services/job_stepper.py): ``pause`` stops the main thread at its next Python
  line; then ``n``, ``s``, ``r`` step it and ``c`` lets it go; ``b`` sets a breakpoint, and ``c``
  then goes on until it stops there. Only on request: a paused rank holds the others at their next
  collective, their timeouts running.

``q`` (or the end of the commands) leaves the rank running as it was; nothing raises in the job.
Every answer is text (the console prints it); the looks themselves are data (:class:`PeekRead`).
"""

from __future__ import annotations

from typing import Callable

from distnb.errors import DistnbError
from distnb.ranks import format_ranks, group_by, parse_ranks
from distnb.services.job_stepper import STEP_WAIT, JobStepper, Stop
from distnb.wire.record_types import PeekFrame, PeekRead

__all__ = ["CONSOLE_HELP", "JobConsole", "Look", "warning"]

#: One look into a rank: (rank, what, frame index or None, expression or None, the frame's (file,
#: function) as last seen or None) → its answer.
Look = Callable[[int, str, int | None, str | None, tuple[str, str] | None], PeekRead]

#: Seconds between the console's checks that a rank it waits on (for a breakpoint) still answers.
ALIVE_EVERY = 2.0
_STEPS = {"n": "next", "next": "next", "s": "stepIn", "step": "stepIn", "r": "stepOut", "return": "stepOut"}
_QUIT = {"q", "quit", "exit", "EOF"}

CONSOLE_HELP = """distnb's console on a rank of a live job (pdb's words; the rank is not stopped unless you pause it):
  w, where, bt        the main thread's frames, the selected one marked >
  u [N], d [N]        select the frame N up (outward) or down
  l, list · ll        the source around the selected frame's line · its whole function
  p EXPR · pp EXPR    EXPR's value in the selected frame (pp: pretty-printed)
  a, args · locals    the selected frame's arguments · all its locals
  !STMT, or any line  run it in the selected frame (its prints go to the job's output)
  ranks R: CMD        a look on ranks R (0-3 · 1,3 · all), each in its own innermost frame of the user's
                      code: p step on every rank, equal answers grouped, the most ranks first
  pause               stop the main thread at its next Python line (in native code, e.g. inside a
                      collective: when it comes back); the others wait for it at their next collective
  n · s · r           paused: next line · step into · step out (return)
  b [LINE | FILE:LINE]  the breakpoints · one more (LINE: in the selected frame's file); cl clears them
  c                   with breakpoints: on until one stops it; else let it go on, and leave the console
  q                   leave the console; a paused rank goes on, as it was"""


def warning(rank: int, job: str, pid: int | None, where: str) -> str:
    """What the console says first: what debugging a live rank does to the job."""
    at = f" (pid {pid})" if pid is not None else ""
    lines = [f"[distnb] debugging rank {rank} of the live job {job}{at}: what you type runs in that process, on a thread "
             "beside the job. It is not stopped: `pause` stops it at its next Python line, and while it is paused the "
             "other ranks wait for it at their next collective, their timeouts running (gloo 30 min, NCCL 10 min by "
             "default). q leaves it running as it was; h lists the commands."]
    if where:
        lines.append(f"[distnb] rank {rank} is {where}")
    return "\n".join(lines)


class JobConsole:
    """The console's state on one rank: the selected frame, and debugpy once asked to pause."""

    def __init__(self, rank: int, world_size: int, look: Look, stepper: Callable[[], JobStepper]) -> None:
        """``look(rank, what, frame, expr, want)``: one look into a rank of the job (any, for ``ranks R:``)."""
        self.rank = rank
        self.world_size = world_size
        self._look_any = look
        self._make_stepper = stepper
        self._stepper: JobStepper | None = None
        self.frames: list[PeekFrame] = []
        self.selected: int | None = None
        self.done = False

    @property
    def paused(self) -> bool:
        return self._stepper is not None and self._stepper.paused

    def open(self) -> str:
        """The frames as they stand, the innermost of the user's selected (pdb's first words)."""
        self._read_frames(select_user=True)
        return self._where(current_only=True)

    def run(self, line: str) -> str:
        """One command's answer, in words."""
        line = line.strip()
        if self._stepper is not None and not self._stepper.paused and self._stepper.stopped(0) is not None:
            # A step that ran into native code has stopped since: the frames moved.
            self._read_frames(select_user=True)
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if not line:
            return ""
        if word in _QUIT:
            return self.leave()
        if word in ("h", "help"):
            return CONSOLE_HELP
        if word in ("w", "where", "bt"):
            self._read_frames()
            return self._where()
        if word in ("u", "up", "d", "down"):
            return self._move(word, rest)
        if word in ("l", "list", "ll", "longlist"):
            return self._source("function" if word in ("ll", "longlist") else "source")
        if word == "ranks":
            return self._across(rest)
        if word == "pause" and not rest:
            return self._pause()
        if word in _STEPS and not rest:
            return self._step(_STEPS[word])
        if word in ("b", "break"):
            return self._break(rest)
        if word in ("cl", "clear") and not rest:
            if self._stepper is None or not self._stepper.breakpoints:
                return "no breakpoints"
            self._stepper.clear_breakpoints()
            return f"[distnb] rank {self.rank}'s breakpoints cleared"
        if word in ("c", "cont", "continue") and not rest:
            if self._stepper is not None and self._stepper.breakpoints:
                return self._until_stop(self._to_breakpoint, "", "")
            return self.leave()
        what, expr = _as_look(line)
        return self._value(what, expr)

    def leave(self) -> str:
        """End the console: a paused rank goes on. Safe to call twice."""
        if self.done:
            return ""
        self.done = True
        if self._stepper is None or not self._stepper.started:
            return f"[distnb] left rank {self.rank}; it runs on as it was."
        was, pending, points = self._stepper.paused, self._stepper.pending, bool(self._stepper.breakpoints)
        why = self._stepper.resume()
        if why:
            return f"[distnb] rank {self.rank} may still be paused: debugpy did not take the continue ({why}); %dist_debug {self.rank} then c"
        cleared = ", its breakpoints cleared" if points else ""
        if was:
            return f"[distnb] rank {self.rank} goes on; left it{cleared}."
        if pending:
            return f"[distnb] left rank {self.rank}; the pause asked for is taken back{cleared}, it runs on."
        return f"[distnb] left rank {self.rank}{cleared}; it runs on as it was."

    # -- looks ---------------------------------------------------------------------------------
    def _look(self, what: str, expr: str | None = None) -> PeekRead:
        """A look into this rank's selected frame; a rank that ran on since is looked at where that
        function now is (or says it returned), and the frames kept are the answer's."""
        if self.selected is None:
            self._read_frames(select_user=True)
        read = self._look_any(self.rank, what, self.selected, expr, _seen(self.frames, self.selected))
        if "frames" in read and "frame" in read:
            self.frames, self.selected = list(read["frames"]), read["frame"]
        return read

    def _read_frames(self, select_user: bool = False) -> None:
        read = self._look_any(self.rank, "frames", None, None, None)
        before = self.frames
        self.frames = list(read.get("frames", []))
        moved = [(f.filename, f.function) for f in before] != [(f.filename, f.function) for f in self.frames]
        if select_user or moved or self.selected is None or self.selected >= len(self.frames):
            self.selected = _innermost_user(self.frames)

    def _where(self, current_only: bool = False) -> str:
        if not self.frames or self.selected is None:
            return f"rank {self.rank}'s main thread shows no Python frame now"
        shown = [self.selected] if current_only else range(len(self.frames))
        return "\n".join(_frame_line(self.frames[i], i == self.selected) for i in shown)

    def _move(self, word: str, count: str) -> str:
        if not self.frames:
            self._read_frames(select_user=True)
        if self.selected is None:
            return "no frame to move in"
        try:
            n = int(count) if count else 1
        except ValueError:
            return f"*** {word} takes a number of frames, not {count!r}"
        up = word in ("u", "up")
        target = self.selected - n if up else self.selected + n
        if not 0 <= target < len(self.frames):
            return "*** Oldest frame" if up else "*** Newest frame"
        self.selected = target
        return _frame_line(self.frames[target], True)

    def _source(self, what: str) -> str:
        read = self._look(what)
        if read.get("error"):
            return f"*** {read['error']}"
        here = self.frames[self.selected].line if self.selected is not None and self.selected < len(self.frames) else -1
        return "\n".join(f"{n:>4} {'->' if n == here else '  '} {text}" for n, text in read.get("source", [])) or "*** no source"

    def _value(self, what: str, expr: str | None) -> str:
        read = self._look(what, expr)
        if read.get("error"):
            return f"*** {read['error']}"
        return read.get("value", "")

    def _across(self, rest: str) -> str:
        """``ranks R: CMD``: one look on several ranks, each in the innermost frame of its user's
        code (this rank: the frame selected); equal answers grouped, the most ranks first."""
        spec, colon, command = rest.partition(":")
        if not colon or not command.strip():
            return "*** ranks R: CMD (R: 0-3 · 1,3 · all; CMD: p, pp, a, locals or an expression)"
        try:
            ranks = parse_ranks(spec.strip(), self.world_size)
        except ValueError as exc:
            return f"*** {exc}"
        what, expr = _as_look(command.strip())
        if what == "exec" and not _expression(expr):
            return "*** ranks R: takes looks (p, pp, a, locals, an expression), not statements: run those on one rank"
        answers = []
        for r in ranks:
            try:
                if r == self.rank and self.selected is not None:
                    read = self._look(what, expr)
                else:
                    frames = self._look_any(r, "frames", None, None, None).get("frames", [])
                    frame = _innermost_user(frames)
                    read = self._look_any(r, what, frame, expr, _seen(frames, frame))
                answers.append((r, f"*** {read['error']}" if read.get("error") else read.get("value", "")))
            except DistnbError as exc:
                answers.append((r, f"*** {exc}"))
        groups = sorted(group_by(answers), key=lambda g: -len(g[0]))
        return "\n".join(_grouped(rs, text) for rs, text in groups)

    # -- steps ---------------------------------------------------------------------------------
    def _debugpy(self) -> JobStepper:
        """The rank's debugpy, made on the first pause or breakpoint."""
        if self._stepper is None:
            self._stepper = self._make_stepper()
        return self._stepper

    def _pause(self) -> str:
        return self._until_stop(self._debugpy().pause, f"rank {self.rank} was not paused: ",
                                f"[distnb] rank {self.rank} is in native code (a collective, a kernel, I/O): it stops when it comes back to "
                                "Python. Its frames stand still meanwhile (where, p …); q takes the pause back.")

    def _step(self, command: str) -> str:
        stepper = self._stepper
        if stepper is not None and stepper.pending:
            return (f"*** rank {self.rank} has not stopped yet: what was asked (pause, step) lands when its main thread comes "
                    "back to Python; where shows where it is, q takes it back")
        if stepper is None or not stepper.paused:
            return f"*** rank {self.rank} is not paused (it runs on): `pause` first"
        return self._until_stop(lambda: stepper.step(command), "",
                                f"[distnb] rank {self.rank} has not stopped within {STEP_WAIT:g} s: the step runs on (a long call, or native "
                                "code such as a collective waiting for the other ranks); it stops when the step ends. where shows where it is now.")

    def _break(self, where: str) -> str:
        """``b``: the breakpoints; ``b LINE`` (in the selected frame's file) or ``b FILE:LINE``: one more."""
        if not where:
            points = self._stepper.breakpoints if self._stepper is not None else {}
            return "\n".join(f"{path}:{n}" for path, lines in points.items() for n in lines) or "no breakpoints"
        path, _, number = where.rpartition(":")
        if not path and self.selected is not None and self.frames:
            path = self.frames[self.selected].filename
        if not number.isdigit() or not path:
            return "*** b LINE (in the selected frame's file) or b FILE:LINE"
        why = self._debugpy().set_breakpoint(path, int(number))
        if why:
            return f"*** no breakpoint at {path}:{number}: {why}"
        return (f"[distnb] breakpoint at {path}:{number} on rank {self.rank}: it pauses there, the other ranks then waiting at their "
                "next collective; c waits for it (interrupt to stop waiting), q clears it")

    def _to_breakpoint(self) -> Stop:
        """``c`` with breakpoints: on, until the rank stops at one (as long as it takes), the rank
        asked every few seconds whether it is still there (which renews its lease)."""
        assert self._stepper is not None
        self._stepper.proceed()
        while (stop := self._stepper.stopped(ALIVE_EVERY)) is None:
            why = self._stepper.alive()
            if why:
                raise RuntimeError(f"rank {self.rank} stopped answering while the notebook waited for its breakpoint ({why}): "
                                   "the job may have ended; %dist_status shows its ranks")
        return stop

    def _until_stop(self, act: Callable[[], Stop | None], failed: str, running: str) -> str:
        """``act`` (a pause, a step), then where it stopped, or ``running`` while it has not."""
        try:
            stop = act()
        except RuntimeError as exc:
            return f"*** {failed}{exc}"
        return running if stop is None else self._stopped(stop)

    def _stopped(self, stop: Stop) -> str:
        self._read_frames(select_user=True)
        why = f" ({stop.text})" if stop.text and stop.reason == "exception" else ""
        return f"[distnb] rank {self.rank} paused ({stop.reason}{why})\n" + self._where(current_only=True)


def _innermost_user(frames: list[PeekFrame]) -> int | None:
    """Where pdb would stand: the innermost frame of the user's code (else the innermost there is)."""
    users = [i for i, f in enumerate(frames) if f.user]
    return users[-1] if users else (len(frames) - 1 if frames else None)


def _seen(frames: list[PeekFrame], index: int | None) -> tuple[str, str] | None:
    """The (file, function) of frame ``index`` as last read: the rank checks it is still that one."""
    return (frames[index].filename, frames[index].function) if index is not None and 0 <= index < len(frames) else None


def _as_look(line: str) -> tuple[str, str | None]:
    """The look a console line asks for: p/pp EXPR, a, locals, else the line run (``!`` or not)."""
    word, _, rest = line.partition(" ")
    rest = rest.strip()
    if word in ("p", "pp") and rest:
        return ("pretty" if word == "pp" else "eval"), rest
    if word in ("a", "args") and not rest:
        return "args", None
    if word == "locals" and not rest:
        return "locals", None
    return "exec", line[1:] if line.startswith("!") else line


def _expression(text: str | None) -> bool:
    try:
        compile(text or "", "<ranks>", "eval")
    except SyntaxError:
        return False
    return True


def _grouped(ranks: list[int], text: str) -> str:
    who = format_ranks(ranks)
    return f"{who}: {text}" if "\n" not in text else f"{who}:\n" + "\n".join(f"  {line}" for line in text.splitlines())


def _frame_line(frame: PeekFrame, selected: bool) -> str:
    mark = ">" if selected else " "
    code = f": {frame.code}" if frame.code else ""
    return f"{mark} {frame.filename}:{frame.line} in {frame.function}{code}"
