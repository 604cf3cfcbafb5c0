"""%dist_minimize's engine on a real pool: a session's failure cut down to the cells and statements
it needs and to the ranks it needs (a pool of its own for the smaller world), verified under
torchrun, and the session's state given back (issue 37, item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

import distnb

CELLS = ["a = torch.ones(2)", "b = a * 2\nc = 3", "d = {'k': 1}"]
FAILING = "x = 1\ny = b.sum()\nif rank == 1:\n    raise ValueError(f'bad batch {int(y)}')\nz = 2"


@pytest.mark.timeout(600)  # the minimize budget (400 s) with its verification and the replay after it
def test_a_failure_is_cut_down_to_what_it_needs_and_verified(fresh_pool, tmp_path: Path) -> None:
    pool = fresh_pool(3, spares=True)
    for code in CELLS:
        assert pool.run(code, timeout=60).ok
    res = pool.run(FAILING, timeout=60)
    assert res[1].status == "error", res.text()
    seen: list[str] = []
    found = pool.minimize(budget=400, path=str(tmp_path / "case.py"), on_progress=seen.append)
    text = found.text()
    assert not found.stopped, text
    # The cells it needs (a, then b — not c, not d), and of the failing cell the two statements.
    assert [c.code for c in found.cells] == ["a = torch.ones(2)", "b = a * 2", "y = b.sum()\nif rank == 1:\n    raise ValueError(f'bad batch {int(y)}')"], text
    assert "minimized: 4 cells, 8 statements → 3 cells, 4 statements on 2 ranks (the session had 3)" in text, text
    assert "rank 1 raised ValueError: bad batch 4" in text and "removed 1 of the 3 ranks: ranks 0,1 fail as they did" in text, text
    assert found.world_size == 2 and found.cells[-1].ranks == (0, 1), text
    assert found.verified is not None and found.verified.reproduced, text  # run under torchrun on 2 ranks
    assert "--nproc-per-node 2" in (tmp_path / "case.py").read_text() and "-n 2 " in (tmp_path / "case.ipynb").read_text()
    assert seen and seen[-1].startswith("minimizing: "), seen[-3:]
    # The session is as it was: its namespaces back, its history without the tries.
    assert pool.run("(float(b.sum()), c, d['k'])", timeout=60).values == {r: "(4.0, 3, 1)" for r in range(3)}
    assert distnb.current_pool() is pool and pool.world_size == 3
