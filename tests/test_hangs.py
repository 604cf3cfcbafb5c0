"""Hangs, stacks, dead ranks, replay and the env contract, on real 3-rank gloo pools."""

from __future__ import annotations

import re
import time

import pytest

import distnb
from distnb.diagnose import Position, diagnose, position_from_stack
from distnb.stacks import Frame, RankStack, ThreadStack, parse_faulthandler

pytestmark = pytest.mark.timeout(180)


# -- unit: diagnosis from positions -------------------------------------------------------------
def test_diagnose_rank_conditional() -> None:
    d = diagnose([Position(0, "collective", op="barrier", line=3, since=5.0), Position(1, "finished")], 3.0, 5.0)
    assert d.kind == "hang" and "rank-conditional" in d.summary and d.culprits == [1]
    assert "barrier at cell line 3" in d.summary


def test_diagnose_slow_but_consistent() -> None:
    d = diagnose([Position(r, "collective", op="all_reduce", since=9.0) for r in range(3)], 3.0, 9.0)
    assert d.kind == "slow" and "not a hang" in d.summary


def test_diagnose_waits_below_threshold_are_ok() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", since=1.0), Position(1, "finished")], 3.0, 1.0)
    assert d.kind == "ok"


def test_diagnose_dead_rank_is_root_cause() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", since=4.0), Position(1, "dead", detail="killed (SIGKILL)")], 3.0, 4.0)
    assert d.kind == "hang" and d.culprits == [1] and "Root cause: rank 1" in d.summary


def test_diagnosis_groups_ranks_waiting_in_the_same_place_whatever_their_wait() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", seq=1, group="0", line=3, since=3.04),
                  Position(1, "failed", line=2, detail="KeyError: 'label'"),
                  Position(2, "collective", op="all_reduce", seq=1, group="0", line=3, since=2.96)], 3.0, 3.1)
    assert "ranks 0,2: waiting in all_reduce #1 on group 0 for 3.0 s at cell line 3" in d.text()
    d = diagnose([Position(0, "collective", op="all_reduce", since=3.0), Position(1, "collective", op="all_reduce", since=4.5),
                  Position(2, "finished")], 3.0, 4.5)
    assert "ranks 0,1: waiting in all_reduce for 3.0–4.5 s" in d.text()


def test_a_rank_still_importing_is_slow_not_hung() -> None:
    frames = [Frame("<cell-4>", 2, "<module>", "model = DDP(model)"),
              Frame("/site-packages/torch/nn/parallel/distributed.py", 10, "__init__", "import torch._dynamo"),
              Frame("<frozen importlib._bootstrap>", 1176, "_find_and_load", ""),
              Frame("/site-packages/torch/_dynamo/__init__.py", 3, "<module>", "from . import config")]
    stack = RankStack(1, "running cell 4 for 5.0 s", "control thread", [ThreadStack("MainThread", True, frames)])
    pos = position_from_stack(stack)
    assert pos.state == "computing" and pos.detail.startswith("importing") and "_dynamo/__init__.py" in pos.detail
    pos.since = 5.0
    d = diagnose([Position(0, "collective", op="all_reduce", since=5.0), pos], 3.0, 5.0)
    assert d.kind == "slow" and "still importing modules" in d.summary and "not a hang yet" in d.summary
    assert "rank 1: running Python code (not in a collective, importing" in d.text()
    pos.detail = ""
    assert diagnose([Position(0, "collective", op="all_reduce", since=5.0), pos], 3.0, 5.0).kind == "hang"


def test_post_mortem_keeps_the_abort_message_not_the_cpp_frames() -> None:
    from distnb.results import RankResult

    stderr = "\n".join([
        "[rank 1] before the crash",
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4",
        "Exception raised from recv at pair.cc:446 (most recent call first):",
        *[f"frame #{i}: <unknown function> + 0x{i:x} (libtorch_cpu.so)" for i in range(60)],
        "Fatal Python error: Aborted",
        "Current thread 0x00007f (most recent call first):",
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2870 in all_reduce',
        '  File "<cell-7>", line 3 in <module>',
    ])
    text = RankResult(1, status="dead", returncode=-6, stderr_tail=stderr, first_death=True).death_text()
    assert "what():  [enforce fail at pair.cc:446]" in text and "Fatal Python error: Aborted" in text
    assert '<cell-7>", line 3' in text and "frame #" not in text and "distributed_c10d.py" not in text
    assert text.startswith("rank 1 died first: aborted (SIGABRT")


def test_parse_faulthandler_orders_frames_and_finds_main() -> None:
    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/re/__init__.py", line 166 in match\n'
        '  File "<cell-4>", line 2 in <module>\n'
    )
    threads = parse_faulthandler(dump, {"<cell-4>": "import re\nre.match(p, s)"}, main_ident=0x7F0000000001)
    assert threads[0].main and [f.name for f in threads[0].frames] == ["<module>", "match"]
    assert threads[0].frames[0].line == "re.match(p, s)"


# -- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool3():
    pool = distnb.Pool(nproc=3, backend="gloo", hang_after=1.0)
    pool.start()
    yield pool
    pool.shutdown()
    assert pool.pids() == []


def fresh(pool: distnb.Pool) -> distnb.Pool:
    """A usable pool: restart it if an earlier scenario left it hung or broken."""
    if pool.state != distnb.PoolState.READY or any(s.state.value == "running" for s in pool.status().ranks):
        pool.restart()
    return pool


def wait_for_hang(pool: distnb.Pool, result: distnb.CellResult, within: float = 15.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        diag = pool.diagnose(result)
        if diag.kind == "hang":
            return diag
        time.sleep(0.3)
    raise AssertionError(f"no hang diagnosed within {within} s; last: {diag.text()}")


def test_stacks_while_blocked_in_all_reduce_and_shutdown_works(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank != 2:\n    dist.all_reduce(x)\n")
    time.sleep(1.5)
    t0 = time.monotonic()
    report = pool.stacks()
    assert time.monotonic() - t0 < 2.0
    text = report.text()
    assert "ranks 0,1: running cell" in text
    assert "<cell-" in text and "dist.all_reduce(x)" in text and "in all_reduce" in text
    assert "distnb/worker" not in text
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [2] and "rank-conditional" in diag.summary
    assert "all_reduce #1 at cell line 3" in diag.summary


def test_rank_that_raised_is_named_root_cause(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(x)\n")
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [1] and "ValueError: bad batch" in diag.summary
    assert "Root cause" in diag.summary


def test_different_collectives_name_the_odd_rank(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank == 0:\n    dist.broadcast(x, 0)\nelse:\n    dist.barrier()\n")
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [0] and "broadcast" in diag.summary and "barrier" in diag.summary


def test_stack_of_rank_holding_the_gil(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    # Catastrophic regex backtracking runs in C and never releases the GIL.
    res = pool.submit("import re\nre.match(r'(a+)+$', 'a' * 28 + 'b')", ranks=[1])
    time.sleep(0.5)
    report = pool.stacks([1])
    assert "faulthandler" in report.text() and "re.match" in report.text(), report.text()
    pool.wait(res, timeout=120)


def test_rank_killed_mid_cell_is_reported_first(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    code = (
        "import os, signal, sys, time\nx = torch.ones(1)\n"
        "if rank == 1:\n    print('going down', file=sys.stderr, flush=True)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(x)\n"
    )
    t0 = time.monotonic()
    res = pool.run(code, timeout=30)
    assert time.monotonic() - t0 < 10
    assert res[1].status == "dead" and res[1].returncode == -9
    text = res.text()
    assert "rank 1 died first: killed (SIGKILL" in text and "going down" in text
    assert "what became of the others: ranks 0,2" in text
    assert pool.state == distnb.PoolState.BROKEN
    with pytest.raises(distnb.PoolBrokenError, match="restart"):
        pool.run("1")
    status = pool.status().text()
    assert "dead: killed (SIGKILL" in status


def test_death_inside_a_collective_names_it(pool3: distnb.Pool) -> None:
    import os
    import signal

    pool = fresh(pool3)
    res = pool.submit("import time\nx = torch.ones(2)\nif rank == 0:\n    time.sleep(6)\ndist.all_reduce(x)")
    time.sleep(2.5)  # ranks 1 and 2 wait in the all_reduce; the pool polls their logs every second
    os.kill(pool.status().ranks[1].pid, signal.SIGKILL)
    pool.wait(res, timeout=30)
    assert res[1].status == "dead"
    assert "rank 1 died first: killed (SIGKILL" in res.text()
    assert "while in all_reduce [2] f32 (#" in res.text()


def test_restart_replay_restores_state(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    pool.run("replay_a = rank * 10")
    pool.run("replay_b = replay_a + 1")
    pool.run("1/0")  # failed cells are not replayed
    seen = []
    pool.restart(replay=True, on_replay=seen.append)
    assert [r.ok for r in seen] == [True, True]
    assert pool.pull("replay_b") == {0: 1, 1: 11, 2: 21}


def test_env_contract(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    env = pool.env()
    assert {r: e["RANK"] for r, e in env.env.items()} == {0: "0", 1: "1", 2: "2"}
    assert all(e["WORLD_SIZE"] == "3" for e in env.env.values())
    assert env.differing() == []
    pool.run("import os\nos.environ['NCCL_SOCKET_IFNAME'] = 'eth0' if rank == 0 else 'lo'")
    env = pool.env()
    assert env.differing() == ["NCCL_SOCKET_IFNAME"]
    assert "<- differs" in env.text()


def test_detail_mode_names_shape_mismatch() -> None:
    with distnb.Pool(nproc=2, backend="gloo", debug=("detail",)) as pool:
        res = pool.run("x = torch.ones(3 if rank == 0 else 4)\ndist.all_reduce(x)", timeout=60)
        assert res.failed == [0, 1]
        assert "Tensor shapes" in res.text() or "TensorShape" in res.text()
    assert pool.pids() == []


# -- collective log (Flight Recorder) -------------------------------------------------------------
def test_uneven_loop_lengths_and_collective_log(pool3: distnb.Pool) -> None:
    pool = pool3.restart()  # sequence numbers below count from a fresh process group
    res = pool.submit("x = torch.ones(2)\nfor i in range(5 if rank == 0 else 4):\n    dist.all_reduce(x)\n")
    diag = wait_for_hang(pool, res)
    assert diag.summary.startswith("uneven loop lengths: rank 0 made 5 all_reduce calls"), diag.summary
    assert diag.culprits == [1, 2]
    report = pool.collectives(last=3)
    [div] = report.divergences()
    assert (div.seq, div.kind) == (5, "missing")
    text = report.text()
    assert "first divergence: collective #5 on group 0 (ranks 0-2): rank 0 entered all_reduce, ranks 1,2 never did" in text
    assert "◀ first divergence" in text and "⏳" in text
    stacks = pool.stacks([0]).text()
    assert "in all_reduce [2] f32 (#5 on group 0)" in stacks


def test_subgroup_missing_member(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    res = pool.submit("g = dist.new_group([0, 1])\nx = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(x, group=g)\n")
    diag = wait_for_hang(pool, res)
    assert diag.summary.startswith("sub-group collective missing a member: rank 0 waits in all_reduce #1"), diag.summary
    assert diag.culprits == [1]


def test_ddp_internal_collectives_are_logged(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    code = (
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp_model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))\n"
        "ddp_model(torch.ones(3, 4)).sum().backward()\n"
    )
    res = pool.run(code, timeout=60)
    assert res.ok, res.text()
    report = pool.collectives()
    ops = [e["op"] for e in report.log.sequence(0, "0") if e.get("cell") == res.cell]
    # DDP's constructor checks shapes (allgather) and broadcasts the parameters; backward allreduces buckets.
    assert "broadcast" in ops and "all_reduce" in ops and ops[0] in ("all_gather", "allgather"), ops
    assert report.divergences() == []
    assert "agree" in report.text()


def test_shape_mismatch_is_named_from_the_collective_log(pool3: distnb.Pool) -> None:
    pool = fresh(pool3)
    res = pool.submit("x = torch.ones(3 if rank == 0 else 4)\ndist.all_reduce(x)")
    diag = wait_for_hang(pool, res)
    assert re.match(r"shape or dtype mismatch at collective #\d+ on group 0: ", diag.summary), diag.summary
    assert "rank 0 all_reduce [3] f32" in diag.summary and "ranks 1,2 all_reduce [4] f32" in diag.summary
    assert diag.culprits == [0]
    [div] = pool.collectives().divergences()
    assert div.kind == "shape" and f"#{div.seq} on group 0" in diag.summary


def test_regroup_after_a_collective_timeout_keeps_state() -> None:
    with distnb.Pool(nproc=2, backend="gloo", pg_timeout=3) as pool:
        pool.run("kept = 41 + rank\nx = torch.ones(1)")
        res = pool.run("if rank == 0:\n    dist.all_reduce(x)", timeout=30)
        assert res.failed == [0] and "a collective timed out" in res.text() and "%dist_regroup" in res.text()
        assert not pool.run("dist.all_reduce(x)", timeout=30).ok  # the group is poisoned
        pool.regroup()
        res = pool.run("y = torch.ones(1); dist.all_reduce(y); (y.item(), kept)", timeout=30)
        assert res.ok and res.values == {0: "(2.0, 41)", 1: "(2.0, 42)"}
