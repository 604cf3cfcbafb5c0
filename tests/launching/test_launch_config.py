"""LaunchConfig validates everything up front, with messages that say what to write instead."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import time

import pytest

import distnb
from distnb import _processes
from distnb.config import LaunchConfig, Rendezvous, default_nproc
from distnb.launching.torchrun import Launcher
from distnb.wire.security import Credentials


def test_defaults_and_coercion():
    cfg = LaunchConfig(nproc=3, backend="gloo", env={"NCCL_DEBUG": "INFO", "MY_N": 4}, pg_timeout=60, start_timeout=30)
    assert cfg.nproc == 3 and cfg.backend == "gloo"
    assert cfg.env == {"NCCL_DEBUG": "INFO", "MY_N": "4"}
    assert isinstance(cfg.pg_timeout, float) and cfg.pg_timeout == 60.0
    assert cfg.heartbeat_timeout == 15.0 and cfg.hang_after == 3.0
    for backend in ("auto", "nccl", "gloo"):
        assert LaunchConfig(nproc=1, backend=backend).backend == backend


def test_config_is_frozen_and_with_changes_revalidates():
    cfg = LaunchConfig(nproc=2, backend="gloo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nproc = 3  # type: ignore[misc]
    assert cfg.with_changes(nproc=4).nproc == 4 and cfg.nproc == 2
    with pytest.raises(ValueError, match="nproc"):
        cfg.with_changes(nproc=0)


@pytest.mark.parametrize("nproc", [0, -1, 1025, 2.5, "4", True, [2]])
def test_bad_nproc(nproc):
    with pytest.raises(ValueError, match=r"nproc must be a whole number of ranks from 1 to 1024, not"):
        LaunchConfig(nproc=nproc)


@pytest.mark.parametrize("nproc", [1, 1024])
def test_nproc_bounds_accepted(nproc):
    assert LaunchConfig(nproc=nproc).nproc == nproc


@pytest.mark.parametrize(
    "visible, expected",
    [("0,1,2", 3), ("3", 1), ("", 2), ("-1", 2), (" 0 , 1 ", 2)],
)
def test_default_nproc_follows_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert default_nproc() == expected
    assert LaunchConfig().nproc == expected


@pytest.mark.parametrize("backend", ["mpi", "NCCL", "", None, "ucc"])
def test_bad_backend(backend):
    with pytest.raises(ValueError) as info:
        LaunchConfig(nproc=2, backend=backend)
    msg = str(info.value)
    assert "backend must be one of auto, nccl, gloo" in msg and repr(backend) in msg


@pytest.mark.parametrize("name", ["1BAD", "A-B", "", "WITH SPACE", "é", 3, None, "X=Y"])
def test_bad_env_names(name):
    with pytest.raises(ValueError) as info:
        LaunchConfig(nproc=2, env={name: "1"})
    msg = str(info.value)
    assert f"environment variable name {name!r} is not valid" in msg and "letters, digits and underscores" in msg


@pytest.mark.parametrize(
    "name",
    ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"],
)
def test_reserved_env_names(name):
    with pytest.raises(ValueError, match=rf"^{name} is set by torchrun for every rank and can't be overridden with env\.$"):
        LaunchConfig(nproc=2, env={name: "0"})


@pytest.mark.parametrize("field", ["pg_timeout", "start_timeout", "hang_after", "heartbeat_timeout"])
@pytest.mark.parametrize("value", [0, -1, -0.5, math.nan, "10", None, True])
def test_non_positive_or_non_numeric_timeouts(field, value):
    with pytest.raises(ValueError) as info:
        LaunchConfig(nproc=2, **{field: value})
    assert str(info.value) == f"{field} must be a positive number of seconds, not {value!r}."


def test_pool_takes_a_config_or_keywords_not_both():
    cfg = LaunchConfig(nproc=2, backend="gloo")
    pool = distnb.Pool(cfg)
    assert pool.config is cfg and pool.world_size == 2 and pool.state == distnb.PoolState.NEW
    assert distnb.Pool(nproc=3, backend="gloo").config.nproc == 3
    with pytest.raises(TypeError, match="not both"):
        distnb.Pool(cfg, nproc=2)
    with pytest.raises(ValueError, match="nproc"):
        distnb.Pool(nproc=0)


def test_launcher_command_and_environment(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    # User env is applied first, so it can't override distnb's own variables.
    cfg = LaunchConfig(nproc=3, backend="gloo", env={"NCCL_DEBUG": "INFO", "DISTNB_BACKEND": "nccl"}, pg_timeout=42)
    launcher = Launcher(cfg, "tcp://127.0.0.1:5555", Credentials(b"\x01" * 32))
    cmd = launcher.command()
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3"
    assert cmd[-2:] == ["-m", "distnb.worker"] and "--max-restarts" in cmd
    env = launcher.environment()
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["DISTNB_BACKEND"] == "gloo"
    assert env["DISTNB_ADDR"] == "tcp://127.0.0.1:5555"
    assert env["DISTNB_KEY"] == "01" * 32 and "DISTNB_TOKEN" not in env
    assert float(env["DISTNB_PG_TIMEOUT"]) == 42.0 and float(env["DISTNB_HEARTBEAT_TIMEOUT"]) == 15.0
    assert env["PYTHONPATH"].endswith(":/somewhere") and env["PYTHONPATH"].split(":")[0]
    assert cmd[cmd.index("--log-dir") + 1] == launcher.run_dir
    assert launcher.pid is None and launcher.returncode() is None and launcher.stop() == []
    assert not os.path.exists(launcher.run_dir)  # no temp folder left behind
    assert "--standalone" in cmd and "--rdzv-endpoint" not in cmd and env["DISTNB_AGENT"] == "0"


def test_multi_node_command_joins_the_rendezvous():
    cfg = LaunchConfig(nproc=2, backend="gloo", nnodes=3)
    rdzv = Rendezvous("10.0.0.1:29400", "distnb-abc", store_here=False, local_addr=None, join_timeout=60)
    launcher = Launcher(cfg, "tcp://10.0.0.1:5555", Credentials(b"\x02" * 32), rdzv=rdzv, agent=77)
    cmd = launcher.command()
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "3" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d" and cmd[cmd.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert cmd[cmd.index("--rdzv-id") + 1] == "distnb-abc"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=60,is_host=false"
    assert "--local-addr" not in cmd
    assert launcher.environment()["DISTNB_AGENT"] == "77"
    launcher.stop()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nnodes=0), "nnodes must be"),
        (dict(hosts=("node2",)), "can't reach 127.0.0.1"),
        (dict(hosts=("localhost",), nnodes=3), "give 2 host"),
        (dict(rdzv_endpoint="node1:29400"), "more than one node"),
        (dict(nnodes=2, rdzv_endpoint="node1"), "needs a port"),
        (dict(nnodes=2, rdzv_endpoint=":29400"), "names no host"),
        (dict(bind="0.0.0.0:70000"), "needs a port"),
        (dict(hosts=("a",), slurm=True, bind="0.0.0.0"), "not both"),
        (dict(local_nodes=True), "give nnodes of 2 or more"),
        (dict(local_nodes=True, nnodes=2, hosts=("localhost",)), "drop hosts/slurm"),
        (dict(local_nodes=True, nnodes=2, backend="nccl"), "NCCL refuses two ranks on one GPU"),
    ],
)
def test_multi_node_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(nproc=2, **kwargs)


def test_multi_node_config_defaults(monkeypatch):
    cfg = LaunchConfig(nproc=2, hosts=("localhost", "127.0.0.1"))
    assert cfg.nnodes == 3 and cfg.world_size == 6
    assert LaunchConfig(nproc=2, bind="0.0.0.0:6000").bind_port == 6000
    local = LaunchConfig(nproc=2, nnodes=3, local_nodes=True)
    assert local.backend == "gloo" and local.world_size == 6 and local.bind == "127.0.0.1"
    from distnb.launching.remote_nodes import NodeStarters

    commands = NodeStarters.local_commands(local, "tcp://127.0.0.1:5555")
    assert len(commands) == 2 and commands[0][1:] == ["-m", "distnb.node", "--connect", "tcp://127.0.0.1:5555", "--key-file", "-"]
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="Slurm allocation"):
        LaunchConfig(nproc=2, slurm=True, bind="0.0.0.0")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    assert LaunchConfig(nproc=2, slurm=True, bind="0.0.0.0").nnodes == 4


def test_unstarted_pool_is_inert():
    pool = distnb.Pool(nproc=2, backend="gloo")
    assert pool.pids() == []
    pool.shutdown()  # no-op
    assert pool.state == distnb.PoolState.NEW
    with pytest.raises(distnb.NoPoolError, match="start one"):
        pool.run("1")


# -- stopping by PID, never a stranger that got a dead process's number -------------------------


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, **kwargs)


def _finish(*procs: subprocess.Popen, pids: tuple[int, ...] = ()) -> None:
    """Cleanup of what the test started, by PID (never by name)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
    for pid in pids:
        if _processes.pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_start_time_names_one_process():
    proc = _sleeper()
    try:
        started = _processes.start_time(proc.pid)
        # Independently: clock ticks since boot, so boot time + start time is about now.
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        assert abs(boot + started / os.sysconf("SC_CLK_TCK") - time.time()) < 5, started
        assert _processes.start_time(proc.pid) == started  # stable
        assert _processes.same_process(proc.pid, started)
        assert not _processes.same_process(proc.pid, started - 1) and not _processes.same_process(proc.pid, None)
        proc.kill()
        deadline = time.monotonic() + 5
        while _processes.same_process(proc.pid, started) and time.monotonic() < deadline:
            time.sleep(0.01)  # a zombie until reaped: no longer "the same running process"
        assert not _processes.same_process(proc.pid, started)
        proc.wait(5)
        assert _processes.start_time(proc.pid) is None
        assert not _processes.signal_process(proc.pid, started, signal.SIGTERM)  # gone: nothing sent
    finally:
        _finish(proc)


@pytest.mark.timeout(30)
def test_signal_process_checks_the_start_time_first():
    proc = _sleeper()
    try:
        started = _processes.start_time(proc.pid)
        # The number now names "another" process (a wrong start time stands in for PID reuse).
        assert not _processes.signal_process(proc.pid, started + 1, signal.SIGKILL)
        assert not _processes.signal_process(proc.pid, None, signal.SIGKILL)
        time.sleep(0.1)
        assert proc.poll() is None, "a process with a different start time was signalled"
        assert _processes.signal_process(proc.pid, started, signal.SIGTERM)
        assert proc.wait(5) == -signal.SIGTERM
    finally:
        _finish(proc)


@pytest.mark.timeout(30)
def test_known_processes_keep_the_first_start_time_and_act_like_a_set():
    a, b = _sleeper(), _sleeper()
    try:
        known = _processes.KnownProcesses()
        known.add(a.pid)
        known |= {b.pid}  # how the pool adds its node starters' PIDs
        assert set(known) == {a.pid, b.pid} and len(known) == 2 and a.pid in known
        assert known.started(a.pid) == _processes.start_time(a.pid)
        known.add(a.pid)  # a second sighting does not overwrite the first
        assert known.started(a.pid) == _processes.start_time(a.pid)
        assert known.alive() == sorted([a.pid, b.pid]) and known.is_alive(b.pid)
        b.kill()
        b.wait(5)
        assert known.alive() == [a.pid] and not known.is_alive(b.pid)
        known.add(999_999_999)  # never existed: recorded without a start time, never alive
        assert known.started(999_999_999) is None and not known.is_alive(999_999_999)
    finally:
        _finish(a, b)


@pytest.mark.timeout(60)
def test_stop_never_signals_a_reused_pid():
    """Launcher.stop() signals every process it knows plus their sessions; a PID whose number now
    belongs to someone else (after the original was reaped) must be left alone."""
    launcher = Launcher(LaunchConfig(nproc=1, backend="gloo"), "tcp://127.0.0.1:1", Credentials(b"\x03" * 32))
    # The "agent": its own session with a child in it, like torchrun and its workers.
    agent = subprocess.Popen(["sh", "-c", "sleep 30 & exec sleep 30"], start_new_session=True, stdin=subprocess.DEVNULL)
    # A rank whose session leader is already gone: its survivors are still ours.
    leader = subprocess.Popen(["sh", "-c", "sleep 30 & exit 0"], start_new_session=True, stdin=subprocess.DEVNULL)
    ours = _sleeper(start_new_session=True)  # e.g. a supervisor, known with its real start time
    stranger = _sleeper()  # not ours, but it holds a number the pool once knew
    orphans: list[int] = []
    try:
        launcher.proc = agent
        launcher.known_pids.add(agent.pid)
        launcher.known_pids.add(leader.pid)
        launcher.known_pids.add(ours.pid)
        launcher.known_pids.add(stranger.pid, started=_processes.start_time(stranger.pid) - 7)
        deadline = time.monotonic() + 5
        while not (_processes.descendants(agent.pid) and _processes.session_pids(leader.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        agent_child = _processes.descendants(agent.pid)
        leader.wait(5)  # reaped: its survivor lives on in the session it led
        orphans = [p for p in _processes.session_pids(leader.pid) if p != leader.pid]
        assert len(agent_child) == 1 and len(orphans) == 1
        found = launcher._pool_pids()
        assert set(found) == {agent.pid, *agent_child, *orphans, ours.pid}, found
        assert stranger.pid not in found

        assert launcher.stop(grace=0) == []
        assert agent.poll() is not None and ours.wait(5) == -signal.SIGTERM
        assert not any(_processes.pid_alive(p) for p in agent_child + orphans)
        assert stranger.poll() is None, "stop() signalled a process that merely reused a known PID"
        assert not os.path.exists(launcher.run_dir)
    finally:
        _finish(agent, leader, ours, stranger, pids=tuple(orphans))
        launcher.stop(grace=0)
