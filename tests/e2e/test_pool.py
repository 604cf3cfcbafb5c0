"""End-to-end tests on real torchrun pools (gloo on CPU).

Tests that leave the pool usable share the session's 4-rank pool (``pool``) and use variable
names unique to the test; tests that break, kill or restart a pool get their own (``fresh_pool``).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import distnb
from distnb import CellEvents, LaunchError, NoPoolError, PoolBrokenError, PoolBusyError, PoolState, RankState, RemoteError, _processes

from conftest import kill_pids, pool_processes, session_id, started_pids, track, wait_gone, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes

ALL = [0, 1, 2, 3]
#: How long a pool may outlive its killed controller: the parent-death signal path (measured 1-2 s),
#: with margin for a busy machine. The pool's heartbeat timeout is set far beyond it (300 s), so the
#: heartbeat's net can't be what ends them.
CONTROLLER_DEATH_CLEANUP_S = 60.0


# -- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_launch_and_shutdown_leave_no_process(fresh_pool):
    pool = fresh_pool(nproc=2)
    assert pool.state == PoolState.READY and distnb.current_pool() is pool
    assert repr(pool) == "<distnb.Pool ready, 2 ranks>"
    pids = pool.pids()
    assert len(pids) == 5, f"expected torchrun agent + 2 supervisors + 2 ranks, got {pids}"
    run_dir = pool._transport.launcher.run_dir
    assert os.path.isdir(run_dir)
    everything = pool_processes(pool)
    sessions = {session_id(p) for p in everything}
    assert all(_processes.pid_alive(p) for p in everything)

    pool.shutdown()
    assert pool.state == PoolState.STOPPED
    assert pool.pids() == []
    assert not os.path.exists(run_dir), "torchrun's log folder was left behind"
    assert wait_gone(everything, 0.5) == []
    in_sessions = [int(n) for n in os.listdir("/proc") if n.isdigit() and session_id(int(n)) in sessions and _processes.pid_alive(int(n))]
    assert in_sessions == [], f"processes left in the pool's sessions: {in_sessions}"
    with pytest.raises(NoPoolError, match="start one"):
        distnb.current_pool()
    with pytest.raises(NoPoolError):
        pool.run("1")
    pool.shutdown()  # idempotent


@pytest.mark.timeout(90)
def test_context_manager_and_progress(leak_check):
    seen: list[dict[int, RankState]] = []
    pool = track(distnb.Pool(nproc=1, backend="gloo"))
    pool.start(on_progress=seen.append)
    track(pool)
    with pool:
        assert pool.run("world_size, dist.get_world_size()").values == {0: "(1, 1)"}
        pids = pool.pids()
    assert pool.state == PoolState.STOPPED and wait_gone(pids, 0.5) == []
    assert seen and seen[0][0] in (RankState.LAUNCHED, RankState.STARTED) and seen[-1] == {0: RankState.IDLE}
    assert len(seen) >= 2  # progress is reported as the rank moves through its start-up stages


@pytest.mark.timeout(120)
def test_full_restart_gives_new_processes_and_a_fresh_namespace(fresh_pool):
    pool = fresh_pool(nproc=2)
    first = pool.run("rs_var = rank + 1\nrs_var")
    assert first.values == {0: "1", 1: "2"}
    old_pids = set(pool.pids())
    old_rank_pids = {r.pid for r in pool.status().ranks}

    pool.restart(full=True)
    track(pool)
    assert pool.state == PoolState.READY
    assert wait_gone(old_pids, 1.0) == []
    new_rank_pids = {r.pid for r in pool.status().ranks}
    assert not new_rank_pids & old_rank_pids and not set(pool.pids()) & old_pids
    res = pool.run("'rs_var' in globals()")
    assert res.values == {0: "False", 1: "False"}
    assert res.cell > first.cell  # cell numbers keep counting across restarts
    res = pool.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
    assert res.ok and res.values == {0: "3.0", 1: "3.0"}


# -- running cells --------------------------------------------------------------------------------


def test_all_reduce_on_every_rank(pool):
    res = pool.run("ar_t = torch.tensor([float(rank + 1)])\ndist.all_reduce(ar_t)\nar_t.item()")
    assert res.ok and res.ranks == ALL
    assert res.values == {r: "10.0" for r in ALL}
    assert str(res) == repr(res) == res.text()
    assert res.text().startswith(f"cell {res.cell} on ranks 0-3: ok, 4/4 done")
    assert "Out[ranks 0-3]: 10.0" in res.text()
    pulled = pool.pull("ar_t")
    assert sorted(pulled) == ALL and all(t.tolist() == [10.0] for t in pulled.values())
    res = pool.run("(dist.get_rank() == rank, dist.get_world_size(), world_size, local_rank == rank, str(device))")
    assert res.values == {r: "(True, 4, 4, True, 'cpu')" for r in ALL}


def test_rank_subsets(pool):
    res = pool.run("rank * 10", ranks="0,2")
    assert res.ranks == [0, 2] and sorted(res.results) == [0, 2]
    assert res.values == {0: "0", 2: "20"}
    assert "on ranks 0,2:" in res.header()
    res = pool.run("rank", ranks="1-3")
    assert res.values == {1: "1", 2: "2", 3: "3"}
    assert pool.run("rank", ranks=3).values == {3: "3"}
    assert pool.run("rank", ranks=[2, 0]).values == {0: "0", 2: "2"}
    # A subset can run its own collective on a new group that only it joins... but new_group is
    # collective over the world, so run it everywhere, then use it on the subset.
    pool.run("sub_g = dist.new_group([1, 3])")
    res = pool.run("sub_t = torch.tensor([float(rank)])\ndist.all_reduce(sub_t, group=sub_g)\nsub_t.item()", ranks="1,3")
    assert res.values == {1: "4.0", 3: "4.0"}
    before = len(pool.history)
    with pytest.raises(ValueError, match="out of range"):
        pool.run("1", ranks="9")
    with pytest.raises(ValueError, match="backwards"):
        pool.run("1", ranks="3-1")
    assert len(pool.history) == before


def test_namespace_persists_across_cells(pool):
    pool.run("pe_x = rank * 3\ndef pe_f(v):\n    return v + pe_x\nimport math as pe_math")
    assert pool.run("pe_f(1), pe_math.sqrt(16)").values == {r: f"({3 * r + 1}, 4.0)" for r in ALL}
    pool.run("pe_x += 1")
    assert pool.run("pe_x").values == {r: str(3 * r + 1) for r in ALL}
    assert pool.run("_ * 2").values == {r: str(2 * (3 * r + 1)) for r in ALL}  # IPython-like `_`
    # Only rank 2 changes; the others keep their own values.
    pool.run("pe_x = -1", ranks=2)
    assert pool.run("pe_x").values == {0: "1", 1: "4", 2: "-1", 3: "10"}


def test_last_expression_values_and_displays(pool):
    res = pool.run("lv = rank + 1\nlv * 2")
    assert res.values == {r: str(2 * (r + 1)) for r in ALL}
    assert pool.run("lv_y = 3").values == {r: None for r in ALL}
    assert pool.run("None").values == {r: None for r in ALL}
    assert pool.run("if True:\n    5").values == {r: None for r in ALL}
    res = pool.run("print('printed')\n'abc'")
    assert res.values == {r: "'abc'" for r in ALL} and res.stdout == {r: "printed\n" for r in ALL}
    res = pool.run(
        "class LvRich:\n"
        "    def _repr_html_(self):\n        return '<b>rich</b>'\n"
        "    def __repr__(self):\n        return 'LvRich()'\n"
        "LvRich()"
    )
    assert res[1].value == {"text/html": "<b>rich</b>", "text/plain": "LvRich()"}
    res = pool.run("display(f'shown {rank}')\n'after'")
    assert [d["text/plain"] for d in res[2].displays] == ["'shown 2'"]
    assert res[2].value_text == "'after'"


def test_a_silent_cell_ends_without_the_supervisor_and_nothing_else_does(pool):
    """A cell that wrote and displayed nothing sends its result straight to the notebook; any
    output (Python or fd level, stdout or stderr) or display keeps the ordered path through the
    supervisor, so the result never overtakes it."""

    cases = [
        ("dd_a = rank * 7", True, {}),
        ("dd_a + 1", True, {}),
        ("print('dd out', rank)", False, {"stdout": "dd out {r}\n"}),
        ("import sys\nprint('dd err', file=sys.stderr)", False, {"stderr": "dd err\n"}),
        ("import os\nos.write(1, b'dd raw')", False, {"stdout": "dd raw"}),
        ("display(rank)", False, {}),
    ]
    for code, silent, expected in cases:
        # A silent cell may still take the ordered path when its supervisor happened to read
        # something meanwhile (a heartbeat): that is the check erring on the safe side, so a silent
        # cell gets three tries. A cell with output must never go direct, on any try.
        for _ in range(3 if silent else 1):
            res = pool.run(code)
            assert res.ok, res.text()
            took_direct = {r: res[r].direct for r in ALL}
            if not silent or all(took_direct.values()):
                break
        assert took_direct == {r: silent for r in ALL}, (code, took_direct)
        for stream, text in expected.items():
            assert {r: getattr(res[r], stream) for r in ALL} == {r: text.format(r=r) for r in ALL}, (code, res.text())
    assert pool.run("dd_a").values == {r: str(7 * r) for r in ALL}


def test_a_chatty_session_keeps_a_bounded_amount_of_output(pool, monkeypatch):
    from distnb.controller import session

    monkeypatch.setattr(session, "KEEP_OUTPUT_BYTES", 1_000_000)
    chatty = [pool.run("print('y' * 99_999)") for _ in range(6)]  # 100,000 characters a rank, 400,000 a cell
    last = pool.run("1")
    assert all(r.ok for r in chatty) and last.ok
    held = pool._session.kept_output_bytes()
    assert 0 < held <= 1_000_000, held
    assert chatty[-1][3].stdout == "y" * 99_999 + "\n" and chatty[-1][3].released == 0  # the newest keep theirs
    oldest = chatty[0]
    assert oldest[0].stdout == "" and oldest[0].released == 100_000 and oldest.ok
    assert "this cell's output was let go" in oldest.text() and "rank 0: 100,000" in oldest.text()


def test_streaming_output_arrives_in_order_while_the_cell_runs(pool, tmp_path):
    arrivals: list[tuple[float, int, str, str]] = []
    lock = threading.Lock()

    def on_output(rank: int, stream: str, text: str) -> None:
        with lock:
            arrivals.append((time.monotonic(), rank, stream, text))

    go = tmp_path / "go"  # the ranks go on once every first line has arrived, however slow the machine
    code = (
        "import os, time\n"
        "print(f'first {rank}')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print(f'second {rank}')\n"
        "for st_i in range(50):\n"
        "    print(f'line {rank} {st_i}')\n"
    )
    res = pool.submit(code, events=CellEvents(on_output=on_output))
    try:
        wait_until(lambda: {a[1] for a in arrivals if "first" in a[3]} == set(ALL), 60, "the first line of every rank")
        assert res.running == ALL, "the cell finished before its first output arrived"
    finally:
        released = time.monotonic()
        go.touch()
    pool.wait(res, timeout=30)
    assert res.ok
    expected = {r: f"first {r}\nsecond {r}\n" + "".join(f"line {r} {i}\n" for i in range(50)) for r in ALL}
    for r in ALL:
        chunks = [a for a in arrivals if a[1] == r]
        assert all(stream == "stdout" for _, _, stream, _ in chunks)
        assert "".join(text for _, _, _, text in chunks) == expected[r]
        first_seen = next(t for t, _, _, text in chunks if f"first {r}" in text)
        assert first_seen < released and res[r].finished_at is not None and res[r].finished_at > released  # seen while it ran
    assert res.stdout == expected
    assert "[rank 0] first 0" in res.text() and "[rank 3] line 3 49" in res.text()


def test_fd_and_c_level_output_is_captured(pool, tmp_path):
    res = pool.run(
        "import os, ctypes\n"
        "os.write(1, b'fd-out %d\\n' % rank)\n"
        "os.write(2, b'fd-err %d\\n' % rank)\n"
        "fd_libc = ctypes.CDLL(None)\n"
        "fd_libc.printf(b'c-printf %d\\n', ctypes.c_int(rank))\n"
        "fd_libc.puts(b'c-puts')\n"
        "fd_libc.fflush(None)\n"
    )
    assert res.ok, res.text()
    for r in ALL:
        assert res[r].stdout.splitlines() == [f"fd-out {r}", f"c-printf {r}", "c-puts"]
        assert res[r].stderr == f"fd-err {r}\n"
    assert "[ranks 0-3 stderr] fd-err" not in res.text() and "[rank 1 stderr] fd-err 1" in res.text()
    # Without an explicit fflush, C output is not held back: it arrives while the cell still runs,
    # even without a newline (C's stdout is unbuffered on the ranks, as Python's is: no cell ends
    # with an fflush of its own).
    # The cell waits for the test's file, written once the output came (or after a minute).
    arrived: list[str] = []
    go = str(tmp_path / "go")
    result = pool.submit(f"import os, time\nfd_libc.printf(b'live from C')\nwhile not os.path.exists({go!r}):\n    time.sleep(0.01)",
                         ranks=[0], events=distnb.CellEvents(on_output=lambda rank, stream, text: arrived.append(text)))
    try:
        deadline = time.monotonic() + 60
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        running = result.running
    finally:
        open(go, "w").close()
    pool.wait(result, timeout=30)
    assert arrived and running == [0], f"the C output came {'after the cell ended' if arrived else 'not at all'}"
    assert result.stdout == {0: "live from C"}, result.text()
    res = pool.run("fd_libc.puts(b'buffered in C')")
    assert res.stdout == {r: "buffered in C\n" for r in ALL}


def test_traceback_shows_the_cell_line_and_no_distnb_frames(pool):
    code = "def tb_inner():\n    raise ValueError(f'bad value on {rank}')\n\ntb_x = 1\ntb_inner()\n"
    res = pool.run(code)
    assert not res.ok and res.failed == ALL
    text = res.text()
    for r in ALL:
        err = res[r].error
        assert res[r].status == "error" and err["ename"] == "ValueError"
        # The innermost cell line is reported: where the raise is, inside tb_inner.
        assert err["evalue"] == f"bad value on {r}" and err["line"] == 2
        tb = err["traceback"]
        assert "raise ValueError(f'bad value on {rank}')" in tb and "tb_inner()" in tb
        assert tb.rstrip().endswith(f"ValueError: bad value on {r}")
        assert "distnb/" not in tb and "distnb" not in tb.replace("<cell-", "")
        assert f"  rank {r}: bad value on {r}" in text
    # The same error up to its numbers: one group, one traceback, each rank's message under it.
    assert text.count("── ValueError on ranks 0-3 at cell line 2 ──") == 1 and text.count("Traceback") == 1
    assert "distnb/" not in text
    # An error on one rank only: the others succeed.
    res = pool.run("if rank == 2:\n    tb_missing_name\nrank")
    assert res.failed == [2] and res[2].error["ename"] == "NameError" and res[2].error["line"] == 2
    assert res.values == {0: "0", 1: "1", 2: None, 3: "3"}
    assert "NameError on rank 2 at cell line 2" in res.text()


def test_ranks_run_code_the_notebook_compiled_and_compile_what_they_cannot_load(pool, monkeypatch):
    """The EXEC carries the cell's code objects; a rank on another Python (here: a foreign tag)
    compiles the source itself, with the same result, names and line numbers."""
    from distnb.wire import cell_code

    code = "def cc_f():\n    return rank * 10\ncc_f()"
    assert pool.run(code).values == {r: str(r * 10) for r in ALL}
    monkeypatch.setattr(cell_code, "_TAG", b"distnb-code/\xff\xff\r\n")
    assert pool.run(code).values == {r: str(r * 10) for r in ALL}
    res = pool.run("def cc_g():\n    raise KeyError(rank)\ncc_g()")
    assert res.failed == ALL and res[0].error["line"] == 2 and "<cell-" in res[0].error["traceback"]


def test_system_exit_in_a_cell_keeps_the_rank(pool):
    res = pool.run("raise SystemExit(2)")
    assert res.failed == ALL and "the rank keeps running" in res[0].error["evalue"]
    assert pool.run("rank").values == {r: str(r) for r in ALL}


def test_syntax_error_is_raised_once_before_sending(pool):
    before = len(pool.history)
    with pytest.raises(SyntaxError):
        pool.run("se_x = (\n")
    with pytest.raises(SyntaxError):
        pool.submit("def :")
    assert len(pool.history) == before
    assert all(r.state == RankState.IDLE for r in pool.status().ranks)


def test_timeout_names_the_running_ranks(pool, tmp_path):
    # Ranks 1,2 wait for the test's file (written before the end), so the timeout finds them running.
    go = str(tmp_path / "go")
    res = pool.run(f"import os, time\nif rank in (1, 2):\n    while not os.path.exists({go!r}):\n        time.sleep(0.01)\nrank", timeout=5)
    try:
        assert res.timed_out and res.running == [1, 2]
        assert res[0].status == "ok" and res[3].status == "ok"
        text = res.text()
        assert "ranks 1,2" in text and "timed out" in text and "2/4 done" in text
        # While they run: status says so, a busy rank refuses new work, an idle one accepts it.
        st = {r.rank: r for r in pool.status().ranks}
        assert st[1].state == RankState.RUNNING and st[1].cell == res.cell and "running cell" in st[1].describe()
        assert st[0].state == RankState.IDLE
        with pytest.raises(PoolBusyError, match=r"ranks 1,2 are still running cell"):
            pool.run("1")
        with pytest.raises(PoolBusyError, match=r"rank 2 is still running"):
            pool.pull("rank", ranks=2)
        assert pool.run("rank", ranks="0,3").values == {0: "0", 3: "3"}
    finally:
        open(go, "w").close()  # never leave ranks 1,2 looping on the shared pool
    pool.wait(res, timeout=15)
    assert res.ok and res.running == [] and res.values == {r: str(r) for r in ALL}


@pytest.mark.timeout(60)
def test_interrupt_keeps_the_pool(pool):
    started: set[int] = set()
    events = CellEvents(on_output=lambda r, s, t: started.add(r) if "sleeping" in t else None)
    res = pool.submit("import time\nprint('sleeping')\ntime.sleep(30)\nprint('not reached')", events=events)
    wait_until(lambda: started == set(ALL), 10, "every rank to start sleeping")
    t0 = time.monotonic()
    assert sorted(pool.interrupt()) == ALL
    pool.wait(res, timeout=10)
    assert time.monotonic() - t0 < 5, "the interrupt did not stop the cell"
    for r in ALL:
        assert res[r].status == "interrupted"
        assert res[r].error["ename"] == "KeyboardInterrupt"
        assert "time.sleep(30)" in res[r].error["traceback"] and "distnb/" not in res[r].error["traceback"]
        assert "not reached" not in res[r].stdout
    assert res.failed == ALL
    assert pool.state == PoolState.READY
    assert all(r.state == RankState.IDLE for r in pool.status().ranks)
    assert pool.run("rank + 100").values == {r: str(r + 100) for r in ALL}
    assert pool.interrupt() == []  # nothing running: nothing to interrupt


@pytest.mark.timeout(60)
def test_interrupt_right_after_submit_is_not_lost(pool):
    # The interrupt may reach a rank before the cell does; it must still stop that cell.
    for _ in range(3):
        res = pool.submit("import time\ntime.sleep(20)")
        pool.interrupt()
        pool.wait(res, timeout=10)
        assert not res.running, "an interrupt sent right after submit was lost"
        assert {r.status for r in res.results.values()} == {"interrupted"}
    assert pool.run("rank").ok


def test_status_fields(pool):
    st = pool.status()
    assert st.state == "ready" and st.world_size == 4 and st.backend == "gloo"
    assert st.agent_pid in pool.pids() and st.address.startswith("tcp://127.0.0.1:")
    assert st.cells_run == len(pool.history)
    assert [r.rank for r in st.ranks] == ALL
    host = socket.gethostname()
    for r in st.ranks:
        assert isinstance(r.pid, int) and r.pid in pool.pids() and _processes.pid_alive(r.pid)
        assert r.host == host and r.device == "cpu" and r.local_rank == r.rank
        assert r.state == RankState.IDLE and r.describe() == "idle" and r.cell is None and r.returncode is None
    assert len({r.pid for r in st.ranks}) == 4
    assert pool.run("import os\nos.getpid()").values == {r.rank: str(r.pid) for r in st.ranks}
    text = st.text()
    assert text.startswith("pool ready: 4 ranks, backend gloo") and f"agent pid {st.agent_pid}" in text
    assert all(str(r.pid) in text for r in st.ranks)


def test_push_and_pull(pool):
    import torch

    pool.push(pp_lr=0.5, pp_cfg={"a": [1, 2]}, pp_t=torch.arange(3))
    assert pool.pull("pp_lr") == {r: 0.5 for r in ALL}
    assert pool.run("pp_lr * 2, pp_cfg['a'][1], pp_t.sum().item()").values == {r: "(1.0, 2, 3)" for r in ALL}
    pool.push(ranks="1,3", pp_only=7)
    assert pool.pull("pp_only", ranks="1,3") == {1: 7, 3: 7}
    with pytest.raises(RemoteError, match=r"'pp_only'.*rank 0"):
        pool.pull("pp_only", ranks=0)
    pool.run("pp_rank_t = torch.ones(2) * rank")
    pulled = pool.pull("pp_rank_t")
    assert {r: t.tolist() for r, t in pulled.items()} == {r: [float(r)] * 2 for r in ALL}


def test_push_unpicklable_value_names_the_variable(pool):
    with pytest.raises(ValueError, match=r"'pp_lock' can't be sent to the ranks"):
        pool.push(pp_fine=1, pp_lock=threading.Lock())
    with pytest.raises(ValueError, match=r"'pp_fn' can't be sent"):
        pool.push(pp_fn=lambda: 1)
    with pytest.raises(ValueError, match="at least one value"):
        pool.push()
    # Nothing of a refused push reaches the ranks.
    with pytest.raises(RemoteError, match="pp_fine"):
        pool.pull("pp_fine")


def test_pull_errors_name_the_variable(pool):
    with pytest.raises(RemoteError) as info:
        pool.pull("pp_never_defined")
    assert "'pp_never_defined'" in str(info.value) and "ranks 0-3" in str(info.value)
    pool.run("pp_rank_lock = __import__('threading').Lock()")
    with pytest.raises(RemoteError, match=r"'pp_rank_lock'.*can't be sent to the notebook"):
        pool.pull("pp_rank_lock", ranks=1)
    assert pool.run("rank", ranks=1).ok  # the pool is fine afterwards


# -- several pools, failures ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_pools_side_by_side(fresh_pool, tmp_path):
    a = fresh_pool(nproc=2)
    b = fresh_pool(nproc=2)
    assert distnb.current_pool() is b
    assert not set(a.pids()) & set(b.pids())
    assert a.status().address != b.status().address
    # Each rank stays in its cell until the test has seen every rank of both pools in theirs.
    go = str(tmp_path / "go")
    code = (f"import os, time\nsb_t = torch.tensor([float(rank + 1)])\ndist.all_reduce(sb_t)\nprint('in', flush=True)\n"
            f"while not os.path.exists({go!r}):\n    time.sleep(0.01)\nsb_t.item()")
    ra, rb = a.submit(code), b.submit(code)
    try:
        wait_until(lambda: all("in" in res.stdout for cell in (ra, rb) for res in cell.results.values()), 60, "every rank in its cell")
    finally:
        open(go, "w").close()
    a.wait(ra, timeout=30)
    b.wait(rb, timeout=30)
    assert ra.values == rb.values == {0: "3.0", 1: "3.0"}
    # Every rank of both pools was inside its cell at the same moment.
    spans = [(res.finished_at - res.duration, res.finished_at) for cell in (ra, rb) for res in cell.results.values()]
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"the two pools did not run at the same time: {spans}"
    a.run("sb_only_a = 1")
    assert b.run("'sb_only_a' in globals()").values == {0: "False", 1: "False"}
    a.shutdown()
    assert b.run("rank").ok  # shutting one down leaves the other alone


@pytest.mark.timeout(180)
def test_killed_controller_leaves_no_workers(leak_check):
    script = textwrap.dedent(
        """
        import json, time, distnb
        pool = distnb.launch(nproc=2, backend="gloo", heartbeat_timeout=300)
        res = pool.run("rank")
        assert res.ok, res
        print(json.dumps(pool.pids()), flush=True)
        time.sleep(300)
        """
    )
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        started_pids.add(proc.pid)
        pids: list[int] = []
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else b""
            if not line:
                proc.kill()
                proc.wait()
                err.seek(0)
                pytest.fail(f"the controller script did not start a pool:\n{err.read().decode(errors='replace')[-3000:]}")
            pids = json.loads(line)
            started_pids.update(pids)
            assert len(pids) == 5 and all(_processes.pid_alive(p) for p in pids)
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            # The kernel's parent-death signal starts the cleanup at once: torchrun gets SIGTERM,
            # stops its supervisors, each stops its rank (SIGTERM, SIGKILL after 1 s). Measured at
            # ~1-2 s on a loaded 2-core machine; the heartbeat timeout (300 s here) is only the safety
            # net, so a broken parent-death path fails this bound.
            survivors = wait_gone(pids, CONTROLLER_DEATH_CLEANUP_S)
            took = time.monotonic() - t0
            print(f"workers gone {took:.2f} s after the controller was killed")
            assert not survivors, f"workers {survivors} outlived their controller by {took:.1f} s"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            kill_pids(p for p in pids if _processes.pid_alive(p))


@pytest.mark.timeout(120)
def test_rank_death_breaks_the_pool_and_restart_recovers(fresh_pool):
    pool = fresh_pool(nproc=2, spares=True)
    res = pool.run("import os\nif rank == 1:\n    print('about to exit', flush=True)\n    os._exit(3)\nrank", timeout=30)
    assert not res.timed_out
    assert res[0].status == "ok" and res[0].value_text == "0"
    assert res[1].status == "dead" and res[1].returncode == 3
    assert "about to exit" in res[1].stdout
    assert res.failed == [1] and re.search(r"rank 1 died.*: exited with code 3", res.text())

    assert pool.state == PoolState.BROKEN
    st = pool.status()
    assert st.state == "broken"
    dead = st.ranks[1]
    assert dead.state == RankState.DEAD and dead.returncode == 3 and "exited with code 3" in dead.describe()
    assert st.ranks[0].state == RankState.IDLE
    with pytest.raises(PoolBrokenError) as info:
        pool.run("1")
    msg = str(info.value)
    assert "rank 1 died" in msg and "code 3" in msg and "restart" in msg
    with pytest.raises(PoolBrokenError):
        pool.push(x=1)
    with pytest.raises(PoolBrokenError):
        pool.pull("rank")

    # Restart from broken; then a SIGKILL mid-cell is reported as such.
    pool.restart()
    track(pool)
    assert pool.state == PoolState.READY and pool.run("rank").ok
    res = pool.run("import os, signal, time\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(0.5)\nrank", timeout=30)
    assert res[0].status == "dead" and res[0].returncode == -signal.SIGKILL
    assert res[1].status == "ok"
    assert re.search(r"rank 0 died.*: killed \(SIGKILL", res.text())
    assert pool.status().ranks[0].state == RankState.DEAD and pool.state == PoolState.BROKEN
    with pytest.raises(PoolBrokenError, match=r"rank 0 died \(killed \(SIGKILL.*restart"):
        pool.run("1")


@pytest.mark.timeout(90)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_fails_to_start_cleanly(leak_check):
    pool = distnb.Pool(nproc=2, backend="nccl")
    track(pool)
    with pytest.raises(LaunchError) as info:
        pool.start()
    track(pool)
    msg = str(info.value)
    assert "failed to start" in msg and ("rank 0" in msg or "rank 1" in msg)
    assert "nccl needs CUDA" in msg and "use --backend gloo" in msg
    assert pool.state == PoolState.STOPPED
    assert pool.pids() == []
    agent = pool.status().agent_pid
    assert agent is not None and not _processes.pid_alive(agent)
    with pytest.raises(NoPoolError):
        pool.run("1")
