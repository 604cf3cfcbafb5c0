"""``%dist_numerics`` over results held in notebook variables: the report of one run (text, table,
plot shown), and ``diff A B``; no pool needed for results already made."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from distnb.results import CellResult, RankResult

sys.path.insert(0, str(Path(__file__).parents[1] / "analysis"))
from magic_shell import process_shell  # noqa: E402
from test_numerics import _records  # noqa: E402  (the generated records of the analysis tests)


def _result(cell: int, inject: tuple[int, int, str] | None) -> CellResult:
    records = _records([("aten.mm.default", "world")] * 5, random.Random(1), inject=inject)
    results = {r: RankResult(r) for r in records}
    for r, rec in records.items():
        results[r].status, results[r].numerics = "ok", rec
    return CellResult(cell=cell, code="", ranks=list(records), results=results, label=cell)


@pytest.fixture
def shell() -> InteractiveShell:
    ip = process_shell()
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    return ip


def test_dist_numerics_shows_the_report_and_diff_compares_two_runs(shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    shell.user_ns["good"], shell.user_ns["bad"] = _result(3, None), _result(4, (2, 1, "output"))
    shell.run_line_magic("dist_numerics", "bad --no-plot")
    out = capsys.readouterr().out
    assert "first divergence among ranks 0-3" in out and "rank 1's aten.mm.default" in out
    diff = shell.run_line_magic("dist_numerics", "diff good bad")
    assert diff.per_rank[1].position == 2 and "first difference at op #2" in diff.text()
    with pytest.raises(UsageError, match="diff A B"):
        shell.run_line_magic("dist_numerics", "diff good")
    with pytest.raises(UsageError, match="neither a notebook variable"):
        shell.run_line_magic("dist_numerics", "nothing_here")
