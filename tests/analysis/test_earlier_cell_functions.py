"""Calls made inside a function an earlier cell defined (a notebook's ``evaluate()``,
``train_step()``), judged as the calls of the cell that ran them: a helper called under an ``if``
on the rank in the judged cell, an ``if`` on the rank inside the helper, a mismatch inside a helper
every rank calls. None of them is "calls of different cells paired" (the helper's cell is not the
cell that issued the call), and the words name both places."""

from __future__ import annotations

from typing import Any

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position
from distnb.analysis.verdicts.verdict import Kind, Verdict
from distnb.controller.collective_log import CollectiveLog

HELPERS, CELL = 4, 5


def entry(i: int, seq: int, op: str = "all_reduce", size: int = 2632, dtype: str = "Float", done: bool = True,
          site: tuple[int, int, str] | None = None, called_at: int | None = None) -> dict[str, Any]:
    """An entry issued in CELL: from C++ (no site), the cell's own line, or a helper's line."""
    e: dict[str, Any] = {"id": i, "group": "0", "desc": "default_pg", "seq": seq, "p2p": False, "op": op,
                         "sizes": [[size]] if size else [], "dtypes": [dtype] if size else [], "t": float(i), "done": done, "cell": CELL}
    if site is not None:
        e["call_cell"], e["line"], e["func"] = site
        if called_at is not None:
            e["in_line"] = called_at
    return e


def ddp_steps(n: int) -> list[dict[str, Any]]:
    return [entry(i, i + 1) for i in range(n)]  # DDP's bucket all_reduce, from C++


def judge(per_rank: dict[int, list[dict[str, Any]]], positions: list[Position], sources: dict[int, str]) -> Verdict:
    log = CollectiveLog()
    for r, entries in per_rank.items():
        log.merge(r, {"entries": entries, "groups": {"0": sorted(per_rank)}, "descs": {}, "calls": [], "now": 0.0})
    return diagnose(positions, 3.0, 5.0, log.report(sorted(per_rank)), None, sources)


def waits(rank: int, op: str, seq: int, line: int, line_cell: int = CELL, func: str = "<module>") -> Position:
    return Position(rank, "collective", op=op, seq=seq, group="0", since=5.0, line=line, running=CELL, line_cell=line_cell, func=func)


def test_a_helper_called_under_an_if_on_the_rank_is_that_if_not_calls_of_different_cells() -> None:
    helpers = "def evaluate():\n    l = torch.zeros(1)\n    dist.all_reduce(l)\n    return l\n"
    cell = ("for it in range(4):\n"                    # 1
            "    if it % 2 == 1 and rank == 0:\n"      # 2
            "        losses = evaluate()\n"            # 3
            "    loss = model(x).sum()\n"              # 4
            "    loss.backward()\n")                   # 5
    mine = entry(4, 5, size=1, done=False, site=(HELPERS, 3, "evaluate"), called_at=3)
    per_rank = {0: ddp_steps(4) + [mine], **{r: ddp_steps(4) + [entry(4, 5, "broadcast", 5, "Int", done=False)] for r in (1, 2, 3)}}
    v = judge(per_rank, [waits(0, "all_reduce", 5, 3, HELPERS, "evaluate"), *(waits(r, "broadcast", 5, 4) for r in (1, 2, 3))],
              {HELPERS: helpers, CELL: cell})
    assert v.kind is not Kind.CROSS_CELL and v.culprits == [0], v.text()
    assert "in evaluate() (cell 4 line 3)" in v.text() and "under `if it % 2 == 1 and rank == 0:`" in v.text(), v.text()
    assert "paired calls of different cells" not in v.text() and "earlier cell" not in v.text(), v.text()


def test_an_if_on_the_rank_inside_a_helper_every_rank_calls() -> None:
    helpers = ("def train_step(step):\n"                  # 1
               "    loss = model(x).sum()\n"              # 2
               "    loss.backward()\n"                    # 3
               "    if step == 2 and rank == 3:\n"        # 4
               "        dist.all_reduce(loss)\n")         # 5
    cell = "for step in range(4):\n    train_step(step)\ndist.barrier()\n"
    extra = entry(8, 9, size=0, done=False, site=(HELPERS, 5, "train_step"), called_at=2)
    extra["sizes"], extra["dtypes"] = [[]], ["Float"]
    per_rank = {3: ddp_steps(8) + [extra], **{r: ddp_steps(8) + [entry(8, 9, done=False)] for r in (0, 1, 2)}}
    v = judge(per_rank, [waits(3, "all_reduce", 9, 5, HELPERS, "train_step"), *(waits(r, "all_reduce", 9, 3, HELPERS, "train_step") for r in (0, 1, 2))],
              {HELPERS: helpers, CELL: cell})
    assert v.kind is not Kind.CROSS_CELL and v.culprits == [3], v.text()
    assert "in train_step() (cell 4 line 5)" in v.text() and "under `if step == 2 and rank == 3:`" in v.text(), v.text()


def test_a_mismatch_inside_a_helper_names_the_helpers_line() -> None:
    helpers = "def sync(t):\n    dist.all_reduce(t)\n    return t\n"
    cell = "t = torch.ones(8 if rank != 2 else 4)\nsync(t)\n"
    per_rank = {r: [entry(0, 1, size=4 if r == 2 else 8, done=False, site=(HELPERS, 2, "sync"), called_at=2)] for r in range(4)}
    v = judge(per_rank, [waits(r, "all_reduce", 1, 2, HELPERS, "sync") for r in range(4)], {HELPERS: helpers, CELL: cell})
    assert v.kind is Kind.MISMATCH and v.culprits == [2], v.text()
    assert v.sites and (v.sites[0].cell, v.sites[0].line) == (HELPERS, 2), (v.sites, v.text())
    assert "paired calls of different cells" not in v.text(), v.text()


def test_a_loop_in_the_cell_around_a_helper_run_once_less_on_one_rank_is_an_uneven_loop() -> None:
    helpers = "def shard_step(p):\n    full = torch.zeros(8)\n    dist.all_gather_into_tensor(full, p)\n    dist.reduce_scatter_tensor(p, full)\n"
    cell = "fp = torch.ones(2)\nfor _ in range(4 if rank == 0 else 5):\n    shard_step(fp)\n"

    def steps(n: int, open_last: bool) -> list[dict[str, Any]]:
        out = []
        for i in range(n):
            out.append(entry(2 * i, 2 * i + 1, "all_gather", 2, site=(HELPERS, 3, "shard_step"), called_at=3,
                             done=not (open_last and i == n - 1)))
            if not (open_last and i == n - 1):
                out.append(entry(2 * i + 1, 2 * i + 2, "reduce_scatter", 8, site=(HELPERS, 4, "shard_step"), called_at=3))
        return out

    per_rank = {0: steps(4, False), **{r: steps(5, True) for r in (1, 2, 3)}}
    v = judge(per_rank, [Position(0, "finished"), *(waits(r, "all_gather", 9, 3, HELPERS, "shard_step") for r in (1, 2, 3))],
              {HELPERS: helpers, CELL: cell})
    assert v.culprits == [0] and v.text().startswith("[distnb] uneven loop: rank 0 ran 4 steps"), v.text()
    loops = [s for s in v.sites if s.what == "the loop"]
    assert [(s.cell, s.line) for s in loops] == [(CELL, 2)], v.sites  # the loop is the cell's, around the call of shard_step
