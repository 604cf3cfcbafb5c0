"""The IPython magics in a real IPython shell, over a real 2-rank gloo pool."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from magic_shell import Shell

import distnb
from distnb.jobs import pools
from distnb.wire import codec

from conftest import wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def sh():
    shell = Shell()
    with shell.launched("-n 2 --backend gloo"):
        yield shell
    pids = shell.stopped_pids
    assert not wait_gone(pids, 10.0), f"pool processes survived the module's teardown: {pids}"


def test_wait_timeout_counts_from_the_call(sh: Shell, tmp_path) -> None:
    import threading
    import time

    go = tmp_path / "go"  # the cell ends once the wait has begun, however busy the machine
    out, _ = sh.cell("--bg", f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n'late'")
    assert "running in the background" in out
    time.sleep(3.5)  # the cell is older than the --timeout below: counted from the cell's start, it would be over
    release = threading.Timer(1.5, go.touch)  # well inside the wait, however slow the magic is to begin it
    release.start()
    try:
        _, out, _ = sh.line("dist_wait", "--timeout 3")
    finally:
        release.join()
        go.touch()
    assert "Out[ranks 0,1]: 'late'" in out and ": ok," in out, out


def test_timeout_names_running_ranks_then_pool_recovers(sh: Shell) -> None:
    out, err, failed = sh.failing("on_ranks", "--timeout 1 --hang-after 30", "import time\nif rank == 1:\n    time.sleep(20)")
    pool = distnb.current_pool()
    res = sh.ip.user_ns["_dist"]
    try:
        # The elapsed time is measured, not the timeout repeated: a loaded machine may say 1.1 s.
        assert re.search(r"rank 1 has timed out after 1\.\d s \(In\[\d+\]\)", err), err
        # It ended before the live watch spoke (--hang-after 30): the report still says why it runs.
        assert "[distnb] why rank 1 still runs: " in err and "time.sleep" in err and res.verdict is not None, err
        # The cell did not finish: Run All must not go on as if it had.
        assert re.fullmatch(rf"In\[{res.label}\] timed out: rank 1 still running after 1\.\d s", str(failed)), failed
    finally:  # rank 1 must not stay asleep: the tests after this one share the pool
        pool.interrupt([1])
        pool.wait(res, timeout=15)
    assert res[1].status == "interrupted"
    out, _ = sh.cell("", "rank")
    assert "Out[rank 0]: 0" in out and "Out[rank 1]: 1" in out


def test_huge_output_is_capped_with_a_note(sh: Shell) -> None:
    out, err = sh.cell("0", "for i in range(25_000):\n    print(i)")
    assert "[rank 0] 19999" in out and "[rank 0] 24999" not in out
    assert "5,000 more output lines were not shown" in out and "_dist" not in err


def test_push_pull_and_unknown_name(sh: Shell) -> None:
    sh.ip.user_ns["lr"] = 0.25
    sh.line("dist_push", "lr")
    value, _, _ = sh.line("dist_pull", "lr")
    assert value == {0: 0.25, 1: 0.25}
    with pytest.raises(UsageError, match="not defined in the notebook"):
        sh.line("dist_push", "no_such_name")
    with pytest.raises(UsageError, match="not defined on rank 0.*define it in an %%on_ranks cell first"):
        sh.line("dist_pull", "no_such_name")


def test_push_over_the_message_limit_says_what_to_do(sh: Shell, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 1 << 20)  # read when a push is packed (distnb/services/values.py)
    sh.ip.user_ns["too_big"] = b"x" * (2 << 20)
    with pytest.raises(UsageError, match=r"the push is 2\.0 MiB pickled \('too_big' 2\.0 MiB\), over distnb's limit of 1\.0 MiB.*torch\.save"):
        sh.line("dist_push", "too_big")
    assert not any(p.names == ("too_big",) for p in pools.current_pool().pushes)  # nothing recorded


def test_background_cell_and_wait(sh: Shell) -> None:
    out, _ = sh.cell("--bg", "import time\ntime.sleep(1.0)\nprint('bg done')")
    assert "running in the background" in out
    _, out, _ = sh.line("dist_wait", "--timeout 30")
    assert "bg done" in out and "ok" in out


def test_export_writes_a_script(sh: Shell, tmp_path) -> None:
    # The session's last failure is what the export ends with (and runs once to verify): an error
    # made here, not whatever the tests before left (a hang verifies for 30 s).
    sh.cell("--keep-going", "assert rank != 1, 'the case to export'")
    target = tmp_path / "case.py"
    _, out, _ = sh.line("dist_export", str(target))
    assert target.exists() and "torchrun --nproc-per-node 2" in out
    assert "the case to export" in target.read_text()


def test_regroup_magic_gives_a_working_group(sh: Shell) -> None:
    _, out, _ = sh.line("dist_regroup")
    assert "every rank has a fresh default process group (2 ranks)" in out
    out, err = sh.cell("", "rg = torch.ones(2) * (rank + 1); dist.all_reduce(rg); rg.tolist()")
    assert "[3.0, 3.0]" in out and not err, (out, err)


def test_restart_replay_magic_restores_state(sh: Shell) -> None:
    # Replay brings back the session since its launch, restarts or not: a launch of its own, so
    # that only this test's cells below are replayed.
    sh.line("dist_shutdown")
    sh.line("dist_launch", "-n 2 --backend gloo")
    first = sh.ip.execution_count  # the In[n] rp_a's cell runs as
    sh.cell("", "rp_a = 5")
    sh.ip.user_ns["rp_b"] = 7
    sh.line("dist_push", "rp_b")
    sh.cell("1", "rp_c = rp_a * 10")
    sh.failing("on_ranks", "", "raise RuntimeError('not replayed')")
    old = rank_pids()
    _, out, err = sh.line("dist_restart", "--replay")
    assert set(old).isdisjoint(rank_pids())
    assert f"replayed In[{first}] on ranks 0,1: ok  | rp_a = 5" in out, out  # a replay keeps the cell's In[n]
    assert re.search(r"replayed In\[\d+\] on rank 1: ok  \| rp_c = rp_a \* 10", out), out
    assert "not replayed" not in out + err
    assert distnb.current_pool().pull("rp_b") == {0: 7, 1: 7}
    assert distnb.current_pool().pull("rp_c", ranks="1") == {1: 50}


def rank_pids() -> list[int]:
    return [r.pid for r in distnb.current_pool().status().ranks]


def test_restart_gives_fresh_ranks(sh: Shell, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fresh ranks whose spare still imports torch can outlast RESPAWN_TIMEOUT on a loaded machine,
    # and the restart then falls back to a new torchrun (as designed): the launch's timeout here.
    from distnb.transport import startup

    monkeypatch.setattr(startup, "RESPAWN_TIMEOUT", distnb.LaunchConfig().start_timeout)
    sh.cell("", "marker = 1")
    old, agent = rank_pids(), distnb.current_pool().status().agent_pid
    _, out, _ = sh.line("dist_restart")
    assert "pool ready" in out and set(old).isdisjoint(rank_pids()) and distnb.current_pool().status().agent_pid == agent
    out, err, failed = sh.failing("on_ranks", "", "marker")
    assert "NameError" in err and "ranks 0,1: NameError: name 'marker' is not defined" in str(failed)
    old = distnb.current_pool().pids()  # torchrun, supervisors and ranks
    _, out, _ = sh.line("dist_restart", "--full")
    assert "pool ready" in out and set(old).isdisjoint(distnb.current_pool().pids())


def test_shutdown_then_cells_are_usage_errors(sh: Shell) -> None:
    pool = distnb.current_pool()
    _, out, _ = sh.line("dist_shutdown")
    assert "no process left" in out and pool.pids() == []
    with pytest.raises(UsageError, match="dist_launch"):
        sh.cell("", "1")
    sh.ip.user_ns["lr"] = 0.1
    for name, args in [("dist_status", ""), ("dist_stacks", ""), ("dist_pull", "x"), ("dist_push", "lr"), ("dist_env", ""),
                       ("dist_memory", ""), ("dist_collectives", ""), ("dist_check", "x"), ("dist_export", "/tmp/x.py"),
                       ("dist_wait", ""), ("dist_regroup", ""), ("dist_restart", ""), ("dist_shutdown", "")]:
        with pytest.raises(UsageError, match="dist_launch"):
            sh.line(name, args)
    # Bad --env is caught before anything starts.
    with pytest.raises(UsageError, match="KEY=VALUE"):
        sh.line("dist_launch", "-n 2 --env NOEQUALS")
    assert pools.current_or_none() is None
    # Relaunch for the unload test below, and check that unloading stops it.
    sh.line("dist_launch", "-n 2 --backend gloo")
    pool = distnb.current_pool()
    pids = pool.pids()
    assert len(pids) >= 5  # torchrun agent, and a supervisor and a rank process per rank
    sh.ip.run_line_magic("unload_ext", "distnb")
    assert pools.current_or_none() is None and pool.state == distnb.PoolState.STOPPED
    assert not wait_gone(pids, 5.0) and pool.pids() == []
    sh.ip.run_line_magic("load_ext", "distnb")
    with pytest.raises(UsageError, match="dist_launch"):
        sh.cell("", "1")


def test_timeline_and_profile_magics(sh, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the merged trace goes to ./distnb-traces/
    current = pools.current_or_none()
    if current is None or current.state != distnb.PoolState.READY:  # an earlier test shut it down
        sh.line("dist_launch", "-n 2 --backend gloo")
    # 100 ms late at each collective: beyond the noise of a loaded machine (25 ms was not, in test_desync_e2e).
    out, err = sh.cell("", "import time\ntl_x = torch.ones(4)\nfor _ in range(30):\n    if rank == 1:\n"
                           "        time.sleep(0.1)\n    dist.all_reduce(tl_x)")
    _, out, err = sh.line("dist_timeline", "--last 30 --no-plot")
    assert "rank 1 arrives last at" in out and "time waiting for peers" in out, out + err
    with pytest.raises(UsageError, match="positive"):
        sh.line("dist_timeline", "--last 0")
    with pytest.raises(UsageError, match="no collective recorded on group 'zz'"):
        sh.line("dist_timeline", "--group zz")
    out, err = sh.cell("--profile", "pr_y = torch.ones(8) @ torch.ones(8)\ndist.all_reduce(torch.ones(2))")
    assert re.search(r"profile of In\[\d+\] on ranks 0,1", out) and "compute (ms)" in out, out + err
    traces = list((tmp_path / "distnb-traces").glob("cell-*.json"))
    assert len(traces) == 1 and str(traces[0].name) in out


def test_a_long_healthy_cell_prints_nothing_of_distnbs_own(sh: Shell) -> None:
    # Nothing wrong, just long (past LONG_CELL and the hang threshold): printed text carries no
    # verdict or activity block; the widget view shows activity live and keeps none of it.
    out, err = sh.cell("--hang-after 1", "import time\ntime.sleep(8 if rank == 0 else 7.5)")
    assert "[distnb]" not in out + err and "still running" not in err and "not a hang" not in err, out + err
    assert out.startswith("memory: RSS peak"), out  # the cell's own report, nothing before it


def test_a_log_every_rank_writes_at_its_own_moment_is_printed_once(sh: Shell) -> None:
    # Rank 1 writes the same library warning a second after rank 0 (flushes apart, as ranks' logs
    # come): printed once, then one line for rank 1 (or, on a machine too busy to flush between,
    # once for both ranks together). The cell's result keeps each rank's text whole.
    code = ("import logging, sys, time\nif rank == 1:\n    time.sleep(1.0)\nlogging.basicConfig(stream=sys.stderr)\n"
            "logging.getLogger('lib').warning('a library warning\\nits second line\\nits third\\nits fourth')")
    out, err = sh.cell("", code)
    assert err.count("WARNING:lib:a library warning") == 1 and err.count("its fourth") == 1, err
    assert "[rank 1 stderr] (4 lines: the same as rank 0 printed above)" in err or "[ranks 0,1 stderr] its fourth" in err, err
    assert all(sh.ip.user_ns["_dist"][r].stderr.count("its fourth") == 1 for r in (0, 1))
