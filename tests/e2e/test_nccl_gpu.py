"""NCCL on a real GPU: the collective log with states, async-aware hang diagnosis, timeouts that
keep the ranks, interrupt-with-abort, regroup, bounded device requests, memory, NVML and device
checksums. Several ranks share one GPU (``share_gpus``: each rank poses as its own host to NCCL),
so this runs on a single-GPU machine. Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

import time

import pytest

import distnb
from distnb.worker.recorders.fingerprint import fingerprint

from conftest import wait_until

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MB = 1 << 20


@pytest.fixture(scope="module")
def gpu1(leak_check):
    with distnb.Pool(nproc=1, backend="nccl", hang_after=1.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def shared2(leak_check):
    """Two NCCL ranks on one GPU; an 8 s collective timeout so the timeout tests end quickly."""
    with distnb.Pool(nproc=2, share_gpus=True, pg_timeout=8, hang_after=1.0) as pool:
        yield pool


def test_nccl_collectives_appear_with_states_and_a_queued_one_shows_while_the_host_waits(gpu1: distnb.Pool) -> None:
    res = gpu1.run("x = torch.ones(4, device=device)\ndist.all_reduce(x)\n"
                   "side = dist.new_group(backend='gloo')\ndist.all_reduce(torch.ones(3), group=side)\nx.sum().item()")
    assert res.ok, res.text()
    log = gpu1.collectives()
    recs = {e["rec"]: e for e in log.log.entries[0].values()}
    assert set(recs) == {"nccl", "fr"}, log.text()  # both recorders, kept apart
    assert recs["nccl"]["state"] == "completed" and recs["nccl"]["done"] and recs["nccl"]["started"] is not None
    assert log.log.missing == {}, log.text()
    # A collective queued behind a 3 s kernel: not completed while the host waits in .item().
    res = gpu1.submit("torch.cuda._sleep(int(6e9))\nz = torch.ones(2, device=device)\ndist.all_reduce(z)\nv = z.sum().item()\n")
    time.sleep(0.8)
    t0 = time.monotonic()
    stacks = gpu1.stacks(timeout=2.0)
    assert time.monotonic() - t0 < 2.0 and "z.sum().item()" in stacks.text(), stacks.text()
    text = gpu1.collectives().text()
    assert "all_reduce [2] f32 ⏸" in text, text  # queued on the GPU, not started
    gpu1.wait(res, timeout=60)
    assert res.ok, res.text()
    assert "f32 ⏸" not in gpu1.collectives().text()  # (the legend names the mark)


def test_memory_nvml_and_the_users_own_peak(gpu1: distnb.Pool) -> None:
    res = gpu1.run("big = torch.empty(256 << 20, dtype=torch.uint8, device=device)\ndel big\n")
    assert res.ok, res.text()
    mem = res[0].memory
    assert mem["cuda_peak"] >= 256 * MB and mem.get("device_total", 0) > 0 and mem["device_used"] >= 256 * MB
    res = gpu1.run("torch.cuda.max_memory_allocated()")  # distnb reset the allocator's peak since; the user's reading did not move
    assert res.ok and int(res.values[0]) >= 256 * MB, res.text()
    assert "GPU (NVML)" in res.memory_text() or "CUDA peak" in res.memory_text()


def test_device_checksums_match_cpu_and_a_busy_gpu_is_said_not_waited_for(gpu1: distnb.Pool) -> None:
    torch.manual_seed(0)
    base = torch.randn(300, 77)
    res = gpu1.run("torch.manual_seed(0)\nbase = torch.randn(300, 77)\nmat = base.to(device).t()\n"
                   "row = torch.randn(1, 5001, device=device).expand(700, 5001)\n"
                   "f8 = (base * 4).to(device).to(torch.float8_e4m3fn)\n")
    assert res.ok, res.text()
    (mat,) = gpu1.check("mat")
    assert mat.identical
    summary = gpu1.run("from distnb.worker.recorders.checksum import checksum\n(checksum(mat)['fingerprint'], checksum(f8)['fingerprint'], "
                       "checksum(row)['fingerprint'] == checksum(row.contiguous())['fingerprint'])")
    assert summary.ok, summary.text()
    fp_mat, fp_f8, row_ok = eval(summary.values[0])
    assert fp_mat == fingerprint(base.t().contiguous()) and fp_f8 == fingerprint((base * 4).to(torch.float8_e4m3fn)) and row_ok
    # The cell returns at once; its kernel keeps the GPU busy ~10 s: a check must not wedge the rank.
    assert gpu1.run("torch.cuda._sleep(int(2e10))").ok
    t0 = time.monotonic()
    with pytest.raises(distnb.RemoteError, match="GPU is still busy"):
        gpu1.check("mat")
    assert time.monotonic() - t0 < 10
    wait_until(lambda: gpu1.run("torch.cuda.current_stream().query()").values[0] == "True", 30, "the GPU to finish its sleep", poll=0.5)
    assert gpu1.check("mat")[0].identical


def test_shared_gpu_collectives_are_real_and_p2p_is_no_desync(shared2: distnb.Pool) -> None:
    res = shared2.run("t = torch.ones(3, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
                      "if rank == 0:\n    dist.send(t, 1)\nelse:\n    dist.recv(t, 0)\nt.sum().item()")
    assert res.ok, res.text()
    assert set(res.values.values()) == {"9.0"} and not res.desync, res.text()


def test_uneven_loop_caught_at_the_end_of_the_cell(shared2: distnb.Pool) -> None:
    res = shared2.run("u = torch.ones(2, device=device)\nfor i in range(3 if rank == 0 else 2):\n    dist.all_reduce(u)\n")
    assert res.ok and res.desync, res.text()
    assert "rank 0 issued 1 collective on group 0" in res.text() and "rank 1 did not" in res.text(), res.text()


def test_timeout_keeps_every_rank_blames_who_never_came_and_regroup_recovers(shared2: distnb.Pool) -> None:
    # (The previous test left rank 0 one all_reduce ahead: that is the one rank 1 never joins.)
    res = shared2.submit("v = u.sum().item()\n")
    time.sleep(2.5)
    diag = shared2.diagnose(res)
    assert diag.state == "hang", diag.text()
    assert "waiting for all_reduce #" in diag.text() and "now blocked at cell line 1 (v = u.sum().item())" in diag.text(), diag.text()
    shared2.wait(res, timeout=90)
    text = res.text()
    assert res[0].status == "error" and res[0].error["ename"] == "DistBackendError", text
    assert "rank 1 never arrived at all_reduce" in text and "Root cause: rank 1" in text, text
    assert shared2.state == distnb.PoolState.READY and all(s.state != distnb.RankState.DEAD for s in shared2.status().ranks)
    try:
        shared2.regroup()
    except distnb.NoAnswerError:
        for r in (0, 1):
            print(f"--- rank {r} log:\n" + "".join(shared2._tracker.ranks[r].log[-60:]))
        raise
    again = shared2.run("w = torch.ones(2, device=device) * (rank + 1)\ndist.all_reduce(w)\nw.sum().item()")
    assert again.ok and set(again.values.values()) == {"6.0"}, again.text()


def test_interrupt_of_a_rank_stuck_behind_nccl_aborts_and_keeps_the_namespace(shared2: distnb.Pool) -> None:
    assert shared2.run("keep = 42").ok
    res = shared2.submit("k = torch.ones(2, device=device)\nif rank == 0:\n    dist.all_reduce(k)\n    k.sum().item()\n")
    time.sleep(1.5)
    shared2.interrupt()
    shared2.wait(res, timeout=30)
    assert res[0].status == "interrupted", res.text()
    assert "aborting its NCCL communicators" in res[0].stderr, res.text()
    assert shared2.run("keep").values == {0: "42", 1: "42"}
    shared2.regroup()
    assert shared2.run("dist.all_reduce(k)\nk.sum().item()").ok


def test_interrupt_inside_a_groups_first_collective_aborts_too(leak_check) -> None:
    """A group's first collective connects its ranks: the host waits inside the call itself,
    before any recorder entry exists. The interrupt escalates there too."""
    with distnb.Pool(nproc=2, share_gpus=True, pg_timeout=600, hang_after=1.0) as pool:
        res = pool.submit("f = torch.ones(2, device=device)\nif rank == 0:\n    dist.all_reduce(f)\n    f.sum().item()\n")
        wait_until(lambda: pool.diagnose(res).state == "hang", 20, "the hang diagnosis", poll=0.2)
        pool.interrupt()
        pool.wait(res, timeout=30)
        assert not res.running and res[0].status in ("interrupted", "error"), res.text()
        assert "still entering" in res[0].stderr, res.text()
        pool.regroup()
        assert pool.run("dist.all_reduce(f)\nf.sum().item()").values == {0: "4.0", 1: "4.0"}


def test_dead_rank_is_the_root_cause(shared2: distnb.Pool) -> None:
    res = shared2.run("import os\nd = torch.ones(2, device=device)\nif rank == 1:\n    os._exit(3)\ndist.all_reduce(d)\nd.sum().item()",
                      timeout=90)
    text = res.text()
    assert res[1].status == "dead" and "rank 1 died" in text, text


def test_four_ranks_on_one_gpu_name_the_rank_that_never_came(leak_check) -> None:
    with distnb.Pool(nproc=4, share_gpus=True, pg_timeout=600, hang_after=1.0) as pool:
        # A first collective connects the ranks (the host waits inside that call for its peers);
        # after it, NCCL returns at enqueue and the host waits at its next sync.
        assert pool.run("q = torch.ones(2, device=device)\ndist.all_reduce(q)").ok
        res = pool.submit("if rank != 2:\n    dist.all_reduce(q)\n    q.sum().item()\n")
        wait_until(lambda: pool.diagnose(res).state == "hang", 20, "the hang diagnosis", poll=0.2)
        diag = pool.diagnose(res)
        assert "rank 2 finished the cell without entering it" in diag.text() and diag.culprits == [2], diag.text()
        assert "ranks 0,1,3: waiting for all_reduce #2 on group 0" in diag.text(), diag.text()
        assert "now blocked at cell line 3 (q.sum().item())" in diag.text(), diag.text()
        pool.interrupt()
        pool.wait(res, timeout=60)
        assert sorted(r for r in res.ranks if res[r].status == "interrupted") == [0, 1, 3], res.text()
        pool.regroup()
        again = pool.run("q = torch.ones(2, device=device) * rank\ndist.all_reduce(q)\nq.sum().item()")
        assert again.ok and set(again.values.values()) == {"12.0"}, again.text()
