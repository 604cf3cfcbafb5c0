"""What a terminal prints of a long healthy cell: one line of what its ranks do, by kind of work —
not a verdict's block (a healthy cell prints no verdict)."""

from __future__ import annotations

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position
from distnb.magics.live_watch import MAX_KINDS, activity_line


def _doing(details: dict[int, str]) -> list[Position]:
    return [Position(r, "computing", detail=d, line=8, running=2, line_cell=2) for r, d in details.items()]


def test_ranks_importing_read_as_one_line_naming_what_and_where() -> None:
    doing = diagnose(_doing({0: "importing sympy/core/expr.py", 1: "importing mpmath/__init__.py", 2: "importing sympy/core/mul.py",
                             3: "compiling f (a graph break)"}), 3.0, 6.0)
    line = activity_line(doing, 6.2)
    assert "\n" not in line and line.startswith("[distnb] 6 s in, no rank waits on another: "), line
    assert "ranks 0-2 importing sympy/core/expr.py at cell line 8" in line and "rank 3 compiling f (a graph break) at cell line 8" in line, line
    assert "hang" not in line and "Root cause" not in line, line


def test_a_rank_in_an_earlier_cells_function_names_that_cell() -> None:
    doing = diagnose([Position(0, "computing", detail="importing sympy/core/expr.py", line=3, func="build", running=2, line_cell=1)], 3.0, 6.0)
    assert "rank 0 importing sympy/core/expr.py in build() (cell 1 line 3)" in activity_line(doing, 6.0)


def test_many_kinds_of_work_are_cut_to_a_few() -> None:
    doing = diagnose(_doing({r: f"kind{r} of work" for r in range(MAX_KINDS + 2)}), 3.0, 6.0)
    line = activity_line(doing, 30)
    assert line.count(" at cell line 8") == MAX_KINDS and line.endswith("; 2 more kinds of work"), line
