"""Hangs, stacks, dead ranks, replay and the env contract, on real 3-rank gloo pools."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

import distnb
from distnb import _processes
from distnb.analysis.agreement.collectives import Differs
from distnb.services.native_stacks import NATIVE_TIMEOUT, py_spy_path
from distnb.wire.protocol import Msg

from conftest import usable, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


# -- end to end ---------------------------------------------------------------------------------
def wait_for_hang(pool: distnb.Pool, result: distnb.CellResult, within: float = 15.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        diag = pool.diagnose(result)
        if diag.state == "hang":
            return diag
        time.sleep(0.3)
    raise AssertionError(f"no hang diagnosed within {within} s; last: {diag.text()}")


def _held_within(pool: distnb.Pool, rank: int, cell: int, within: float, is_open: bool = True) -> float | None:
    """Seconds until the controller's log holds ``rank``'s collective of ``cell`` as open (or, with
    ``is_open=False``, no open one) — without asking the rank: what a post-mortem would say if the
    rank died now."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if (pool._tracker.collective_log.pending(rank, cell) is not None) == is_open:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def test_stacks_while_blocked_in_all_reduce_and_shutdown_of_the_hung_pool(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank != 2:\n    dist.all_reduce(x)\n")
    for r in (0, 1):
        assert _held_within(pool, r, res.cell, 30) is not None, f"rank {r} never entered the all_reduce"
    text = pool.stacks().text()
    assert "ranks 0,1: running cell" in text
    assert f"cell {res.cell} line 3" in text and "dist.all_reduce(x)" in text and "in all_reduce" in text
    assert "distnb/worker" not in text
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [2] and "rank-conditional" in diag.summary
    # The sequence number depends on what earlier tests ran on the shared pool.
    assert re.search(r"all_reduce #\d+ \[1\] f32 at cell line 3", diag.summary) and "is under `if rank != 2:`" in diag.summary, diag.summary
    # Two ranks stay blocked in gloo: shutdown still ends every process, and the pool starts again.
    pids = pool.pids()
    pool.shutdown()
    assert [p for p in pids if _processes.pid_alive(p)] == [] and pool.pids() == []
    pool.start()


def test_stacks_native_and_all_threads(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(20,), name='data-helper', daemon=True).start()\n"
        "x = torch.ones(1)\nif rank != 2:\n    dist.all_reduce(x)\n"
    )
    assert _held_within(pool, 0, res.cell, 30) is not None, "rank 0 never entered the all_reduce"
    main_only = pool.stacks([0]).text()
    assert "data-helper" not in main_only, main_only
    every = pool.stacks([0], all_threads=True).text()
    assert "data-helper" in every and "dist.all_reduce(x)" in every, every
    if py_spy_path() is None:  # found beside this Python too: the test extra installs it there
        pytest.skip("py-spy is not installed (pip install distnb[native]); the test extra installs it")
    t0 = time.monotonic()
    report = pool.stacks(native=True)
    took = time.monotonic() - t0
    # py-spy's own view of each live rank: for a rank blocked in the all_reduce, the C++ wait
    # under the cell's Python frame.
    assert "native (py-spy):" in report.text()
    assert "c10d::Work::wait" in report[0].native and "<cell-" in report[0].native, report[0].native
    assert report[2].native, report.text()
    # They run at once, within the product's one bound for all of them (not one bound each).
    assert "did not finish" not in report.text() and took < NATIVE_TIMEOUT + 5, f"py-spy on 3 ranks took {took:.1f} s"


def test_rank_that_raised_is_named_root_cause(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(x)\n")
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [1] and "ValueError: bad batch" in diag.summary
    assert "Root cause" in diag.summary


def test_different_collectives_name_the_odd_rank(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("x = torch.ones(1)\nif rank == 0:\n    dist.broadcast(x, 0)\nelse:\n    dist.barrier()\n")
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [0] and "broadcast" in diag.summary and "barrier" in diag.summary


def test_a_helper_an_earlier_cell_defined_called_under_an_if_on_the_rank_is_named_as_that_if(pool3: distnb.Pool) -> None:
    """A notebook's evaluate() from an earlier cell, called by rank 0 alone: its all_reduce was
    issued by the running cell (not "calls of different cells paired"), and the ``if`` is there."""
    pool = usable(pool3)
    defined = pool.run("def eh_evaluate():\n    l = torch.zeros(1)\n    dist.all_reduce(l)\n    return l\n")
    assert defined.ok, defined.text()
    res = pool.submit("for it in range(3):\n    if it == 1 and rank == 0:\n        eh_evaluate()\ndist.barrier()\n")
    diag = wait_for_hang(pool, res)
    assert diag.culprits == [0] and "paired calls of different cells" not in diag.text(), diag.text()
    assert f"in eh_evaluate() (cell {defined.cell} line 3)" in diag.summary and "under `if it == 1 and rank == 0:`" in diag.summary, diag.text()


def test_stack_of_rank_holding_the_gil(pool3: distnb.Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = usable(pool3)
    # Catastrophic regex backtracking runs in C and never releases the GIL (~5 s here, each more
    # 'a' doubles it: 27 keeps it going on a machine twice as fast).
    res = pool.submit("import re\nre.match(r'(a+)+$', 'a' * 27 + 'b')", ranks=[1])
    wait_until(lambda: "re.match" in pool.stacks([1]).text(), 30, "rank 1 in the regex")
    report = pool.stacks([1])
    assert "faulthandler" in report.text() and "re.match" in report.text(), report.text()
    # The live watch diagnoses once a second: a rank that can't answer must cost one timeout per
    # reading (stacks and logs asked together), not one per question. Counted, not timed.
    requests = pool._tracker.requests
    asked: list[tuple[Any, tuple[int, ...]]] = []
    original = requests.ask

    def counted(identity: Any, ranks: list[int], msg: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        asked.append((msg["t"], tuple(ranks)))
        return original(identity, ranks, msg, *args, **kwargs)

    monkeypatch.setattr(requests, "ask", counted)
    diag = pool.diagnose(res)
    monkeypatch.undo()
    assert res.running == [1], "the regex ended too early for this test"
    of_rank_1 = [kind for kind, ranks in asked if 1 in ranks]
    stacks, faults = of_rank_1.count(Msg.STACKS), of_rank_1.count(Msg.FAULT_REQUEST)
    # One question a reading (stacks carrying the logs), then faulthandler's dump for the silent rank.
    assert stacks >= 1 and len(of_rank_1) == stacks + faults and faults <= stacks, of_rank_1
    assert "rank 1: running Python code" in diag.text() and "re.match" in diag.text(), diag.text()
    pool.wait(res, timeout=120)


def test_stack_of_rank_in_a_busy_python_loop(pool3: distnb.Pool, tmp_path: Path) -> None:
    pool = usable(pool3)
    # Pure Python gives the GIL up every few ms: the control thread answers, no faulthandler needed.
    # The loop runs until the test has looked (its file), however slow the machine.
    stop = tmp_path / "stop"
    res = pool.submit(f"import os\nprint('looping', flush=True)\nwhile not os.path.exists({str(stop)!r}):\n    pass\n", ranks=[1])
    wait_until(lambda: "looping" in res[1].stdout, 30, "rank 1 in its loop")
    text = pool.stacks([1], timeout=5.0).text()  # the control thread's answer, given time for a busy machine
    stop.touch()
    assert "rank 1: running cell" in text and "faulthandler" not in text, text
    # The loop's frame: its test or its body, by where the interpreter stood (3.12 reports `pass` often).
    assert ("while not os.path.exists(" in text or "line 4 in <module>: pass" in text) and f"cell {res.cell} line" in text, text
    pool.wait(res, timeout=30)
    assert res.ok, res.text()


def test_rank_killed_mid_cell_is_reported_first(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
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


def test_death_is_reported_at_once_while_a_grandchild_holds_the_pipes(pool3: distnb.Pool) -> None:
    """A DataLoader worker or any subprocess inherits the rank's stdout/stderr; the post-mortem
    must not wait for it to close them."""
    import os
    import signal

    pool = usable(pool3)
    code = (
        "import os, signal, subprocess, sys\nx = torch.ones(1)\n"
        "if rank == 1:\n"
        "    sleeper = subprocess.Popen(['sleep', '600'])\n"
        "    print('sleeper', sleeper.pid, flush=True)\n"
        "    print('going down', file=sys.stderr, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(x)\n"
    )
    t0 = time.monotonic()
    res = pool.run(code, timeout=30)
    took = time.monotonic() - t0
    sleeper = [int(line.split()[1]) for line in res[1].stdout.splitlines() if line.startswith("sleeper ")]
    alive = []
    for pid in sleeper:  # started by this test's cell: stop it by its PID
        try:
            os.kill(pid, 0)
            alive.append(pid)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert sleeper, res.text()
    assert res[1].status == "dead" and res[1].returncode == -9, res.text()
    assert "going down" in res.text()
    # The post-mortem came while the grandchild still held the rank's pipes open (it sleeps 10
    # minutes): the report did not wait for their EOF, which would have run into the cell's timeout.
    assert alive == sleeper and took < 15, f"the death took {took:.2f} s to reach the notebook; sleeper alive: {alive}"


def test_death_inside_a_collective_names_it(pool3: distnb.Pool, tmp_path: Path) -> None:
    import signal

    pool = usable(pool3)
    go = tmp_path / "go"  # rank 0 stays out of the all_reduce until rank 1 is dead in it, however slow the machine
    res = pool.submit(f"import os, time\nx = torch.ones(2)\nif rank == 0:\n    while not os.path.exists({str(go)!r}):\n"
                      "        time.sleep(0.01)\ndist.all_reduce(x)")
    try:
        # The rank pushes its log within ~50 ms of entering the all_reduce; nobody asks it here.
        held = _held_within(pool, 1, res.cell, 60.0)
        assert held is not None, "rank 1's all_reduce never reached the controller"
        os.kill(pool.status().ranks[1].pid, signal.SIGKILL)
        # Only rank 1's post-mortem matters here; the others may stay stuck in gloo for a long time.
        wait_until(lambda: res[1].status == "dead", 30, "rank 1's death to reach the notebook")
        assert "rank 1 died first: killed (SIGKILL" in res.text()
        assert "while in all_reduce [2] f32 (#" in res.text()
    finally:
        go.touch()


def test_ranks_push_their_open_collective_and_its_end_without_being_asked(pool3: distnb.Pool, monkeypatch, tmp_path: Path) -> None:
    pool = usable(pool3)
    # The controller's own poll is switched off: only the ranks' pushes (worker/process/control.py, every
    # WATCH_INTERVAL once the controller's WATCH came, WATCH_AFTER into the cell) can bring the log
    # news. How quick they are is measured in benchmarks/bench_hangs.py; here, that they come, and
    # that the end of the collective is known while the rank still computes (a death then must not
    # be "in all_reduce").
    monkeypatch.setattr(pool._tracker._asks, "poll_collectives", lambda running, dead: None)
    # Rank 0 enters the all_reduce once the test saw rank 1's open entry (its file "go"), and every
    # rank stays in the cell after it until the test saw the end pushed ("end"): files, not sleeps.
    go, end = tmp_path / "go", tmp_path / "end"
    code = (f"import os, time\nx = torch.ones(2)\nif rank == 0:\n    while not os.path.exists({str(go)!r}):\n        time.sleep(0.01)\n"
            f"dist.all_reduce(x)\nwhile not os.path.exists({str(end)!r}):\n    time.sleep(0.01)")
    res = pool.submit(code)
    try:
        held = _held_within(pool, 1, res.cell, 60.0)
        assert held is not None, "rank 1's open all_reduce was never pushed"
        assert 0 in res.running  # rank 0 waits for the file: rank 1 is in the collective, not past it
        go.touch()
        closed = _held_within(pool, 1, res.cell, 60.0, is_open=False)
        assert closed is not None and set(res.running) == {0, 1, 2}, "the collective's end was not pushed while the ranks computed"
    finally:
        go.touch()
        end.touch()
    pool.wait(res, timeout=30)
    assert res.ok, res.text()


def _release(fifo: Path) -> None:
    """Let the rank blocked reading ``fifo`` go on: its open for reading waits for this writer."""
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet (the rank has not got there)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        os.write(fd, b"x")
        os.close(fd)
        return


def test_same_hang_a_second_later_has_the_same_headline(pool3: distnb.Pool, tmp_path) -> None:
    pool = usable(pool3)
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    # Rank 2 is held in Python code (a read of a pipe: no CPU, so no reading of its CPU share can
    # fall on either side of a threshold) while ranks 0,1 wait for it in the all_reduce.
    code = f"import os\nx = torch.ones(2)\nif rank == 2:\n    os.read(os.open({str(fifo)!r}, os.O_RDONLY), 1)\ndist.all_reduce(x)"
    res = pool.submit(code)
    try:
        first = wait_for_hang(pool, res)
        assert "rank 2 is still running Python code" in first.summary, first.text()
        time.sleep(1.0)
        second = pool.diagnose(res)
    finally:
        _release(fifo)
    # The text watch prints a diagnosis only when its first line changes: it must not say it again
    # every second. The durations are in the per-rank lines.
    assert second.text().split("\n")[0] == first.text().split("\n")[0], (first.text(), second.text())
    assert second.text() != first.text()
    pool.wait(res, timeout=30)
    assert res.ok, res.text()


def test_a_rank_outside_the_cell_is_named_not_blamed_as_finished(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("x = torch.ones(2)\ndist.all_reduce(x)", ranks=[0, 1])
    diag = wait_for_hang(pool, res)
    assert "rank 2, which is not part of this cell" in diag.summary and "finished" not in diag.summary, diag.text()
    assert diag.culprits == [2] and "rank 2: idle: not part of this cell" in diag.text()
    # Rank 2 joins from a cell of its own: the hang resolves, no restart needed.
    rescue = pool.run("dist.all_reduce(torch.ones(2))", ranks=[2], timeout=30)
    pool.wait(res, timeout=30)
    assert rescue.ok and res.ok, res.text()


def test_restart_replay_restores_state(fresh_pool) -> None:
    # Replay re-runs every cell since the launch, across restarts: a pool of its own, so that only
    # this test's cells are the session (other tests' cells may only have succeeded together).
    pool = fresh_pool(nproc=3)
    pool.run("replay_a = rank * 10")
    pool.run("replay_b = replay_a + 1")
    pool.run("1/0")  # failed cells are not replayed
    seen = []
    pool.restart(replay=True, on_replay=seen.append)
    assert [r.ok for r in seen] == [True, True]
    assert pool.pull("replay_b") == {0: 1, 1: 11, 2: 21}


def test_env_contract(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    env = pool.env()
    assert {r: e["RANK"] for r, e in env.env.items()} == {0: "0", 1: "1", 2: "2"}
    assert all(e["WORLD_SIZE"] == "3" for e in env.env.values())
    assert env.differing() == []
    # The contract is always listed; a device mask nobody set says so (this machine has no GPU
    # and the test run sets none).
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert re.search(r"CUDA_VISIBLE_DEVICES +<unset> \(all ranks\)", env.text()), env.text()
    assert "MASTER_PORT" in env.text() and "LOCAL_WORLD_SIZE" in env.text()
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


# -- two ranks: mismatches that abort or hang with no majority -------------------------------------
def test_barrier_against_all_reduce_names_both_ranks(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.submit("x = torch.ones(1)\nif rank == 0:\n    dist.barrier()\nelse:\n    dist.all_reduce(x)")
    diag = wait_for_hang(pool, res)
    # One rank each: nothing says which side is wrong, so neither is picked.
    # The sequence number depends on what earlier tests ran on the shared pool.
    assert diag.culprits == [0, 1] and re.match(r"op mismatch at barrier #\d+ on group 0: rank 0 barrier #\d+ at cell line 3; "
                                                r"rank 1 all_reduce #\d+ \[1\] f32", diag.summary), diag.summary
    assert "the ranks took different branches" in diag.summary, diag.summary
    assert "No majority to tell which side went wrong: rank 0 against rank 1" in diag.summary


def test_gloo_shape_mismatch_without_detail_aborts_and_is_explained(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    t0 = time.monotonic()
    res = pool.run("batch = torch.ones(64 if rank == 0 else 48, 16)\ndist.all_reduce(batch)", timeout=30)
    assert time.monotonic() - t0 < 10 and not res.running
    text = res.text()
    # gloo aborts the rank that receives more bytes than its tensor holds, within ms of both arriving.
    assert res[1].status == "dead" and res[1].returncode == -6
    assert "rank 1 died first: aborted (SIGABRT" in text, text
    assert "rank 1 died first: aborted (SIGABRT: a C++ assertion or abort(), e.g. gloo on mismatched tensors), while in all_reduce" in text
    assert "Received data size doesn't match expected size" in text
    assert pool.state == distnb.PoolState.BROKEN


def test_dtype_mismatch_is_named_from_the_log_of_the_rank_that_aborted(pool2: distnb.Pool, tmp_path: Path) -> None:
    pool = usable(pool2)
    # Rank 0 (float32) waits first; rank 1 arrives once the notebook holds rank 0's open entry,
    # with float64, and gloo aborts rank 0.
    go = tmp_path / "go"
    code = ("import os, time\nx = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)\n"
            f"if rank == 1:\n    while not os.path.exists({str(go)!r}):\n        time.sleep(0.01)\ndist.all_reduce(x)")
    res = pool.submit(code)
    held = _held_within(pool, 0, res.cell, 30)
    go.touch()
    pool.wait(res, timeout=30)
    assert held is not None, "rank 0's all_reduce never reached the notebook"
    text = res.text()
    assert res[0].status == "dead" and res[0].returncode == -6, text
    # The rank's log reached the controller while it waited, before the abort.
    assert "rank 0 died first: aborted (SIGABRT" in text and "while in all_reduce [4] f32 (#" in text, text
    report = pool.collectives()
    [div] = report.divergences()
    assert div.kind == "dtype", report.text()
    assert "different dtypes: rank 0 all_reduce [4] f32; rank 1 all_reduce [4] f64" in report.text()


# -- collective log (Flight Recorder) -------------------------------------------------------------
def test_uneven_loop_lengths_and_collective_log(pool3: distnb.Pool) -> None:
    # Earlier cells' collectives (if any ran on this pool) are counted by sequence number, not by
    # the entries the log holds.
    pool = usable(pool3)
    pool.run("x = torch.ones(2)\nfor i in range(3):\n    dist.all_reduce(x)\n", timeout=30)
    res = pool.submit("x = torch.ones(2)\nfor i in range(5 if rank == 0 else 4):\n    dist.all_reduce(x)\n")
    diag = wait_for_hang(pool, res)
    assert diag.summary.startswith("uneven loop: rank 0 ran 5 steps of (all_reduce [2] f32) at cell line 3 on group 0, ranks 1,2 ran 4"), \
        diag.summary
    # The cause is offered with its evidence: the loop, read from the cell; rank 0 is the odd one by majority.
    assert f"the call is inside `for i in range(5 if rank == 0 else 4):` (cell {res.cell} line 2)" in diag.summary, diag.summary
    assert diag.culprits == [0]
    report = pool.collectives(last=3)
    [div] = report.divergences()
    last = report.log.last_seq(1, "0")
    assert (div.seq, div.kind) == (last + 1, "missing")
    text = report.text()
    assert f"first divergence: collective #{last + 1} on group 0 (ranks 0-2): rank 0 entered all_reduce, ranks 1,2 never did" in text
    assert "◀ first divergence" in text and "⏳" in text
    stacks = pool.stacks([0]).text()
    assert f"in all_reduce [2] f32 (#{last + 1} on group 0)" in stacks


def test_subgroup_missing_member(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("g = dist.new_group([0, 1])\nx = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(x, group=g)\n")
    diag = wait_for_hang(pool, res)
    # The call under `if rank == 0:` on a group of ranks 0 and 1: only rank 0 reaches it.
    assert diag.summary.startswith("rank-conditional collective: rank 0 entered all_reduce #1 [2] f32 at cell line 4, but rank 1 "
                                   "finished the cell without entering it"), diag.summary
    assert diag.culprits == [0]


def test_ddp_internal_collectives_are_logged(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
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
    # Every entry of the finished cell completed: none may be marked "entered, not completed".
    assert not [e for e in report.log.sequence(0, "0") if e.get("cell") == res.cell and not e["done"]], report.text()


def test_shape_mismatch_is_named_from_the_collective_log(pool3: distnb.Pool) -> None:
    pool = usable(pool3)
    res = pool.submit("x = torch.ones(3 if rank == 0 else 4)\ndist.all_reduce(x)")
    diag = wait_for_hang(pool, res)
    assert re.match(r"shape mismatch at all_reduce #\d+ on group 0: ", diag.summary), diag.summary
    assert re.search(r"rank 0 all_reduce #\d+ \[3\] f32 at cell line 2; ranks 1,2 all_reduce #\d+ \[4\] f32", diag.summary), diag.summary
    assert diag.culprits == [0]
    [div] = pool.collectives().divergences()
    assert div.kind is Differs.SHAPE and f"#{div.seq} on group 0" in diag.summary


def test_regroup_after_a_collective_timeout_keeps_state() -> None:
    with distnb.Pool(nproc=2, backend="gloo", pg_timeout=3) as pool:
        pool.run("kept = 41 + rank\nx = torch.ones(1)")
        res = pool.run("if rank == 0:\n    dist.all_reduce(x)", timeout=30)
        assert res.failed == [0] and "a collective timed out" in res.text() and "%dist_regroup" in res.text()
        assert not pool.run("dist.all_reduce(x)", timeout=30).ok  # the group is poisoned
        before = pool.collectives().log.last_seq(0, "0")
        assert before is not None and before >= 2
        pool.regroup()
        res = pool.run("y = torch.ones(1); dist.all_reduce(y); (y.item(), kept)", timeout=30)
        assert res.ok and res.values == {0: "(2.0, 41)", 1: "(2.0, 42)"}
        # The new default group is "0" again, counting from #1; the old group's entries (and its
        # timed-out all_reduce, never retired) must not mix with it.
        report = pool.collectives()
        for r in (0, 1):
            assert [(e["seq"], e["op"], e["done"]) for e in report.log.sequence(r, "0")] == [(1, "all_reduce", True)]
            assert report.log.pending(r) is None
        assert report.divergences() == [] and "agree" in report.text()


def test_a_healthy_ddp_loop_is_never_called_a_hang(pool3: distnb.Pool, tmp_path: Path) -> None:
    """Several seconds of DDP training at the default threshold: ranks keep entering and leaving
    the same collectives, one of them a little slower; the watch must not cry hang."""
    pool = usable(pool3)
    setup = pool.run(
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nhl_model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))\n"
        "hl_opt = torch.optim.SGD(hl_model.parameters(), lr=0.01)\nhl_x = torch.randn(64, 256)\n",
        timeout=120,
    )
    assert setup.ok, setup.text()
    stop = tmp_path / "stop"
    res = pool.submit(
        # The loop runs until the test has read it often enough, however fast this machine is today:
        # rank 0 reads the test's stop file and every rank learns it from an all_reduce. (A loop run
        # until each rank's own clock says stop would itself be an uneven loop, rightly a hang.)
        "import os, time\nsteps = 0\nhl_stop = torch.zeros(1)\n"
        "while hl_stop.item() == 0:\n"
        "    hl_opt.zero_grad(); hl_model(hl_x).sum().backward(); hl_opt.step(); steps += 1\n"
        "    if rank == 1:\n        time.sleep(0.01)  # a slightly slower rank: the others wait for it every step\n"
        f"    hl_stop = torch.tensor([float(rank == 0 and os.path.exists({str(stop)!r}))])\n"
        "    dist.all_reduce(hl_stop)\n"
        "steps"
    )
    seen = []
    while res.running and len(seen) < 8:
        diag = pool.diagnose(res)  # the pool's threshold: the default 3 s would apply; pool3 uses 1 s
        seen.append(diag.state)
        assert diag.state != "hang", diag.text()
        time.sleep(0.5)
    stop.touch()
    pool.wait(res, timeout=60)
    assert res.ok, res.text()
    assert len(seen) == 8 and int(res.values[0]) > 10, (seen, res.values)


def test_a_rank_computing_longer_than_hang_after_is_slow_not_a_hang(pool3: distnb.Pool) -> None:
    """A rank given more work: the others wait for it in the all_reduce past ``hang_after``
    while its main thread uses the CPU. The cell is healthy and slow — never called a hang. The
    sleeping rank of ``test_same_hang_a_second_later_has_the_same_headline`` uses no CPU and is."""
    pool = usable(pool3)
    hang_after = pool.config.hang_after
    work = hang_after + 6.0
    res = pool.submit(f"import time\nx = torch.ones(2)\nif rank == 2:\n    end = time.monotonic() + {work}\n"
                      "    while time.monotonic() < end:\n        sum(range(1000))\ndist.all_reduce(x)")
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < work - 1.0:
        diag = pool.diagnose(res)
        if time.monotonic() - t0 > hang_after + 1.0 and diag.kind == "still_running":
            seen.append(diag)
        assert diag.state != "hang" or diag.kind != "still_running" or diag.summary.count("without using the CPU") == 0, diag.text()
        time.sleep(0.5)
    assert seen and all(d.state == "slow" for d in seen), [d.text() for d in seen]
    assert "rank 2 is still computing outside any collective" in seen[-1].summary, seen[-1].text()
    pool.wait(res, timeout=60)
    assert res.ok, res.text()
