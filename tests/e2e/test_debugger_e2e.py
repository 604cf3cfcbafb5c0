"""The debugger and input() across ranks on real pools, driven through the Python API: ``ask`` is
what a front-end types (a script of lines here), ``write`` what it shows."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

import distnb
from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

from conftest import MARK_INSIDE, wait_until

#: From q to the cell's end on a rank released from a collective: the interrupt's escalation
#: (ESCALATE_AFTER), then the gloo wait's end and the messages back, with margin for a loaded machine.
RELEASE_BOUND = ESCALATE_AFTER + 10.0


class Console:
    """A scripted front-end: answers each prompt with the next line (or raises the next exception)
    and keeps every prompt and everything written, in order. ``during`` runs at a prompt."""

    def __init__(self, *lines: Any, during: Callable[[str], None] | None = None) -> None:
        self.lines = list(lines)
        self.prompts: list[str] = []
        self.shown: list[str] = []
        self.during = during

    def ask(self, prompt: str) -> str:
        self.prompts.append(prompt)
        self.shown.append(f"<{prompt}>")
        if self.during is not None:
            self.during(prompt)
        assert self.lines, f"an unexpected prompt {prompt!r}; so far:\n{self.text}"
        line = self.lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    @property
    def text(self) -> str:
        return "\n".join(self.shown)

    def after(self, n: int) -> str:
        """What was shown between the ``n``-th prompt (from 0) and the next."""
        marks = [i for i, text in enumerate(self.shown) if text.startswith("<") and text.endswith(">")]
        end = marks[n + 1] if n + 1 < len(marks) else len(self.shown)
        return "\n".join(self.shown[marks[n] + 1 : end])


def run(pool: distnb.Pool, code: str, console: Console, asking: list[int] | None = None, **kwargs: Any) -> distnb.CellResult:
    """``pool.run`` with the console's ask, and its writes captured too. ``asking``: the ranks the
    test needs at its first prompt together — the console is opened once each of them asks (the
    debugger gathers the ranks that ask within a moment of each other, and on a busy machine one
    may get there seconds later: it then gets a prompt of its own, as it should)."""
    original = pool.debugger.console

    def console_with_capture(result: Any, ask: Any, write: Any = None, before_prompt: Any = None) -> None:
        original(result, ask, console.shown.append, before_prompt)

    timeout = kwargs.pop("timeout", 60)
    res = pool.submit(code, **kwargs)
    if asking:
        try:
            wait_until(lambda: {p.rank for p in pool.debugger.pending(res)} >= set(asking) or not res.running, 60,
                       f"ranks {asking} to ask")
        except AssertionError:
            pool.interrupt()  # the shared pool must not stay at the prompts
            pool.wait(res, 30, ask=None)
            raise
    pool.debugger.console = console_with_capture  # type: ignore[method-assign]
    try:
        return pool.wait(res, timeout, ask=console.ask)
    finally:
        del pool.debugger.console


def test_a_breakpoint_on_one_rank_of_four_steps_with_labelled_answers_while_the_others_wait(pool: distnb.Pool, tmp_path: Path) -> None:
    diagnoses: list[distnb.Verdict] = []
    # Rank 2 stops once the others wait inside the all_reduce (their files), however busy the machine.
    assert pool.run(MARK_INSIDE).ok
    # (At most 120 s: a test that failed first must not leave the rank spinning.)
    code = ("dbg_x, dbg_end = rank + 40, __import__('time').monotonic() + 120\nif rank == 2:\n"
            f"    while len(__import__('os').listdir({str(tmp_path)!r})) < 3 and __import__('time').monotonic() < dbg_end: __import__('time').sleep(0.01)\n"
            "    breakpoint()\ndbg_y = dbg_x + 1\nt = torch.tensor([float(dbg_y)])\n"
            f"if rank != 2: dbg_mark_inside(f'{tmp_path}/{{rank}}')\ndist.all_reduce(t)\nt")
    con = Console("p dbg_x", "n", "p dbg_y", "c", during=lambda _: diagnoses.append(pool.diagnose(pool.history[-1])))
    result = run(pool, code, con)
    assert result.ok, result.text()
    assert result.values == {r: "tensor([170.])" for r in range(4)}
    assert con.prompts == ["[rank 2] (Pdb) "] * 4
    text = con.text
    # Where it stands, with the source around, and what the others do meanwhile.
    assert "rank 2 is paused in the debugger at cell" in text and "line 5 (dbg_y = dbg_x + 1)" in text
    assert "  -> 5 | dbg_y = dbg_x + 1" in text and "     4 |     breakpoint()" in text
    assert "ranks 0,1,3: waiting in all_reduce #" in text and "at cell line 8 (dist.all_reduce(t))" in text
    assert "ranks 0,1,3 wait for the paused rank: --pg-timeout (1800 s) ends their wait with an error in" in text
    # Answers labelled by rank, in order.
    assert "[rank 2] 42" in text and "[rank 2] 43" in text
    assert text.index("[rank 2] 42") < text.index("line 6 (t = torch.tensor") < text.index("[rank 2] 43")
    # Paused is not hung: the hang watch says who waits for whom.
    assert diagnoses and all(d.state == "paused" for d in diagnoses)
    assert diagnoses[0].summary.startswith("rank 2 is paused in the debugger at cell line 5; ranks 0,1,3 wait for it in all_reduce #")
    assert "not a hang" in diagnoses[0].summary
    stacks = pool.stacks()  # after the cell: nobody paused
    assert not any(s.paused for s in stacks.ranks)


def test_one_command_to_several_ranks_groups_identical_answers(pool: distnb.Pool) -> None:
    con = Console("ranks 0-3: p dbg_r % 2", "ranks 0:4:2: p rank", "attach 3", "p rank", "attach all", "c")
    result = run(pool, "dbg_r = rank\nbreakpoint()\ndbg_s = 1", con, asking=[0, 1, 2, 3])
    assert result.ok, result.text()
    text = con.text
    assert "ranks 0-3 are paused in the debugger at cell" in text
    assert "[ranks 0,2] 0" in text and "[ranks 1,3] 1" in text
    assert "[rank 0] 0" in con.after(1) and "[rank 2] 2" in con.after(1) and "rank 1" not in con.after(1)
    assert "commands go to rank 3." in text and "[rank 3] 3" in text
    assert con.prompts[3] == "[rank 3] (Pdb) " and con.prompts[5] == "[ranks 0-3] (Pdb) "


def test_quitting_on_one_rank_raises_there_only_and_the_pool_stays_healthy(pool: distnb.Pool) -> None:
    con = Console("q")
    result = run(pool, "dbg_q = rank\nif rank == 1:\n    breakpoint()\n    dbg_q = 'never'\ndbg_q", con)
    assert result[1].status == "error" and result[1].error["ename"] == "BdbQuit"
    assert "quit from the debugger (q)" in result[1].error["evalue"]
    assert "bdb.py" not in result[1].error["traceback"]  # the cell's line, not pdb's insides
    assert [result[r].status for r in (0, 2, 3)] == ["ok"] * 3
    after = pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert after.ok and after.values == {r: "4.0" for r in range(4)}


def test_detach_continues_and_ignores_the_cells_remaining_breakpoints(pool: distnb.Pool) -> None:
    con = Console("detach")
    result = run(pool, "dbg_n = 0\nfor _ in range(3):\n    breakpoint()\n    dbg_n += 1\ndbg_n", con, asking=[0, 1], ranks=[0, 1])
    assert result.ok and result.values == {0: "3", 1: "3"}
    assert con.prompts == ["[ranks 0,1] (Pdb) "]


def test_an_interrupt_while_paused_stops_the_cell_and_the_pool_runs_on(pool: distnb.Pool) -> None:
    con = Console(KeyboardInterrupt())
    result = run(pool, "dbg_i = rank\nif rank == 3:\n    breakpoint()\n    dbg_i = 'never'", con)
    assert result[3].status == "interrupted" and result[3].error["ename"] == "KeyboardInterrupt"
    assert "DebugInterrupt" not in result[3].error["traceback"] and "cmd.py" not in result[3].error["traceback"]
    assert pool.run("dbg_i").values == {0: "0", 1: "1", 2: "2", 3: "3"}


def test_post_mortem_at_the_root_cause_rank_and_on_ranks_pdb(pool: distnb.Pool) -> None:
    failed = pool.run("def dbg_f(v):\n    dbg_local = v * 2\n    raise ValueError(f'bad {dbg_local}')\nif rank == 2:\n    dbg_f(21)")
    assert failed[2].status == "error"
    con = Console("p dbg_local", "w", "c")
    session = run_debug(pool, con)
    assert session.ok and session.ranks == [2]
    text = con.text
    assert "rank 2 is in post-mortem at dbg_f() (cell" in text and "(raise ValueError(f'bad {dbg_local}'))" in text
    assert "[rank 2] 42" in text
    assert "<module>()" in con.after(1) and "dbg_f()" in con.after(1) and "execute.py" not in con.after(1)  # w: from the cell on
    assert pool.history[-1] is failed  # the post-mortem is not a cell of the session
    # --pdb: every rank that raises stops at its error; the cell then reports the error as usual.
    con = Console("p dbg_v", "c")
    result = run(pool, "dbg_v = rank * 100\nif rank in (1, 3):\n    1 / 0", con, asking=[1, 3], pdb=True)
    assert "ranks 1,3 are in post-mortem at cell" in con.text and "[rank 1] 100" in con.text and "[rank 3] 300" in con.text
    assert [result[r].status for r in range(4)] == ["ok", "error", "ok", "error"]


def run_debug(pool: distnb.Pool, con: Console) -> distnb.CellResult:
    original = pool.debugger.console

    def capture(result: Any, ask: Any, write: Any = None, before_prompt: Any = None) -> None:
        original(result, ask, con.shown.append, before_prompt)

    pool.debugger.console = capture  # type: ignore[method-assign]
    try:
        return pool.debug(ask=con.ask)
    finally:
        del pool.debugger.console


def test_input_on_two_ranks_is_answered_in_turn_and_no_input_box_is_a_clear_eof(pool: distnb.Pool) -> None:
    con = Console("alice", "bob")
    result = run(pool, "dbg_name = input(f'name for rank {rank}? ') if rank in (1, 2) else 'none'\ndbg_name", con, asking=[1, 2])
    assert con.prompts == ["[rank 1] name for rank 1? ", "[rank 2] name for rank 2? "]
    assert result.values == {0: "'none'", 1: "'alice'", 2: "'bob'", 3: "'none'"}
    # sys.stdin reads the notebook too.
    con = Console("from stdin")
    assert run(pool, "import sys\nsys.stdin.readline()", con, ranks=[0]).values == {0: "'from stdin\\n'"}
    # A front-end that can't read a line: input() raises EOFError saying why, breakpoints are let go.
    con = Console(*[EOFError("no stdin")] * 3)
    result = run(pool, "breakpoint()\ninput('x? ')", con, asking=[0, 1], ranks=[0, 1])
    assert "no line can be read here (EOFError: no stdin): ranks 0,1 continue without the debugger" in con.text
    assert result[0].error["ename"] == "EOFError" and "input() got no answer" in result[0].error["evalue"]


def test_quitting_a_rank_the_others_wait_for_releases_them_as_the_console_says(fresh_pool: Callable[..., distnb.Pool]) -> None:
    """q on the rank the others wait for in a collective. This used to leave them there until
    --pg-timeout (the trap): now they are interrupted at once — their gloo wait is unblocked after
    ESCALATE_AFTER — the group is rebuilt once the cell has ended, and the pool runs on. The
    --pg-timeout is far beyond the bound, so a pass can't come from the collective timing out."""
    pool = fresh_pool(2, pg_timeout=120.0, hang_after=1.0)
    with pytest.raises(distnb.NoCellError, match="nothing to debug post-mortem"):
        pool.debug()
    nothing = pool.debug(0, ask=Console().ask)  # no cell raised on rank 0: a clear error, not a prompt
    assert nothing[0].status == "error" and "nothing to debug" in nothing[0].error["evalue"]
    quit_at: list[float] = []
    con = Console("q", during=lambda _: quit_at.append(time.monotonic()))
    result = run(pool, "t = torch.ones(1)\nif rank == 1:\n    breakpoint()\ndist.all_reduce(t)", con, timeout=RELEASE_BOUND + 30)
    ended = time.monotonic() - quit_at[-1]
    assert "rank 0 waits for the paused rank: --pg-timeout (120 s) ends its wait with an error in" in con.text  # warned first
    assert ("[distnb] rank 1 leaves the cell (quit from the debugger (q)): rank 0 was waiting for it in all_reduce: interrupting "
            f"it now (a wait in gloo or NCCL is unblocked within {ESCALATE_AFTER:.0f} s") in con.text
    assert result[1].error["ename"] == "BdbQuit" and result[0].status == "interrupted", result.text()
    assert ended < RELEASE_BOUND, f"the cell ended {ended:.1f} s after q"
    assert any("fresh default process group" in n for n in result.notes), result.text()
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}


def test_a_front_end_drives_the_paused_ranks_through_pool_debugger(pool: distnb.Pool) -> None:
    """No console: the cell is submitted, its prompts read and answered through the API."""
    result = pool.submit("dbg_api = rank * 3\nif rank == 1:\n    breakpoint()\ndbg_api += 1\ndbg_api")
    pool.wait(result, timeout=0.3, ask=None)  # returns: nobody answers prompts here
    debugger = pool.debugger
    assert debugger.settle(result, [1], timeout=10) == []
    [prompt] = debugger.pending(result)
    assert (prompt.rank, prompt.kind, prompt.mode, prompt.place()) == (1, "pdb", "breakpoint", f"cell {result.cell} line 4 (dbg_api += 1)")
    debugger.answer(prompt, "p dbg_api")
    assert debugger.settle(result, [1], timeout=10) == []
    [prompt] = debugger.pending(result)
    assert prompt.output == "3\n"
    debugger.answer(prompt, "c")
    pool.wait(result, timeout=30, ask=None)
    assert result.ok and result.values == {0: "1", 1: "4", 2: "7", 3: "10"}
