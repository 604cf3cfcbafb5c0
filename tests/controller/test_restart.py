"""``%dist_restart`` under the running torchrun: fresh rank processes from spares that imported
torch already, a new process group under its own store prefix and connection names; the fall
back to a full restart where that can't be done."""

from __future__ import annotations

import os
import signal
import time

import pytest

from distnb import LaunchConfig, PoolState
from distnb.transport import startup
from distnb.wire.codec import BadFrame
from distnb.wire.peers import control_identity, exec_identity, generation_of, parse_identity

from conftest import wait_gone, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _respawns_take_the_start_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh ranks without a spare (or with one still importing) import torch during the restart: on
    a loaded machine (CI's legs beside the suite) that outlasted RESPAWN_TIMEOUT once, and the
    restart fell back to a new torchrun, as designed. Given the launch's own start timeout, only a
    failure makes these tests' restarts fall back."""
    monkeypatch.setattr(startup, "RESPAWN_TIMEOUT", LaunchConfig().start_timeout)


def supervisors(pool) -> dict[int, int]:
    return {r: info.supervisor_pid for r, info in pool._tracker.ranks.items()}


def rank_pids(pool) -> dict[int, int]:
    return {s.rank: s.pid for s in pool.status().ranks}


def test_a_respawned_rank_connects_under_a_name_of_its_generation() -> None:
    assert exec_identity(3) == b"x3" and exec_identity(3, 2) == b"x3.2" and control_identity(3, 2) == b"c3.2"
    assert parse_identity(b"x3.2") == ("x", 3) and generation_of(b"x3.2") == 2 and generation_of(b"x3") == 0
    for bad in (b"s3.2", b"n1.1", b"x3.", b"x3.a", b"x.2"):
        with pytest.raises(BadFrame):
            parse_identity(bad)


@pytest.mark.timeout(180)
def test_restart_replaces_only_the_rank_processes_and_works_again_and_again(fresh_pool) -> None:
    pool = fresh_pool(nproc=3, spares=True)
    agent, sups = pool.status().agent_pid, supervisors(pool)
    first = pool.run("rs_var = rank + 1\nrs_var")
    for round_ in range(3):
        old = rank_pids(pool)
        pool.restart()
        assert pool.state == PoolState.READY
        assert pool.status().agent_pid == agent and supervisors(pool) == sups  # torchrun and supervisors kept
        new = rank_pids(pool)
        assert not set(new.values()) & set(old.values()) and wait_gone(list(old.values()), 2.0) == []
        res = pool.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n('rs_var' in globals(), t.item(), __import__('os').getpid())")
        assert res.ok, res.text()
        assert {r: v for r, v in res.values.items()} == {r: f"(False, 6.0, {new[r]})" for r in range(3)}
        assert res.cell > first.cell
        if round_ == 0:
            time.sleep(0.5)  # the next restart may find its spares still importing torch: it waits for them


@pytest.mark.timeout(180)
def test_a_broken_pool_restarts_under_the_same_torchrun(fresh_pool) -> None:
    pool = fresh_pool(nproc=2, spares=True)
    agent = pool.status().agent_pid
    os.kill(rank_pids(pool)[1], signal.SIGKILL)
    wait_until(lambda: pool.state == PoolState.BROKEN, 10, "the pool to notice the death")
    pool.restart(replay=False)
    assert pool.state == PoolState.READY and pool.status().agent_pid == agent
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}


@pytest.mark.timeout(180)
def test_a_restart_without_spares_still_keeps_torchrun(fresh_pool) -> None:
    pool = fresh_pool(nproc=2, spares=False)
    agent = pool.status().agent_pid
    pool.run("gone = 1")
    notes: list[str] = []
    pool.restart(on_note=notes.append)
    assert pool.status().agent_pid == agent, notes
    assert pool.run("'gone' in globals()").values == {0: "False", 1: "False"}


@pytest.mark.timeout(240)
def test_a_lost_supervisor_means_a_full_restart(fresh_pool) -> None:
    pool = fresh_pool(nproc=2, spares=True)
    agent = pool.status().agent_pid
    os.kill(supervisors(pool)[1], signal.SIGKILL)  # torchrun then stops the job
    wait_until(lambda: pool.state == PoolState.BROKEN, 15, "the pool to notice the lost supervisor")
    pool.restart()
    assert pool.state == PoolState.READY and pool.status().agent_pid != agent
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}


@pytest.mark.timeout(180)
def test_a_hung_cell_ends_with_the_restart_that_replaces_its_ranks(fresh_pool) -> None:
    pool = fresh_pool(nproc=2, spares=True)
    hung = pool.submit("import time\nif rank == 0:\n    t = torch.ones(1); dist.all_reduce(t)\nelse:\n    time.sleep(600)")
    # Rank 0 in its all_reduce (what the restart's words name) before the restart, however slow the start.
    wait_until(lambda: pool._tracker.collective_log.pending(0, hung.cell) is not None, 60, "rank 0 in the all_reduce")
    pool.wait(hung, timeout=0.5)
    assert hung.running == [0, 1]
    pool.restart()
    assert pool.state == PoolState.READY and not hung.running
    assert {r: (v.status, v.cause) for r, v in hung.results.items()} == {r: ("dead", "its pool was restarted") for r in (0, 1)}
    assert "rank 0 died: its pool was restarted, while in all_reduce" in hung.outcome_text()
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(240)
def test_a_warmed_pool_forks_fresh_ranks_with_the_sessions_modules_loaded(fresh_pool) -> None:
    """%dist_minimize's tries: fresh ranks forked from a zygote per rank that imported what the
    session's cells imported (worker/process/zygote.py), each a process of its own to the pool."""
    pool = fresh_pool(nproc=2, spares=True)
    sups = supervisors(pool)
    first = pool.run("import json\nimport torch.distributed.fsdp\n1")
    assert "torch.distributed.fsdp" in first.imported and "json" not in first.imported, first.imported
    assert pool.run("import torch.distributed.fsdp\n2").imported == []  # only what a cell imported first
    pool.warm(first.imported)
    draws: dict[int, set[str]] = {0: set(), 1: set()}
    zygotes: set[int] = set()
    for _ in range(2):
        old = rank_pids(pool)
        pool.restart()
        assert pool.state == PoolState.READY and supervisors(pool) == sups
        new = rank_pids(pool)
        assert wait_gone(list(old.values()), 5.0) == []
        res = pool.run("import os, random, sys\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                       "('torch.distributed.fsdp' in sys.modules, t.item(), os.getpid(), os.getppid(), random.random())")
        assert res.ok, res.text()
        for r, text in res.values.items():
            loaded, total, pid, parent, draw = eval(text or "")
            assert (loaded, total, pid) == (True, 2.0, new[r]), text
            assert parent != sups[r] and _parent_of(parent) == sups[r], "not forked by a zygote under the rank's supervisor"
            zygotes.add(parent)
            draws[r].add(draw)
    assert len(zygotes) == 2 and all(len(d) == 2 for d in draws.values()), (zygotes, draws)  # each fork draws its own seed
    # A forked rank's death is said as a started one's: its signal, from its zygote's wait.
    res = pool.run("import ctypes\nif rank == 1:\n    ctypes.string_at(0)", timeout=60)
    assert res[1].status == "dead" and res[1].returncode == -signal.SIGSEGV, res.text()
    pool.restart()
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}
    # A rank dies with its zygote (its parent-death signal); the next restart starts processes anew.
    zygote0 = _parent_of(rank_pids(pool)[0])
    os.kill(zygote0, signal.SIGKILL)
    wait_until(lambda: pool.state == PoolState.BROKEN, 30, "the pool to notice rank 0's death")
    pool.restart()
    assert pool.state == PoolState.READY and supervisors(pool) == sups
    assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").values == {0: "2.0", 1: "2.0"}
    assert _parent_of(rank_pids(pool)[0]) == sups[0]
    pool.shutdown()
    assert wait_gone(sorted(zygotes), 10.0) == [], "a zygote outlived its pool"
