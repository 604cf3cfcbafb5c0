"""Delta debugging as the minimizer runs it (services/cases/minimize.py), on a predicate instead of a pool."""

from __future__ import annotations

import ast
import random
import sys
import traceback
from contextlib import contextmanager
from typing import Iterator

from distnb.analysis.cell_parts import function_bodies, replace_body, statements
from distnb.results import CellResult, RankResult
from distnb.services.cases.minimize import Runs, _ddmin, minimize, world_sizes


def test_ddmin_finds_the_one_minimal_subset_and_asks_few_questions() -> None:
    asked: list[list[int]] = []

    def fails(sub: list[int]) -> bool:
        asked.append(sub)
        return 3 in sub and 7 in sub  # the failure needs both

    assert _ddmin(list(range(10)), fails) == [3, 7]
    assert len(asked) < 40, len(asked)
    assert _ddmin(list(range(10)), lambda sub: True) == []  # nothing is needed
    assert _ddmin([1], lambda sub: 1 in sub) == [1]


def test_statements_are_the_cells_top_level_statements_as_written() -> None:
    code = "x = 1  # keep\nfor i in range(3):\n    y = i\n\nif rank == 1:\n    raise ValueError('bad')\n"
    assert statements(code) == ["x = 1", "for i in range(3):\n    y = i", "if rank == 1:\n    raise ValueError('bad')"]
    assert statements("def (") == ["def ("]  # a cell that does not parse stays whole


class _Ranks:
    """The minimizer's seam (minimize.Runs) over two in-process "ranks": each cell is exec'd in the
    rank's own namespace, and its error is the rank's outcome."""

    def __init__(self, world: int = 2, pushed: dict | None = None) -> None:
        self.ns: dict[int, dict] = {}
        self.pushed = pushed or {}  # names the namespace holds that no cell sets (a %dist_push)
        self.cell = 0
        self.world = world
        self.started: list[int] = []  # the smaller worlds started, in order

    def restart(self) -> None:
        self.ns = {r: {"rank": r, "world_size": self.world, **self.pushed} for r in range(self.world)}

    def runs(self) -> Runs:
        return Runs(self.restart, self.run, self.stop, self.world, self.smaller)

    @contextmanager
    def smaller(self, n: int) -> Iterator[Runs]:
        self.started.append(n)
        yield _Ranks(n).runs()

    def run(self, code: str, ranks: list[int], limit: float) -> CellResult:
        self.cell += 1
        res = CellResult(cell=self.cell, code=code, ranks=ranks, results={r: RankResult(r) for r in ranks})
        for r in ranks:
            try:
                exec(compile(code, "<cell>", "exec"), self.ns[r])
                res.results[r].status = "ok"
            except Exception as exc:
                # The cell's line where it raised, as a rank reports it (the innermost frame of the cell).
                frames = traceback.extract_tb(exc.__traceback__)
                line = next((f.lineno for f in reversed(frames) if f.filename == "<cell>"), None)
                res.results[r].status = "error"
                res.results[r].error = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": "", "line": line}
        return res

    def stop(self, res: CellResult) -> None:
        pass


def session(ranks: _Ranks, cells: list[str]) -> list[CellResult]:
    """The cells run once on both ranks, as a session ran them before it was minimized."""
    ranks.restart()
    return [ranks.run(code, [0, 1], 5.0) for code in cells]


def test_the_statements_inside_a_function_the_failing_cell_calls_are_cut_too() -> None:
    ranks = _Ranks()
    history = session(ranks, [
        "scale = int('3')\nunused = [1, 2]",
        "def step(x):\n    # the training step\n    y = x * scale\n    log = []\n    log.append(y)\n"
        "    if rank == 1:\n        raise ValueError(f'bad batch {y}')\n    return y",
        "a = 1\nz = step(2)\nb = 2",
    ])
    assert history[-1].failed == [1]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == [
        "scale = int('3')",
        "def step(x):\n    # the training step\n    y = x * scale\n    if rank == 1:\n        raise ValueError(f'bad batch {y}')",
        "z = step(2)",
    ], found.code()
    assert "removed 3 of the 5 statements of step()" in found.text(), found.text()
    assert function_bodies("def f(): return 1") == []  # a one-line function has no body to cut apart


def test_a_function_body_is_replaced_in_place_keeping_its_decorators_and_what_follows() -> None:
    code = "@torch.no_grad()\ndef evaluate(m):\n    a = 1\n    if a:\n        b = 2\n    return a\nafter = 1"
    assert function_bodies(code) == [("evaluate()", ["    a = 1", "    if a:\n        b = 2", "    return a"]),
                                     ("`if a:`", ["        b = 2"])]  # nested blocks too, outermost first
    assert replace_body(code, 0, ["    return a"]) == "@torch.no_grad()\ndef evaluate(m):\n    return a\nafter = 1"
    assert replace_body(code, 0, []) == "@torch.no_grad()\ndef evaluate(m):\n    pass\nafter = 1"


def test_an_else_branch_is_cut_apart_too_and_an_elif_chain_stays_whole() -> None:
    """A pasted script's ``if ddp: … else: …`` keeps a branch no rank runs: its statements are cut
    as a body's. An ``elif`` is the chain's next ``if`` (its own body and ``else:``); an ``else: x``
    on one line has no body to cut."""
    code = ("if ddp:\n    rank = 1\n    dev = 'cpu'\nelse:\n    # one process\n    master = True\n    world = 1\n"
            "if x:\n    e = 1\nelif y:\n    f = 1\nelse:\n    h = 3\n    i = 4\nif z: pass\nelse: j = 5\nafter = 1")
    assert function_bodies(code) == [("`if ddp:`", ["    rank = 1", "    dev = 'cpu'"]),
                                     ("the `else:` of `if ddp:`", ["    master = True", "    world = 1"]),
                                     ("`if x:`", ["    e = 1"]), ("`elif y:`", ["    f = 1"]),
                                     ("the `else:` of `elif y:`", ["    h = 3", "    i = 4"])]
    cut = replace_body(code, 1, ["    world = 1"])
    assert cut.startswith("if ddp:\n    rank = 1\n    dev = 'cpu'\nelse:\n    # one process\n    world = 1\nif x:"), cut
    assert replace_body(code, 4, []).endswith("elif y:\n    f = 1\nelse:\n    pass\nif z: pass\nelse: j = 5\nafter = 1")
    rng = random.Random(3)
    for k, (_, body) in enumerate(function_bodies(code)):  # every cut of every body still parses
        for _ in range(5):
            ast.parse(replace_body(code, k, rng.sample(body, rng.randint(0, len(body)))))


def test_a_failure_on_a_low_rank_is_cut_to_the_smallest_world_that_still_shows_it() -> None:
    ranks = _Ranks(world=4)
    ranks.restart()
    history = [ranks.run(code, [0, 1, 2, 3], 5.0) for code in (
        "x = rank * 2",
        "if rank == 1:\n    raise ValueError(f'bad batch {x}')",
    )]
    found = minimize(ranks.runs(), history, budget=60)
    assert (found.world_size, found.started_world, ranks.started) == (2, 4, [2]), found.text()
    assert found.signature.errors == {1: "ValueError: bad batch 2"} and found.cells[-1].ranks == (0, 1)
    assert "removed 2 of the 4 ranks: ranks 0,1 fail as they did" in found.text() and "on 2 ranks (the session had 4)" in found.text()


def test_a_failure_that_needs_the_last_rank_or_the_world_size_keeps_every_rank() -> None:
    for failing in ("if rank == 3:\n    raise ValueError('last rank')",  # no smaller world has rank 3: none is started
                    "if rank == 1:\n    raise ValueError(f'world {world_size}')"):  # rank 1 fails otherwise on fewer ranks
        ranks = _Ranks(world=4)
        ranks.restart()
        history = [ranks.run(failing, [0, 1, 2, 3], 5.0)]
        found = minimize(ranks.runs(), history, budget=60)
        assert found.world_size == 4 and found.cells[-1].ranks == (0, 1, 2, 3), found.text()
        assert ranks.started == ([] if "rank == 3" in failing else [2, 3]), ranks.started
        assert "ranks (the session had" not in found.text()


def test_the_worlds_tried_are_every_size_up_to_eight_then_halvings() -> None:
    assert world_sizes(4) == [2, 3] and world_sizes(2) == [] and world_sizes(64) == [2, 4, 8, 16, 32]


def test_a_smaller_pool_that_does_not_start_keeps_the_case_found_so_far() -> None:
    ranks = _Ranks(world=3)
    ranks.restart()
    history = [ranks.run("if rank == 1:\n    raise ValueError('bad')", [0, 1, 2], 5.0)]

    @contextmanager
    def refuse(n: int) -> Iterator[Runs]:
        raise RuntimeError("torchrun exited with code 1\nmore")
        yield  # pragma: no cover

    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop, 3, refuse), history, budget=60)
    assert found.world_size == 3 and not found.stopped, found.text()
    assert "kept 3 ranks: a pool of 2 did not start (torchrun exited with code 1)" in found.text(), found.text()


def test_a_loops_body_is_cut_and_what_it_no_longer_reads_goes_with_the_next_slice() -> None:
    ranks = _Ranks()
    history = session(ranks, [
        "lr = 0.1 * 1\nwarmup = 2 * 1\nlog_every = 1 * 1\nclip = 1.0 * 1",  # computed: not inlined
        "for step in range(3):\n    rate = lr * min(1, step / warmup)\n    if step % log_every == 0:\n        print(step)\n"
        "    scaled = clip * rate\n    if rank == 1 and step == 2:\n        raise ValueError('bad step')\nelse:\n    done = True",
    ])
    assert history[-1].failed == [1]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == [
        "for step in range(3):\n    if rank == 1 and step == 2:\n        raise ValueError('bad step')\nelse:\n    done = True",
    ], found.code()
    assert "removed 3 of the 4 statements of `for step in range(3):`" in found.text(), found.text()
    assert "statements the failing line needs" in found.text(), found.text()  # the loop's reads of the set-up went with it


def test_an_earlier_cell_of_a_try_is_bounded_by_its_own_time_and_each_try_says_why_it_did_not_count() -> None:
    """A model's set-up takes longer than the failing cell: bounded by the failing cell's time, every
    try of a real session timed out in its set-up and counted as "fails otherwise" (the GPT-shaped
    session of bench_minimize.py: 87 tries, nothing cut)."""
    ranks = _Ranks()
    # globals()[…]: a read the minimizer's reading of names does not see, so the try is run.
    history = session(ranks, ["setup = int('1')\nnoise = 2", "if rank == 1:\n    raise ValueError(globals()['setup'])"])
    history[0].elapsed, history[1].elapsed = 20.0, 0.5
    bounds: list[tuple[str, float]] = []
    run = ranks.run

    def recording(code: str, on: list[int], limit: float) -> CellResult:
        bounds.append((code, limit))
        return run(code, on, limit)

    said: list[str] = []
    minimize(Runs(ranks.restart, recording, ranks.stop), history, budget=60, on_progress=said.append)
    assert {limit for code, limit in bounds if "raise" not in code} == {65.0}, bounds  # 3 × 20 s + 5
    assert {limit for code, limit in bounds if "raise" in code} == {5.0}, bounds
    assert any("failed otherwise (rank 1 raised KeyError: 'setup')" in s for s in said), said


def _recorded(ranks: _Ranks) -> tuple[Runs, list[str]]:
    """The minimizer's seam over ``ranks``, and the code of every cell it runs, in order."""
    runs: list[str] = []

    def recording(code: str, on: list[int], limit: float) -> CellResult:
        runs.append(code)
        return ranks.run(code, on, limit)

    return Runs(ranks.restart, recording, ranks.stop), runs


def test_a_case_that_reads_a_name_nothing_in_it_sets_is_not_tried() -> None:
    ranks = _Ranks(pushed={"lr": 0.5})  # lr: pushed, set by no cell — never counted as missing
    history = session(ranks, ["a = int('1')\nb = int('2')", "c = a * lr\nd = b\nif rank == 1:\n    raise ValueError(c)"])
    tries, runs = _recorded(ranks)
    found = minimize(tries, history, budget=60)
    assert [c.code for c in found.cells] == ["a = int('1')", "c = a * lr\nif rank == 1:\n    raise ValueError(c)"], found.code()
    unrun = found.unrun.get("reading a name before anything in the case sets it: a NameError, not the failure", 0)
    assert unrun > 0 and f"{unrun} case{'s' * (unrun != 1)} not tried (reading a name before" in found.text(), found.text()
    # No case was run whose failing cell reads c without setting it.
    assert not [code for code in runs if "raise ValueError(c)" in code and "c = a" not in code], runs


def test_settings_are_written_in_where_they_are_read_in_one_try_and_nested_loops_are_cut() -> None:
    """A pasted script's shape: a settings block, a loop with an accumulation loop inside, the
    failure in the inner one. The settings go in one try; the inner loop's body is cut too."""
    ranks = _Ranks()
    history = session(ranks, [
        "lr = 0.1\naccum = 2\nsteps = 3\nlog_every = 1\nname = 'run'",
        "for step in range(steps):\n    rate = lr * step\n    for micro in range(accum):\n        loss = rate * micro\n"
        "        if micro == accum - 1 and rank == 1 and step % log_every == 0:\n            raise ValueError(f'bad micro-step of {name}')\n"
        "        seen = micro\n    print(step)",
    ])
    assert history[-1].failed == [1]
    said: list[str] = []
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60, on_progress=said.append)
    loop = ("for step in range(3):\n    for micro in range(2):\n        if micro == 1 and rank == 1 and step % 1 == 0:\n"
            "            raise ValueError(f'bad micro-step of {NAME}')")
    if sys.version_info < (3, 12):  # a string is not written into an f-string there
        assert [c.code for c in found.cells] == ["name = 'run'", loop.replace("NAME", "name")], found.code()
        assert "wrote 4 settings in where they are read (accum, log_every, lr, steps; one try)" in found.text(), found.text()
    else:
        assert [c.code for c in found.cells] == [loop.replace("NAME", "'run'")], found.code()
        assert "wrote 5 settings in where they are read (accum, log_every, lr, name, steps; one try)" in found.text(), found.text()
    assert "statements of `for micro in range(2):`" in found.text(), found.text()


def test_a_case_without_the_line_where_the_ranks_raised_is_not_tried() -> None:
    ranks = _Ranks()
    history = session(ranks, ["a = int('1')", "b = a + 1\nc = b * 2\nif rank == 1:\n    raise ValueError(c)\nd = c"])
    tries, runs = _recorded(ranks)
    found = minimize(tries, history, budget=60)
    assert found.cells[-1].code.endswith("if rank == 1:\n    raise ValueError(c)"), found.code()
    assert not [code for code in runs if "b = a" in code and "raise ValueError(c)" not in code], runs  # the failing line never dropped
    assert "not tried (without a line where the session's ranks raised or waited)" in found.text(), found.text()


def test_the_budget_is_kept_a_try_that_would_end_past_it_is_not_started(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from distnb.services.cases import minimize as module

    now = [0.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    ranks = _Ranks()
    # globals(): a dependency the reading of names does not see, so that the cells cost tries.
    history = session(ranks, ["x1 = int('1')", "x2 = int('2')", "x3 = int('3')", "if rank == 1:\n    raise ValueError(globals().get('x1'))"])
    run = ranks.run

    def slow(code: str, on: list[int], limit: float) -> CellResult:
        now[0] += 10.0  # each cell of a try: ten seconds of the clock
        return run(code, on, limit)

    found = minimize(Runs(ranks.restart, slow, ranks.stop), history, budget=45)
    assert found.tries == 2 and found.seconds <= 45 and found.stopped == "the time budget ran out", found.text()


def test_a_seed_the_failure_does_not_need_goes_in_one_try_with_what_only_it_read() -> None:
    """The slice keeps what sets process-wide state (a seed: later code may read it without naming
    it); one try without it, kept when the case still fails: a pasted script's ``torch.manual_seed(1337
    + seed_offset)`` and its ``seed_offset``."""
    ranks = _Ranks()
    history = session(ranks, ["import random\noffset = int('3')\nrandom.seed(1 + offset)\nbatch = [1, 2][rank]",
                              "if batch == 2:\n    raise ValueError('bad batch')"])
    said: list[str] = []
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60, on_progress=said.append)
    assert [c.code for c in found.cells] == ["batch = [1, 2][rank]", "if batch == 2:\n    raise ValueError('bad batch')"], found.code()
    assert ("removed 3 statements kept for the process-wide state they set (`random.seed(1 + offset)`) and what only they "
            "read (one try)") in found.text(), found.text()


def test_a_seed_the_failure_needs_stays() -> None:
    ranks = _Ranks()
    history = session(ranks, ["import random\nrandom.seed(4)\nnoise = [0] * 3",
                              "if rank == 1 and random.random() == 0.23604808973743452:\n    raise ValueError('bad draw')"])
    assert history[-1].failed == [1]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells][0] == "import random\nrandom.seed(4)", found.code()
    assert ("kept the statements that set process-wide state (`random.seed(4)`): without them the case did not fail the "
            "same way") in found.text(), found.text()


def test_a_with_over_a_context_that_does_nothing_is_written_as_its_body_in_the_settings_try() -> None:
    ranks = _Ranks()
    history = session(ranks, ["from contextlib import nullcontext\nsteps = 3\nctx = nullcontext()",
                              "for step in range(steps):\n    with ctx:\n        if rank == 1 and step == 2:\n"
                              "            raise ValueError('bad step')"])
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == ["for step in range(3):\n    if rank == 1 and step == 2:\n        raise ValueError('bad step')"], \
        found.code()
    assert ("wrote 1 setting in where it is read (steps; 1 `with` block over nullcontext() as its body; one try)"
            in found.text()), found.text()


def test_a_decorated_function_is_one_statement_with_its_decorators() -> None:
    code = "x = 1\n@torch.no_grad()\n@other\ndef f():\n    return 1\nfor i in r:\n    @dec\n    def g():\n        pass\n    g()"
    assert statements(code) == ["x = 1", "@torch.no_grad()\n@other\ndef f():\n    return 1", "for i in r:\n    @dec\n    def g():\n        pass\n    g()"]
    assert function_bodies(code)[1] == ("`for i in r:`", ["    @dec\n    def g():\n        pass", "    g()"])
    assert replace_body(code, 1, ["    g()"]).endswith("for i in r:\n    g()")
