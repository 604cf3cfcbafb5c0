"""LaunchConfig validates everything up front, with messages that say what to write instead."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

import distnb
from distnb.launch import LaunchConfig, Launcher, Rendezvous, default_nproc
from distnb.security import Credentials


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
    assert "--standalone" in cmd and "--rdzv-endpoint" not in cmd and env["DISTNB_NODE"] == "0"


def test_multi_node_command_joins_the_rendezvous():
    cfg = LaunchConfig(nproc=2, backend="gloo", nnodes=3)
    rdzv = Rendezvous("10.0.0.1:29400", "distnb-abc", store_here=False, local_addr=None, join_timeout=60)
    launcher = Launcher(cfg, "tcp://10.0.0.1:5555", Credentials(b"\x02" * 32), rdzv=rdzv, node=77)
    cmd = launcher.command()
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "3" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d" and cmd[cmd.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert cmd[cmd.index("--rdzv-id") + 1] == "distnb-abc"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=60,is_host=false"
    assert "--local-addr" not in cmd
    assert launcher.environment()["DISTNB_NODE"] == "77"
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
    ],
)
def test_multi_node_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(nproc=2, **kwargs)


def test_multi_node_config_defaults(monkeypatch):
    cfg = LaunchConfig(nproc=2, hosts=("localhost", "127.0.0.1"))
    assert cfg.nnodes == 3 and cfg.world_size == 6
    assert LaunchConfig(nproc=2, bind="0.0.0.0:6000").bind_port == 6000
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
