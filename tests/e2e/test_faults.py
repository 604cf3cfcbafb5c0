"""Whatever a rank does, the notebook keeps working, loses no output and explains what happened."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import distnb
from distnb.controller.channel import ROUTER_RCVHWM
from distnb.wire.codec import MAGIC
from distnb.worker.process.supervisor import READ_SIZE

from conftest import usable, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def test_segfault_is_a_post_mortem_with_the_python_stack(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.run("import ctypes\nif rank == 1:\n    ctypes.string_at(0)", timeout=30)
    assert res[1].status == "dead" and res[1].returncode == -signal.SIGSEGV
    text = res.text()
    assert "segmentation fault" in text
    assert "Fatal Python error: Segmentation fault" in text and "<cell-" in text  # faulthandler's dump
    assert pool.state == distnb.PoolState.BROKEN


def test_sys_exit_keeps_the_rank(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.run("import sys\nsys.exit(3)")
    assert res.failed == [0, 1] and "the rank keeps running" in res.text()
    assert pool.run("rank").values == {0: "0", 1: "1"}


def test_cell_that_closes_or_replaces_stdout(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    pool.run("import sys, io\nsys.stdout.close()")
    res = pool.run("print('still here')")
    assert res.stdout == {0: "still here\n", 1: "still here\n"}
    pool.run("import sys, io\nsys.stdout = io.StringIO()")
    assert pool.run("print('back')").stdout[0] == "back\n"


def test_binary_and_invalid_utf8_output(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.run("import os\nos.write(1, b'ok \\xff\\xfe bytes\\x00 end\\n')")
    assert res.ok and "ok" in res.stdout[0] and "end" in res.stdout[0] and "\ufffd" in res.stdout[0]


def test_100mb_of_output_is_capped_and_kernel_memory_bounded(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    with open(f"/proc/{os.getpid()}/statm") as f:
        before = int(f.read().split()[1])
    res = pool.run("import sys\nchunk = 'x' * 1023 + '\\n'\nfor _ in range(100 * 1024):\n    sys.stdout.write(chunk)\nprint('tail')", ranks=[0], timeout=120)
    with open(f"/proc/{os.getpid()}/statm") as f:
        grown = (int(f.read().split()[1]) - before) * os.sysconf("SC_PAGE_SIZE")
    assert res.ok
    kept = len(res[0].stdout)
    assert kept <= (1 << 20) + 4096 and res[0].output_truncated >= 99 * (1 << 20)
    # What the product bounds: frames in flight (the ROUTER's receive bound, each at most a pipe
    # read) and the MiB a result keeps; 32 MiB more for the interpreter's own working memory.
    bound = ROUTER_RCVHWM * READ_SIZE + (1 << 20) + (32 << 20)
    print(f"the notebook process grew by {grown >> 20} MiB for 100 MiB of output (bound {bound >> 20} MiB)")
    assert grown < bound, f"the notebook process grew by {grown >> 20} MiB (bound {bound >> 20} MiB)"
    assert pool.run("1").ok  # and the pool is fine afterwards


def test_rogue_frames_are_dropped_and_counted(pool2: distnb.Pool) -> None:
    import zmq

    pool = usable(pool2)
    channel = pool._transport.channel
    before = channel.rejected
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    # A peer taking a live rank's identity is ignored by the ROUTER itself; an unknown rank's
    # identity gets through to the signature check.
    rogue.setsockopt(zmq.IDENTITY, b"x7")
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(pool.status().address)
    import pickle

    rogue.send_multipart([MAGIC + b"\0" * 32 + pickle.dumps({"t": "done", "id": "cell-1"})])  # wrong signature
    rogue.send_multipart([b"garbage"])
    rogue.send_multipart([MAGIC + b"short"])
    deadline = time.monotonic() + 5
    while channel.rejected < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    rogue.close()
    ctx.term()
    assert channel.rejected >= before + 3
    assert pool.run("rank").values == {0: "0", 1: "1"}


def test_huge_or_unpicklable_last_value_is_summarised(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.run("torch.zeros(50_000_000)")
    assert res.ok and "tensor([0., 0., 0.,  ..., 0., 0., 0.])" in res.values[0]
    res = pool.run("import threading\nthreading.Lock()")
    assert res.ok and "lock" in res.values[0]
    res = pool.run("class Bad:\n    def __repr__(self):\n        raise RuntimeError('no repr')\nBad()")
    assert res.ok and "repr() failed" in res.values[0]


def test_recursion_error_is_a_normal_error(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    res = pool.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert res.failed == [0, 1] and "RecursionError" in res.text()
    assert len(res[0].error["traceback"]) <= 70_000
    assert pool.run("1").ok


def test_cell_that_forks(pool2: distnb.Pool) -> None:
    pool = usable(pool2)
    code = "import os\npid = os.fork()\nif pid == 0:\n    print('child says hi', flush=True)\n    os._exit(0)\nos.waitpid(pid, 0)\n'parent ok'"
    res = pool.run(code, timeout=30)
    assert res.ok and res.values[0] == "'parent ok'"
    assert "child says hi" in res[0].stdout
    assert pool.run("rank").ok


def _sigints(pool: distnb.Pool) -> dict[int, int]:
    """KeyboardInterrupts each rank's SIGINT handler has raised so far (read inside the rank)."""
    res = pool.run("import sys as _s\n_s.modules['__main__'].current.executor.sigints", timeout=20)
    assert res.ok, res.text()
    return {r: int(v) for r, v in res.values.items()}


_CATCH_FIVE = """
import time
print("ready", flush=True)
caught = 0
deadline = time.monotonic() + 30
while caught < 5 and time.monotonic() < deadline:
    try:
        while time.monotonic() < deadline:
            time.sleep(0.01)
    except KeyboardInterrupt:
        caught += 1
        print(f"caught {caught}", flush=True)
caught
"""


def test_repeated_interrupts(pool2: distnb.Pool) -> None:
    """Five interrupts, each delivered exactly once (the cell counts them), none lost, none doubled
    by the control thread's re-send, and none left over to hit the next cell."""
    pool = usable(pool2)
    before = _sigints(pool)
    res = pool.submit(_CATCH_FIVE)
    # Inside the loop first: an interrupt that beats the cell's start cancels the whole cell instead.
    wait_until(lambda: all(res[r].stdout.startswith("ready") for r in (0, 1)), 10, "the cell to start")
    for i in range(1, 6):
        pool.interrupt()
        wait_until(lambda i=i: all(f"caught {i}\n" in res[r].stdout for r in (0, 1)), 10,
                  f"interrupt {i} to reach both ranks (stdout: {res.stdout})")
        # Longer than the control thread's 0.25 s re-send: a second delivery would show up here.
        time.sleep(0.4)
        assert all(f"caught {i + 1}" not in res[r].stdout for r in (0, 1)), f"interrupt {i} arrived twice: {res.stdout}"
    pool.wait(res, timeout=20)
    assert res.ok and res.values == {0: "5", 1: "5"}, res.text()
    assert {r: n - before[r] for r, n in _sigints(pool).items()} == {0: 5, 1: 5}
    # Nothing pending: a cell that sleeps through any late re-send still ends normally.
    after = pool.run("import time\ntime.sleep(1.0)\n'clean'", timeout=20)
    assert after.ok and after.values == {0: "'clean'", 1: "'clean'"}, after.text()


def _ctrl_c_on_ticks(*ticks: int):
    """An ``on_tick`` that raises KeyboardInterrupt in the waiting thread on the given ticks, as
    Ctrl-C in Jupyter does in the thread running the cell. Ticks count from when every rank has
    printed "ready": an interrupt that beats a cell's start cancels the cell instead of reaching it."""
    seen: list[float] = []

    def on_tick(result: distnb.CellResult) -> None:
        if seen or all(r.stdout.startswith("ready") for r in result.results.values()):
            seen.append(time.monotonic())
        if len(seen) in ticks:
            raise KeyboardInterrupt

    return on_tick, seen


def test_ctrl_c_while_waiting_interrupts_the_ranks(pool2: distnb.Pool, capsys: pytest.CaptureFixture[str]) -> None:
    pool = usable(pool2)
    res = pool.submit("import time\nprint('ready', flush=True)\ntime.sleep(30)")
    on_tick, seen = _ctrl_c_on_ticks(1)
    pool.wait(res, timeout=20, on_tick=on_tick)
    # Said at once, not left to the outcome: what the interrupt does, and what a second one would.
    assert f"[distnb] interrupting cell {res.cell} on ranks 0,1:" in capsys.readouterr().err
    assert not res.timed_out and not res.detached and not res.running
    assert res[0].status == res[1].status == "interrupted", res.text()
    assert res.elapsed < 10 and len(seen) >= 1
    assert pool.run("rank").values == {0: "0", 1: "1"}


def test_second_ctrl_c_detaches_from_a_rank_that_swallows_interrupts(pool2: distnb.Pool, tmp_path: Path) -> None:
    pool = usable(pool2)
    done = tmp_path / "done"  # rank 1 swallows interrupts until the test has seen the detach, however slow the machine
    code = (
        "import os, time\n"
        "print('ready', flush=True)\n"
        "if rank == 1:\n"
        "    end = time.monotonic() + 60\n"
        f"    while time.monotonic() < end and not os.path.exists({str(done)!r}):\n"
        "        try:\n"
        f"            while time.monotonic() < end and not os.path.exists({str(done)!r}):\n"
        "                time.sleep(0.05)\n"
        "        except KeyboardInterrupt:\n"
        "            pass  # swallowed, like a library that retries on EINTR\n"
        "else:\n"
        "    time.sleep(30)\n"
    )
    res = pool.submit(code)
    first, _ = _ctrl_c_on_ticks(1)
    second: list[float] = []

    def on_tick(result: distnb.CellResult) -> None:
        first(result)
        if result[0].status == "interrupted" and not second:  # the first Ctrl-C did what it can: the second detaches
            second.append(time.monotonic())
            raise KeyboardInterrupt

    try:
        pool.wait(res, timeout=60, on_tick=on_tick)
        # Detached by the second Ctrl-C while rank 1 still swallows interrupts.
        assert res.detached and not res.timed_out and res.running == [1], res.text()
        assert res[0].status == "interrupted"
        assert any("second interrupt" in n and "rank 1 did not respond" in n and "%dist_stacks" in n for n in res.notes), res.notes
    finally:
        done.touch()
    # The rank carries on by itself; the pool is usable once it is done.
    pool.wait(res, timeout=20)
    assert res[1].status == "ok" and not res.running
    assert pool.run("rank").values == {0: "0", 1: "1"}


def test_sigstopped_rank_shows_as_hung_with_others_stacks(pool2: distnb.Pool, tmp_path: Path) -> None:
    pool = usable(pool2)
    # Rank 1 waits for the test's go file before the all_reduce that rank 0 waits in; it is stopped
    # once rank 0 is seen in the all_reduce (an order the test makes, not a machine's speed).
    go = tmp_path / "go"
    res = pool.submit(f"import os, time\nwhile rank == 1 and not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
                      "x = torch.ones(1)\ndist.all_reduce(x)")
    wait_until(lambda: "dist.all_reduce(x)" in pool.stacks(ranks=[0]).text(), 60, "rank 0 in the all_reduce", poll=0.2)
    pid = pool.status().ranks[1].pid
    os.kill(pid, signal.SIGSTOP)
    go.touch()
    try:
        report = pool.stacks()
        assert report[0].threads and "dist.all_reduce(x)" in report.text(), report.text()
        assert report[1].state.startswith("running") and not report[1].threads, report.text()
        assert f"no answer: its process (pid {pid}) is stopped (SIGSTOP" in report[1].source, report.text()
        # The hang names the stopped rank as the one rank 0 waits for, and why it is silent.
        diag = pool.diagnose(res, hang_after=0.5)
        assert diag.state == "hang" and diag.culprits == [1], diag.text()
        assert "rank 0 waits in all_reduce for rank 1, which is not answering at all" in diag.summary, diag.text()
        assert "rank 1: not answering: its process" in diag.text() and "SIGCONT resumes it" in diag.text(), diag.text()
    finally:
        os.kill(pid, signal.SIGCONT)
    pool.wait(res, timeout=30)
    assert res.ok


def test_killed_torchrun_agent_marks_every_rank_dead() -> None:
    pool = distnb.Pool(nproc=2, backend="gloo")
    pool.start()
    try:
        agent = pool.status().agent_pid
        os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(s.state.value == "dead" for s in pool.status().ranks):
            time.sleep(0.2)
        assert all(s.state.value == "dead" for s in pool.status().ranks), pool.status().text()
        assert pool.state == distnb.PoolState.BROKEN
        with pytest.raises(distnb.PoolBrokenError):
            pool.run("1")
    finally:
        pool.shutdown()
    assert pool.pids() == []
