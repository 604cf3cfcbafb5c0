"""The debugger and input() where users type: a real Jupyter kernel (jupyter_client's
``execute_interactive`` answering ``input_request`` as a front-end does) and the IPython terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import kernels
import pytest

from conftest import MARK_INSIDE, reap_marked

pytestmark = pytest.mark.slow  # every test here starts a kernel or a shell, and a pool

MARK = "DISTNB_DEBUGGER_TEST"
INTERRUPT = "<interrupt the kernel>"


class Frontend(kernels.Kernel):
    """One ipykernel (with this test's mark in its environment, and so in its pool's) driven as a
    notebook front-end: stdin requests answered from a script of lines, every text collected."""

    def __init__(self, cwd: Path) -> None:
        super().__init__(cwd, MARK)
        self.prompts: list[str] = []
        self.lines: list[str | Callable[[str], str]] = []

    def run(self, code: str, *lines: str | Callable[[str], str], allow_stdin: bool = True) -> tuple[dict[str, Any], str]:
        """Execute ``code``; each input_request gets the next of ``lines``. Returns the reply's
        content and the text shown (streams, errors), prompts included as ``<prompt>``; a callable
        line is given the prompt."""
        self.lines = list(lines)
        texts: list[str] = []

        def output(msg: dict[str, Any]) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                texts.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                texts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                texts.append("\n".join(content["traceback"]) + "\n")

        def stdin(msg: dict[str, Any]) -> None:
            prompt = msg["content"]["prompt"]
            self.prompts.append(prompt)
            texts.append(f"<{prompt}>\n")
            assert self.lines, f"unexpected prompt {prompt!r} after:\n{''.join(texts)}"
            line = self.lines.pop(0)
            if line == INTERRUPT:
                self.km.interrupt_kernel()  # the notebook's stop button, with the input box open
            else:
                self.kc.input(line(prompt) if callable(line) else line)

        # stop_on_error=False: one cell at a time, as a person runs them (see test_kernel_interrupt.py).
        reply = self.kc.execute_interactive(code, allow_stdin=allow_stdin, stdin_hook=stdin, output_hook=output,
                                            stop_on_error=False, timeout=120)
        return reply["content"], "".join(texts)


@pytest.mark.timeout(300)
def test_breakpoint_input_and_post_mortem_in_a_real_kernel(leak_check, tmp_path: Path) -> None:
    fe = Frontend(tmp_path)
    try:
        content, out = fe.run("%load_ext distnb\n%dist_launch -n 4 --backend gloo")
        assert content["status"] == "ok", out

        # A breakpoint on one rank of four; the others wait for it in a collective. Rank 2 stops
        # once the others wait inside it (their files), however busy the machine.
        entered = tmp_path / "entered"
        entered.mkdir()
        content, out = fe.run("%%on_ranks\n" + MARK_INSIDE)
        assert content["status"] == "ok", out
        code = ("%%on_ranks\ndbg_x, dbg_end = rank + 40, __import__('time').monotonic() + 120\nif rank == 2:\n"
                f"    while len(__import__('os').listdir({str(entered)!r})) < 3 and __import__('time').monotonic() < dbg_end: "
                "__import__('time').sleep(0.01)\n"
                "    breakpoint()\ndbg_y = dbg_x + 1\n"
                f"t = torch.tensor([float(dbg_y)])\nif rank != 2: dbg_mark_inside(f'{entered}/{{rank}}')\n"
                "dist.all_reduce(t)\nt.item()")
        content, out = fe.run(code, "p dbg_x", "n", "p dbg_y", "ranks 0-3: p rank", "c")
        assert content["status"] == "ok", out
        assert fe.prompts == ["[rank 2] (Pdb) "] * 5
        assert re.search(r"rank 2 is paused in the debugger at In\[\d+\] line 5 \(dbg_y = dbg_x \+ 1\)", out), out
        assert "ranks 0,1,3: waiting in all_reduce #1 on group 0" in out and "--pg-timeout (1800 s)" in out
        assert "[rank 2] 42" in out and "[rank 2] 43" in out, out
        assert "ranks 0,1,3 are not paused: not sent there" in out and out.count("[rank 2] 2") == 1, out

        # The stop button while the input box waits: the cell stops on the paused rank, the kernel and pool live on.
        content, out = fe.run("%%on_ranks 0,1\ndbg_i = rank\nif rank == 1:\n    breakpoint()\n    dbg_i = 'never'", INTERRUPT)
        assert "KeyboardInterrupt" in fe.run("print(_dist.text())")[1]
        # An interrupted cell did not finish: it raises (one line), so a Run All stops there too.
        assert content["status"] == "error" and content["ename"] == "CellFailed" and content["evalue"].endswith("interrupted on rank 1"), content
        content, out = fe.run("%dist_pull dbg_i --ranks 0,1")
        assert "{0: 0, 1: 1}" in out, out

        # input() on two ranks, answered in turn.
        fe.prompts.clear()
        def name(prompt: str) -> str:  # in the order the ranks asked, each answered for itself
            return {"[rank 1] who is rank 1? ": "ann", "[rank 3] who is rank 3? ": "bo"}[prompt]

        content, out = fe.run("%%on_ranks 1,3\ndbg_name = input(f'who is rank {rank}? ')\nprint('hello', dbg_name)", name, name)
        assert sorted(fe.prompts) == ["[rank 1] who is rank 1? ", "[rank 3] who is rank 3? "], out
        content, out = fe.run("%dist_pull dbg_name --ranks 1,3")
        assert "{1: 'ann', 3: 'bo'}" in out, out

        # A front-end without an input box (allow_stdin=False, as nbclient runs): said, and nothing waits.
        content, out = fe.run("%%on_ranks 0\nbreakpoint()\ndbg_after = 'went on'", allow_stdin=False)
        assert "no line can be read here (StdinNotImplementedError" in out and "rank 0 continue without the debugger" in out, out

        # Post-mortem at the root-cause rank, then --pdb.
        content, out = fe.run("%%on_ranks\ndef dbg_f(v):\n    dbg_local = v * 2\n    raise KeyError(dbg_local)\nif rank == 3:\n    dbg_f(5)")
        assert "KeyError" in fe.run("print(_dist.text())")[1]  # _dist holds the failed cell
        assert content["ename"] == "CellFailed" and content["evalue"].endswith("failed on rank 3: KeyError: 10"), content
        assert out.count("CellFailed") == 1 and content["traceback"] == [f"CellFailed: {content['evalue']}"], out
        fe.prompts.clear()
        content, out = fe.run("%dist_debug", "p dbg_local", "q")
        assert fe.prompts == ["[rank 3] (Pdb) "] * 2 and "rank 3 is in post-mortem at dbg_f() (In[" in out and "[rank 3] 10" in out, out
        fe.prompts.clear()
        content, out = fe.run("%%on_ranks --pdb 0,1\nraise RuntimeError(f'boom {rank}')", "ranks 0,1: p rank * 7", "ranks 0,1: c")
        assert "[rank 0] 0" in out and "[rank 1] 7" in out and "ranks 0,1 are in post-mortem at In[" in out, out
        assert content["ename"] == "CellFailed" and "failed on ranks 0,1: RuntimeError: boom" in content["evalue"], content
        assert "rank 1: boom 1" in fe.run("print(_dist.text())")[1]

        content, out = fe.run("%dist_shutdown")
        assert "no process left" in out, out
    finally:
        left = fe.close()
    assert not left, "the kernel left processes behind:\n  " + "\n  ".join(left)


@pytest.mark.timeout(180)
def test_breakpoint_and_input_in_the_ipython_terminal(leak_check, tmp_path: Path) -> None:
    """The terminal shell reads the debugger's lines from its own stdin, as a user types them."""
    token = uuid.uuid4().hex
    cell = "dbg_x = rank + 40\\nif rank == 1:\\n    breakpoint()\\ndbg_y = dbg_x + 1\\ndbg_z = 0\\n"
    script = "\n".join([
        "%load_ext distnb",
        "%dist_launch -n 2 --backend gloo",
        f"get_ipython().run_cell_magic('on_ranks', '', '{cell}')",
        "p dbg_x", "n", "p dbg_y", "c",
        "get_ipython().run_cell_magic('on_ranks', '', 'dbg_n = input(f\"name {rank}? \")')",
        "alice", "bob",
        "%dist_pull dbg_n",
        "get_ipython().run_cell_magic('on_ranks', '', 'if rank == 1:\\n    raise ValueError(\"term\")')",
        "%dist_shutdown",
        "exit",
    ]) + "\n"
    try:
        done = subprocess.run([sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"],
                              input=script, capture_output=True, text=True, timeout=150, cwd=tmp_path,
                              env={**os.environ, MARK: token})
    finally:
        left = reap_marked(MARK, token)
    out = done.stdout + done.stderr
    assert not left, "the shell left processes behind:\n  " + "\n  ".join(left)
    assert "rank 1 is paused in the debugger at In[3] line 4 (dbg_y = dbg_x + 1)" in out, out  # the terminal's In [3]
    assert "[rank 1] (Pdb) [rank 1] 41" in out and "[rank 1] 42" in out, out
    # The ranks ask in the order they reach input() (a loaded machine may run rank 1 first): each
    # prompt takes the next line typed.
    first = "[rank 0] name 0? [rank 1] name 1? " in out
    assert first or "[rank 1] name 1? [rank 0] name 0? " in out, out
    assert ("{0: 'alice', 1: 'bob'}" if first else "{0: 'bob', 1: 'alice'}") in out, out
    # A failed cell: its report (the rank's own traceback), then one line, no traceback of distnb's.
    assert re.search(r"^(In \[\d+\]: )?CellFailed: In\[\d+\] failed on rank 1: ValueError: term$", out, re.M), out
    assert out.count("CellFailed") == 1 and out.count("Traceback") == 1 and "ValueError on rank 1 at cell line 2" in out, out
    assert "no process left" in out and all("ValueError" in line for line in out.splitlines() if "Error" in line), out
