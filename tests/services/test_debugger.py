"""The debugger console's words and choices, without processes: commands, grouped answers, where a
rank stands, the paused-not-hung diagnosis and the post-mortem's default rank."""

from __future__ import annotations

import pytest

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position, position_paused
from distnb.config import LaunchConfig
from distnb.controller.prompts import Prompt
from distnb.controller.tracker import Tracker
from distnb.errors import NoCellError
from distnb.results import CellResult, RankResult
from distnb.services.debugger import Debugger, parse_command, render_answers


@pytest.mark.parametrize(("line", "kind", "ranks", "text"), [
    ("p x", "send", None, "p x"),
    ("list", "list", None, ""),
    ("list 10", "send", None, "list 10"),  # pdb's own list, with an argument
    ("attach 2", "attach", [2], ""),
    ("attach 1-3", "attach", [1, 2, 3], ""),
    ("ranks 0-3: n", "send", [0, 1, 2, 3], "n"),
    ("ranks 0:4:2: p x", "send", [0, 2], "p x"),
    ("ranks all: c", "send", [0, 1, 2, 3], "c"),
    ("detach", "detach", None, ""),
    ("detach 1,3", "detach", [1, 3], ""),
    ("help", "help", None, ""),
])
def test_console_commands(line: str, kind: str, ranks: list[int] | None, text: str) -> None:
    cmd = parse_command(line, 4)
    assert (cmd.kind, cmd.ranks, cmd.text) == (kind, ranks, text)


@pytest.mark.parametrize(("line", "error"), [
    ("attach", "attach which rank"),
    ("attach 7", "out of range"),
    ("ranks 1:2:3:4: n", "can't read"),
    ("ranks 0-1 p x", "write the ranks, a colon and the command"),
    ("ranks x: n", "can't read 'x'"),
])
def test_bad_console_commands_say_what_to_type(line: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_command(line, 4)


def _prompt(rank: int, output: str = "", where: dict | None = None, kind: str = "pdb") -> Prompt:
    return Prompt.of(rank, {"id": 1, "cell": 7, "kind": kind, "prompt": "(Pdb) ", "output": output, "where": where, "mode": "breakpoint"})


def test_identical_answers_are_shown_once_for_the_ranks_that_gave_them() -> None:
    text = render_answers([_prompt(0, "1\n"), _prompt(1, "2\n"), _prompt(2, "1\n"), _prompt(3, "")])
    assert text == "[ranks 0,2] 1\n[rank 1] 2"
    long = render_answers([_prompt(0, "> <cell-7>(4)<module>()\n-> y = 1\n")])
    assert long == "[rank 0]\n> <cell-7>(4)<module>()\n-> y = 1"


def test_where_a_paused_rank_stands_in_words() -> None:
    context = [(3, "    breakpoint()"), (4, "y = x + 1"), (5, "dist.all_reduce(t)")]
    at_cell = _prompt(2, where={"file": "<cell-7>", "line": 4, "func": "<module>", "cell": 7, "code": "y = x + 1", "context": context})
    assert at_cell.place() == "cell 7 line 4 (y = x + 1)"
    assert at_cell.source().splitlines() == ["     3 |     breakpoint()", "  -> 4 | y = x + 1", "     5 | dist.all_reduce(t)"]
    in_function = _prompt(2, where={"file": "<cell-5>", "line": 2, "func": "step", "cell": 5, "code": "loss = f(x)", "context": []})
    assert in_function.place() == "step() (cell 5 line 2) (loss = f(x))"
    library = _prompt(2, where={"file": "/x/torch/nn/functional.py", "line": 10, "func": "relu", "cell": None, "code": "", "context": []})
    assert library.place() == "/x/torch/nn/functional.py:10 in relu()"
    assert _prompt(1).place() == "an unknown place"


def test_a_paused_rank_is_not_a_hang_and_the_ranks_waiting_for_it_are_named() -> None:
    paused = position_paused(2, {"kind": "pdb", "since": 30.0, "where": {"line": 4, "cell": 7, "code": "y = x + 1", "func": "<module>"}}, 7)
    waiting = [Position(r, "collective", op="all_reduce", seq=3, group="0", since=30.0, line=6) for r in (0, 1, 3)]
    diag = diagnose([waiting[0], waiting[1], paused, waiting[2]], hang_after=1.0, elapsed=31.0)
    assert diag.state == "paused" and not diag.culprits
    assert diag.summary == ("rank 2 is paused in the debugger at cell line 4; ranks 0,1,3 wait for it in all_reduce #3 at cell line 6 "
                            "— not a hang: answer the prompt (c continues), or interrupt the cell.")
    assert "  rank 2: paused in the debugger for 30.0 s at cell line 4 (y = x + 1)" in diag.text()
    typing = position_paused(1, {"kind": "input", "since": 2.0, "where": None}, 7)
    assert diagnose([typing], 1.0, 3.0).summary.startswith("rank 1 is waiting for input() — not a hang")
    stepped = position_paused(0, {"kind": "pdb", "since": 1.0, "where": {"file": "/t/f.py", "line": 9, "func": "g", "cell": None}}, 7)
    assert stepped.where() == "paused in the debugger in g() (/t/f.py:9) for 1.0 s"


def _failed(cell: int, errors: dict[int, tuple[str, str, float]]) -> CellResult:
    results = {r: RankResult(r, status="ok") for r in range(4)}
    for r, (ename, evalue, at) in errors.items():
        results[r] = RankResult(r, status="error", error={"ename": ename, "evalue": evalue}, finished_at=at)
    return CellResult(cell=cell, code="", ranks=list(range(4)), results=results)


def test_post_mortem_opens_the_root_cause_rank_of_the_last_cell_that_raised() -> None:
    # Choosing a rank reads only the history it is given: a tracker of its own, no pool.
    debugger = Debugger(Tracker(4), LaunchConfig(nproc=4, backend="gloo"), diagnose=lambda *a, **k: None)  # type: ignore[arg-type, return-value]
    peer_lost = ("RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", 1.0)
    history = [
        _failed(1, {0: ("KeyError", "'a'", 5.0)}),
        _failed(2, {1: peer_lost, 3: ("ValueError", "bad shape", 2.0)}),  # rank 3's error is the cause
        _failed(3, {}),
    ]
    assert debugger.post_mortem_rank(history) == 3
    assert debugger.post_mortem_rank(history[:1]) == 0
    same = _failed(4, {2: ("ValueError", "x", 2.0), 1: ("ValueError", "x", 2.0)})
    assert debugger.post_mortem_rank([same]) == 1  # the same error everywhere: the lowest rank
    quit_only = _failed(5, {1: ("BdbQuit", "quit from the debugger (q)", 1.0)})
    with pytest.raises(NoCellError, match="nothing to debug post-mortem.*--pdb"):
        debugger.post_mortem_rank([quit_only, _failed(6, {})])
