"""``python -m distnb run --watch`` (issue 48, item 2): a real 4-rank torchrun job watched by the
wrapper that started it. Hung by a rank that left its loop early, the job's log carries the verdict,
its records folder the verdict's files and a reproduce notebook, and ``--on-hang stop`` ends it;
a healthy job whose rank 0 keeps the others waiting well past the threshold (a long checkpoint
save) runs to its end untouched. Every process of each job is checked gone, and killed by PID if not."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from attachable_jobs import LOOP_EXIT, AttachableJob

from conftest import wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOW_SAVE = """import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(5):
    dist.all_reduce(t)
if rank == 0:
    time.sleep(8)  # a checkpoint save: the others wait in the all_reduce below, 8x the threshold
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
"""

MARK = "DISTNB_WATCH_TEST"
#: The job's start on two busy cores (4 ranks importing torch), then the verdict and torchrun's stop.
JOB_BOUND = 240


def _run(tmp_path: Path, script: str, code: str, *run_args: str) -> tuple[int, str, AttachableJob]:
    (tmp_path / script).write_text(code)
    log = tmp_path / "job.log"
    with log.open("w") as err:
        job = AttachableJob(tmp_path, script, 4, MARK, env={"DISTNB_JOBS_DIR": str(tmp_path / "jobs")}, stderr=err, run_args=run_args)
    try:
        try:
            rc = job.proc.wait(timeout=JOB_BOUND)
        except subprocess.TimeoutExpired:
            readings = tmp_path / "jobs" / job.job_id / "records" / "watch.log"
            raise AssertionError(f"the job still ran after {JOB_BOUND} s; its log:\n{log.read_text()[-6000:]}\nthe watch's readings:\n"
                                 f"{readings.read_text()[-6000:] if readings.exists() else '(none)'}") from None
        assert not wait_gone(job.processes(), 15), "the job's processes outlived its command"
    finally:
        left = job.kill()
    assert not left, left
    return rc, log.read_text(), job


def test_a_hung_job_is_said_in_its_log_dumped_and_stopped(tmp_path: Path) -> None:
    rc, log, job = _run(tmp_path, "loop_exit.py", LOOP_EXIT, "--watch", "--on-hang", "stop")
    assert rc != 0, log  # ended by the watch, not by itself
    assert "[distnb watch] watching job" in log, log
    assert "[distnb watch] [distnb] ranks are in different collectives" in log and "The odd one out: rank 2." in log, log
    assert "[distnb watch] stopping the job: SIGTERM" in log, log
    records = tmp_path / "jobs" / job.job_id / "records"
    verdict = json.loads((records / "verdict.json").read_text())
    assert verdict["culprits"] == [2] and verdict["state"] == "hang" and verdict["kind"] == "mismatch", verdict
    assert "rank 2: waiting in barrier" in (records / "verdict.txt").read_text()
    assert "loop_exit.py:10" in (records / "stacks.txt").read_text()
    assert "first divergence" in (records / "collectives.txt").read_text()
    assert (records / f"{job.job_id}-repro.ipynb").exists()
    assert "hang mismatch culprits=[2] (proven" in (records / "watch.log").read_text()


def test_a_rank_that_keeps_the_others_waiting_is_not_stopped(tmp_path: Path) -> None:
    rc, log, job = _run(tmp_path, "slow_save.py", SLOW_SAVE, "--watch", "--on-hang", "stop", "--hang-after", "1")
    assert rc == 0, log
    assert "[distnb watch] watching job" in log and "stopping the job" not in log and "found" not in log, log
    assert not (tmp_path / "jobs" / job.job_id / "records" / "verdict.json").exists()
