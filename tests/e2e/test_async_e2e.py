"""gloo ``async_op=True`` on real 2-rank pools: the CPU rehearsal of NCCL's asynchrony. A
rank-conditional async collective is caught at the end of the cell that issued it, before
anything hangs; waited on later, the hang names where it was issued and where the host now
waits; after the timeout the root cause is the rank that never arrived, by sequence numbers."""

from __future__ import annotations

import pytest

from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_rank_conditional_async_collective_from_issue_to_timeout_and_regroup(fresh_pool) -> None:
    # gloo runs the async work from its issue: its timeout counts from there, across the next two
    # cells and the diagnosis, so it must leave a busy machine time for them (rank 0 must still
    # wait in w.wait() when the hang is diagnosed).
    pool = fresh_pool(nproc=2, pg_timeout=20, hang_after=1.0)
    issued = pool.run("t = torch.ones(4)\nif rank == 0:\n    w = dist.all_reduce(t, async_op=True)\n")
    assert issued.ok and issued.desync, issued.text()
    text = issued.text()
    assert ("rank-conditional collective: rank 0 entered all_reduce #1 [4] f32 at cell line 3, but rank 1 finished the cell without "
            "entering it; it was issued with async_op=True and its work is still pending (never waited on)") in text, text
    assert "the next synchronisation on group 0 will hang" in text, text
    later = pool.run("x = 1")
    assert f"rank 0 is still 1 collective ahead of rank 1 on group 0 (since cell {issued.cell}" in later.text(), later.text()
    res = pool.submit("import time\ntime.sleep(0.05)\nif rank == 0:\n    w.wait()\n")
    wait_until(lambda: pool.diagnose(res).state == "hang", 15, "the hang diagnosis", poll=0.1)
    diag = pool.diagnose(res)
    assert diag.culprits == [1] and diag.summary.startswith(
        f"rank-conditional collective: rank 0 entered all_reduce #1 (issued in cell {issued.cell}, line 3)"), diag.text()
    assert (f"rank 0: waiting for all_reduce #1 on group 0 [4] f32 (issued in cell {issued.cell}, line 3)" in diag.text()
            and "now blocked at cell line 4 (w.wait())" in diag.text()), diag.text()
    assert f"not completed (issued in cell {issued.cell}, line 3)" in pool.stacks().text()
    pool.wait(res, timeout=60)
    text = res.text()
    assert res[0].status == "error" and "Timed out" in res[0].error["evalue"], text
    assert "rank 1 never arrived at all_reduce #1 on group 0, which rank 0 issued" in text and "Root cause: rank 1" in text, text
    pool.regroup()
    after = pool.run("t = torch.ones(4) * (rank + 1)\ndist.all_reduce(t)\nt.sum().item()")
    assert after.ok and set(after.values.values()) == {"12.0"} and not after.desync, after.text()


def test_groups_only_members_create_are_no_desync(fresh_pool) -> None:
    pool = fresh_pool(nproc=2)
    res = pool.run("if rank == 0:\n    mine = dist.new_group([0], use_local_synchronization=True)\n")
    assert res.ok and not res.desync, res.text()
    res = pool.run("if rank == 0:\n    dist.send(torch.ones(2), 1)\nelse:\n    dist.recv(torch.zeros(2), 0)\n")
    assert res.ok and not res.desync, res.text()  # gloo counts point-to-point calls: distnb takes them out
