"""A cell that can no longer finish ends at once, not at its timeout: one rank raised and left, the
others wait in a collective that needs it (real gloo ranks). The group is rebuilt, namespaces kept."""

from __future__ import annotations

import distnb

from conftest import usable

#: Far above what failing fast takes (FAIL_FAST_AFTER, the escalation after ESCALATE_AFTER, a
#: regroup), far below what waiting would (the group's timeout): reaching it means it waited.
LONG = 90.0


def test_a_raise_while_the_others_wait_ends_the_cell_and_keeps_the_namespaces(pool4: distnb.Pool) -> None:
    pool = usable(pool4)
    assert pool.run("ff_kept = rank * 10", timeout=LONG).ok
    res = pool.run("ff_x = torch.ones(1)\nif rank == 2:\n    raise ValueError('bad batch on 2')\ndist.all_reduce(ff_x)\n", timeout=LONG)
    text = res.text()
    assert not res.timed_out and not res.running, text
    assert res[2].status == "error" and all(res[r].status != "ok" for r in (0, 1, 3)), text
    assert "[distnb] rank 2 raised ValueError and left cell" in text and "ranks 0,1,3 in all_reduce" in text, text
    assert "ending the cell now instead of at its timeout" in text, text
    # The rebuild started every rank's group over: no warning of a hang the old counts foretold.
    assert "will hang" not in text and "Every rank has a fresh default process group" in text, text
    # The root cause is the rank that raised, not the ranks distnb interrupted.
    assert res.verdict is not None and res.verdict.culprits == [2], text
    # The group was rebuilt and every rank kept its namespace: the next collective works.
    after = pool.run("dist.all_reduce(ff_y := torch.ones(1))\n(ff_kept, ff_y.item())", timeout=LONG)
    assert after.ok and after.values == {r: f"({r * 10}, 4.0)" for r in range(4)}, after.text()


def test_a_rank_that_raised_after_the_others_finished_ends_nothing_early(pool4: distnb.Pool) -> None:
    # Rank 1 raises after the last collective: nobody waits for it, the cell ends as it always did.
    pool = usable(pool4)
    res = pool.run("dist.all_reduce(torch.ones(1))\nif rank == 1:\n    raise KeyError('late')\n'done'", timeout=LONG)
    assert res.failed == [1] and "ending the cell now" not in res.text(), res.text()


def test_a_ddp_model_used_after_the_rebuild_is_named_with_what_to_do(pool4: distnb.Pool) -> None:
    pool = usable(pool4)
    assert pool.run("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                    "ff_model = DDP(torch.nn.Linear(4, 4))\nff_model(torch.ones(2, 4)).sum().backward()", timeout=LONG).ok
    res = pool.run("if rank == 0:\n    raise RuntimeError('bad step')\nff_model(torch.ones(2, 4)).sum().backward()", timeout=LONG)
    # At the end of the cell that closed the group: the objects that hold it, and how to remake them.
    assert "`ff_model` (DistributedDataParallel: make it again, DDP(model.module, ...))" in res.text(), res.text()
    used = pool.run("ff_model(torch.ones(2, 4)).sum().backward()", timeout=LONG)
    text = used.text()
    assert used.failed, text
    assert "[distnb] likely why ranks 0-3 failed on a closed group" in text and "`ff_model` (DistributedDataParallel" in text, text
    assert pool.run("ff_model = DDP(ff_model.module)\nff_model(torch.ones(2, 4)).sum().backward()", timeout=LONG).ok
