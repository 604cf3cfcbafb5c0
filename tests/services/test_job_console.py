"""The console on a rank of a live job (services/job_console.py) through its seams: a scripted rank
answering the looks, and a scripted debugpy. The real thing runs in tests/e2e/test_attach_e2e.py
(a hung rank) and tests/e2e/test_attach_debug_e2e.py (pause and step a running one)."""

from __future__ import annotations

from typing import Any

from distnb.errors import AttachError
from distnb.services.job_console import CONSOLE_HELP, JobConsole, warning
from distnb.services.job_stepper import Stop
from distnb.wire.record_types import PeekFrame, PeekRead

FRAMES = [
    PeekFrame("train.py", 40, "<module>", "main()", True),
    PeekFrame("train.py", 31, "main", "loss = step(model, batch)", True),
    PeekFrame("train.py", 12, "step", "dist.all_reduce(t)", True),
    PeekFrame("/site-packages/torch/distributed/distributed_c10d.py", 2800, "all_reduce", "work = group.allreduce([tensor], opts)", False),
]


class ScriptedRank:
    def __init__(self) -> None:
        self.frames = list(FRAMES)
        self.asked: list[tuple[str, int | None, str | None]] = []

    def look(self, rank: int, what: str, frame: int | None, expr: str | None, want: tuple[str, str] | None) -> PeekRead:
        self.asked.append((what, frame, expr))
        read: PeekRead = {"frames": self.frames}
        if frame is not None:
            assert want == (self.frames[frame].filename, self.frames[frame].function)  # the frame as the console saw it
            read["frame"] = frame
        if what == "eval":
            read.update({"value": f"<{expr} in {self.frames[frame or 0].function}>"} if expr != "boom" else {"error": "NameError: name 'boom' is not defined"})
        elif what in ("exec", "pretty", "args", "locals"):
            read["value"] = f"{what}:{expr}"
        elif what == "source":
            line = self.frames[frame or 0].line
            read["source"] = [(line - 1, "before"), (line, "here")]
        return read


class ScriptedDebugpy:
    """Stands in for JobStepper: a pause lands (or not, in native code); steps move the frames."""

    def __init__(self, rank: ScriptedRank, lands: bool = True) -> None:
        self.rank = rank
        self.lands = lands
        self.paused = self.pending = self.started = False
        self.breakpoints: dict[str, list[int]] = {}
        self.calls: list[str] = []

    def pause(self) -> Stop | None:
        self.calls.append("pause")
        self.started = True
        if not self.lands:
            self.pending = True
            return None
        self.paused = True
        return Stop("pause")

    def step(self, command: str) -> Stop | None:
        self.calls.append(command)
        self.rank.frames[2] = self.rank.frames[2]._replace(line=self.rank.frames[2].line + 1)
        return Stop("step")

    def stopped(self, wait: float) -> Stop | None:
        if self.pending and self.breakpoints:  # runs on to the breakpoint
            self.paused, self.pending = True, False
            self.rank.frames[2] = self.rank.frames[2]._replace(line=self.breakpoints["train.py"][0])
            return Stop("breakpoint")
        return None

    def resume(self) -> str:
        self.calls.append("continue")
        self.paused = self.pending = False
        self.breakpoints.clear()
        return ""

    def set_breakpoint(self, path: str, line: int) -> str:
        self.started = True
        if line == 999:
            return "no code on line 999"
        self.breakpoints.setdefault(path, []).append(line)
        return ""

    def clear_breakpoints(self) -> None:
        self.breakpoints.clear()

    def proceed(self) -> None:
        self.calls.append("proceed")
        self.paused, self.pending = False, True


def console(lands: bool = True) -> tuple[JobConsole, ScriptedRank, ScriptedDebugpy]:
    rank = ScriptedRank()
    debugpy = ScriptedDebugpy(rank, lands)
    made: Any = lambda: debugpy  # noqa: E731
    return JobConsole(2, 4, rank.look, made), rank, debugpy


def test_it_opens_at_the_innermost_frame_of_the_users_code_and_moves_like_pdb() -> None:
    c, rank, _ = console()
    assert c.open() == "> train.py:12 in step: dist.all_reduce(t)"  # not torch's frame inside it
    where = c.run("where").splitlines()
    assert where[2].startswith("> train.py:12") and where[3].startswith("  /site-packages/torch") and len(where) == 4
    assert c.run("u") == "> train.py:31 in main: loss = step(model, batch)"
    assert c.run("p loss") == "<loss in main>"  # in the frame selected
    assert c.run("up 5") == "*** Oldest frame" and c.run("d 2") == "> /site-packages/torch/distributed/distributed_c10d.py:2800 in all_reduce: " \
        "work = group.allreduce([tensor], opts)"
    assert c.run("d") == "*** Newest frame" and c.run("u x") == "*** u takes a number of frames, not 'x'"
    assert c.run("l") == "2799    before\n2800 -> here"
    assert c.run("p boom") == "*** NameError: name 'boom' is not defined"
    assert c.run("pp cfg") == "pretty:cfg" and c.run("a") == "args:None" and c.run("locals") == "locals:None"
    assert c.run("!x = 1") == "exec:x = 1" and c.run("x = 2") == "exec:x = 2"  # like pdb: any other line runs
    assert c.run("h") == CONSOLE_HELP and c.run("") == ""
    assert ("eval", 1, "loss") in rank.asked


def test_steps_need_a_pause_which_is_taken_back_on_leaving() -> None:
    c, _, debugpy = console()
    c.open()
    assert c.run("n") == "*** rank 2 is not paused (it runs on): `pause` first" and debugpy.calls == []
    assert c.run("pause") == "[distnb] rank 2 paused (pause)\n> train.py:12 in step: dist.all_reduce(t)"
    assert c.run("n") == "[distnb] rank 2 paused (step)\n> train.py:13 in step: dist.all_reduce(t)"
    assert c.run("c") == "[distnb] rank 2 goes on; left it." and c.done
    assert debugpy.calls == ["pause", "next", "continue"]
    assert c.leave() == ""  # once


def test_a_pause_that_has_not_landed_is_taken_back() -> None:
    c, _, debugpy = console(lands=False)
    c.open()
    assert c.run("pause").startswith("[distnb] rank 2 is in native code (a collective, a kernel, I/O): it stops when it comes back")
    assert c.run("n").startswith("*** rank 2 has not stopped yet: what was asked (pause, step) lands when its main thread comes back")
    assert c.run("p x") == "<x in step>"  # its frames are read all the same
    assert c.run("q") == "[distnb] left rank 2; the pause asked for is taken back, it runs on."
    assert debugpy.calls == ["pause", "continue"]


def test_leaving_without_a_pause_changes_nothing() -> None:
    c, _, debugpy = console()
    c.open()
    assert c.run("q") == "[distnb] left rank 2; it runs on as it was." and debugpy.calls == []


def test_the_warning_says_what_debugging_a_live_rank_does() -> None:
    text = warning(3, "job-1", 1234, "in all_reduce #4 (group 0) for 35.0 s")
    assert text.startswith("[distnb] debugging rank 3 of the live job job-1 (pid 1234): what you type runs in that process")
    assert "`pause` stops it at its next Python line" in text and "other ranks wait for it at their next collective" in text
    assert text.endswith("[distnb] rank 3 is in all_reduce #4 (group 0) for 35.0 s")


def test_a_look_across_ranks_groups_equal_answers_the_most_ranks_first() -> None:
    """``ranks R: p step`` on a job whose rank 3 is one step behind and whose rank 1 does not answer:
    each rank is read in the innermost frame of its user's code, this rank in the frame selected."""
    asked: list[tuple[int, str, int | None, str | None]] = []

    def look(rank: int, what: str, frame: int | None, expr: str | None, want: tuple[str, str] | None) -> PeekRead:
        asked.append((rank, what, frame, expr))
        if rank == 1:
            raise AttachError("rank 1 gave no answer: its process (pid 7) is gone.")
        read: PeekRead = {"frames": FRAMES}
        if what == "eval":
            read["value"] = "39" if rank == 3 else "40"
        elif what == "locals":
            read["value"] = f"step = {39 if rank == 3 else 40}\nrank = {rank}"
        return read

    made: Any = lambda: None  # noqa: E731
    c = JobConsole(2, 5, look, made)
    c.open()
    c.run("u")  # this rank's selected frame: main (1)
    assert c.run("ranks all: p step") == ("ranks 0,2,4: 40\nrank 1: *** rank 1 gave no answer: its process (pid 7) is gone.\n"
                                          "rank 3: 39")
    assert (2, "eval", 1, "step") in asked and (0, "eval", 2, "step") in asked  # the selected frame here, the user's innermost there
    assert c.run("ranks 3-4: locals") == "rank 3:\n  step = 39\n  rank = 3\nrank 4:\n  step = 40\n  rank = 4"
    assert c.run("ranks 0-9: p step") == "*** ranks 5, 6, 7, 8, 9 are out of range: this pool has ranks 0-4."
    assert c.run("ranks all: x = 1").startswith("*** ranks R: takes looks")
    assert c.run("ranks all") == "*** ranks R: CMD (R: 0-3 · 1,3 · all; CMD: p, pp, a, locals or an expression)"


def test_breakpoints_are_set_in_the_selected_frames_file_and_cleared_on_leaving() -> None:
    c, _, debugpy = console()
    c.open()
    assert c.run("b") == "no breakpoints" and c.run("b x") == "*** b LINE (in the selected frame's file) or b FILE:LINE"
    assert c.run("b 20").startswith("[distnb] breakpoint at train.py:20 on rank 2: it pauses there")
    assert c.run("b train.py:999") == "*** no breakpoint at train.py:999: no code on line 999"
    assert c.run("b") == "train.py:20"
    assert c.run("c") == "[distnb] rank 2 paused (breakpoint)\n> train.py:20 in step: dist.all_reduce(t)"
    assert debugpy.calls == ["proceed"] and not c.done  # c with breakpoints stays in the console
    assert c.run("q") == "[distnb] rank 2 goes on; left it, its breakpoints cleared." and debugpy.breakpoints == {}


def test_a_cleared_breakpoint_still_leaves_the_rank_untraced() -> None:
    c, _, debugpy = console()
    c.open()
    c.run("b 20")
    assert c.run("cl") == "[distnb] rank 2's breakpoints cleared" and c.run("cl") == "no breakpoints"
    assert c.run("q") == "[distnb] left rank 2; it runs on as it was." and debugpy.calls == ["continue"]  # the rank told to untrace
