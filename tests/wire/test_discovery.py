"""The discovery files of attachable jobs (issue 40): where a rank listens, its key, stale files."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from distnb.wire.discovery import RankEndpoint, job_id_from_env, list_jobs, read_endpoint, write_endpoint

GONE_PID = 2**30  # above any pid_max: no such process


def endpoint(job: str = "j1", rank: int = 0, pid: int | None = None, world: int = 2) -> RankEndpoint:
    return RankEndpoint(job, rank, world, os.getpid() if pid is None else pid, "127.0.0.1", 40000 + rank, bytes(range(32)), time.time(),
                        argv=("train.py", "--lr", "0.1"), cwd="/work/exp")


def test_job_id_prefers_distnb_then_slurm_then_torchrun_then_the_port() -> None:
    assert job_id_from_env({"DISTNB_JOB_ID": "run-ab12", "SLURM_JOB_ID": "7"}) == "run-ab12"
    assert job_id_from_env({"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-7"
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "exp/1"}) == "torchrun-exp_1"  # never a path
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "29500"}) == "port-29500"


def test_a_file_round_trips_private(tmp_path: Path) -> None:
    path = write_endpoint(endpoint(), tmp_path)
    assert path == str(tmp_path / "j1" / "rank0.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(tmp_path / "j1").st_mode) == 0o700
    back = read_endpoint(path)
    assert back.key == bytes(range(32)) and back.address == "tcp://127.0.0.1:40000" and back.path == path
    assert back.argv == ("train.py", "--lr", "0.1") and back.cwd == "/work/exp"
    assert back.alive()


def test_a_file_that_is_not_one_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "rank0.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="is not a distnb discovery file"):
        read_endpoint(bad)


def test_listing_tells_live_ranks_from_stale_ones(tmp_path: Path) -> None:
    write_endpoint(endpoint("live", 0), tmp_path)
    write_endpoint(endpoint("live", 1, pid=GONE_PID), tmp_path)
    write_endpoint(endpoint("dead", 0, pid=GONE_PID), tmp_path)
    (tmp_path / "dead" / "rank1.json").write_text("garbage")  # skipped, not fatal
    jobs = {j.job: j for j in list_jobs(tmp_path)}
    assert set(jobs["live"].ranks) == {0} and set(jobs["live"].stale) == {1}
    assert not jobs["dead"].ranks and set(jobs["dead"].stale) == {0}
    assert jobs["live"].line() == f"live: 1/2 ranks alive, 1 stale (pids {os.getpid()})"
    assert list_jobs(tmp_path / "nowhere") == []


def test_a_folder_shared_by_machines_lists_only_this_machines_files(tmp_path: Path) -> None:
    """DISTNB_JOBS_DIR on a shared home: each machine's ranks write there; a file another machine
    wrote is listed on that machine (its pid means nothing here: alive or gone by chance)."""
    import socket
    from dataclasses import replace

    here = socket.gethostname()
    write_endpoint(replace(endpoint("shared", 0), node=here), tmp_path)
    write_endpoint(replace(endpoint("shared", 1), node=f"{here}-other"), tmp_path)  # our pid, alive here: still not ours
    write_endpoint(replace(endpoint("shared", 2, pid=GONE_PID), node=f"{here}-other"), tmp_path)  # not stale here either
    write_endpoint(endpoint("older", 0), tmp_path)  # written before the node was recorded: this machine's
    jobs = {j.job: j for j in list_jobs(tmp_path)}
    assert set(jobs["shared"].ranks) == {0} and not jobs["shared"].stale
    assert set(jobs["older"].ranks) == {0}
    assert read_endpoint(tmp_path / "shared" / "rank1.json").node == f"{here}-other"


def test_the_listing_for_another_machine_round_trips_and_names_where_it_came_from(tmp_path: Path) -> None:
    from dataclasses import replace

    from distnb.wire.discovery import jobs_from_json, jobs_json

    write_endpoint(replace(endpoint(rank=0), host="*", creds='{"key": "00"}'), tmp_path)
    write_endpoint(endpoint(rank=1), tmp_path)
    [back] = jobs_from_json(jobs_json(list_jobs(tmp_path)), "10.1.2.3")
    assert sorted(back.ranks) == [0, 1] and back.folder.startswith("10.1.2.3:")
    assert back.ranks[0].host == "10.1.2.3" and back.ranks[1].host == "127.0.0.1"  # bound everywhere: the machine's address
    assert back.ranks[0].machine == "10.1.2.3" and back.ranks[0].creds == '{"key": "00"}' and back.ranks[0].alive()
    with pytest.raises(ValueError, match="the listing from 10.1.2.3 is not distnb's"):
        jobs_from_json('{"jobs": [{"job": 1}]}', "10.1.2.3")
