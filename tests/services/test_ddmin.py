"""Delta debugging as the minimizer runs it (services/minimize.py), on a predicate instead of a pool."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from distnb.results import CellResult, RankResult
from distnb.services.minimize import Runs, _ddmin, function_bodies, minimize, replace_body, statements, world_sizes


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

    def __init__(self, world: int = 2) -> None:
        self.ns: dict[int, dict] = {}
        self.cell = 0
        self.world = world
        self.started: list[int] = []  # the smaller worlds started, in order

    def restart(self) -> None:
        self.ns = {r: {"rank": r, "world_size": self.world} for r in range(self.world)}

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
                exec(code, self.ns[r])
                res.results[r].status = "ok"
            except Exception as exc:
                res.results[r].status = "error"
                res.results[r].error = {"ename": type(exc).__name__, "evalue": str(exc), "traceback": "", "line": None}
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
        "scale = 3\nunused = [1, 2]",
        "def step(x):\n    # the training step\n    y = x * scale\n    log = []\n    log.append(y)\n"
        "    if rank == 1:\n        raise ValueError(f'bad batch {y}')\n    return y",
        "a = 1\nz = step(2)\nb = 2",
    ])
    assert history[-1].failed == [1]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == [
        "scale = 3",
        "def step(x):\n    # the training step\n    y = x * scale\n    if rank == 1:\n        raise ValueError(f'bad batch {y}')",
        "z = step(2)",
    ], found.code()
    assert "removed 3 of the 5 statements of step()" in found.text(), found.text()
    assert function_bodies("def f(): return 1") == []  # a one-line function has no body to cut apart


def test_a_function_body_is_replaced_in_place_keeping_its_decorators_and_what_follows() -> None:
    code = "@torch.no_grad()\ndef evaluate(m):\n    a = 1\n    if a:\n        b = 2\n    return a\nafter = 1"
    assert function_bodies(code) == [("evaluate()", ["    a = 1", "    if a:\n        b = 2", "    return a"])]
    assert replace_body(code, 0, ["    return a"]) == "@torch.no_grad()\ndef evaluate(m):\n    return a\nafter = 1"
    assert replace_body(code, 0, []) == "@torch.no_grad()\ndef evaluate(m):\n    pass\nafter = 1"


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
        "lr = 0.1\nwarmup = 2\nlog_every = 1\nclip = 1.0",
        "for step in range(3):\n    rate = lr * min(1, step / warmup)\n    if step % log_every == 0:\n        print(step)\n"
        "    scaled = clip * rate\n    if rank == 1 and step == 2:\n        raise ValueError('bad step')\nelse:\n    done = True",
    ])
    assert history[-1].failed == [1]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == [
        "for step in range(3):\n    if rank == 1 and step == 2:\n        raise ValueError('bad step')\nelse:\n    done = True",
    ], found.code()
    assert "removed 3 of the 4 statements of `for step in range(3):`" in found.text(), found.text()
    assert "statements the failing cell needs now" in found.text(), found.text()  # the loop's reads of the set-up went with it


def test_an_earlier_cell_of_a_try_is_bounded_by_its_own_time_and_each_try_says_why_it_did_not_count() -> None:
    """A model's set-up takes longer than the failing cell: bounded by the failing cell's time, every
    try of a real session timed out in its set-up and counted as "fails otherwise" (the GPT-shaped
    session of bench_minimize.py: 87 tries, nothing cut)."""
    ranks = _Ranks()
    history = session(ranks, ["setup = 1\nnoise = 2", "if rank == 1:\n    raise ValueError(setup)"])
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
    assert any("failed otherwise (rank 1 raised NameError: name 'setup' is not defined)" in s for s in said), said
