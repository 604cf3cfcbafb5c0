"""Delta debugging as the minimizer runs it (services/minimize.py), on a predicate instead of a pool."""

from __future__ import annotations

from distnb.services.minimize import _ddmin, statements


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
