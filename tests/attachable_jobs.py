"""A torchrun job the test starts, made attachable by ``python -m distnb run`` (issue 40's tests),
and its end: every process of it found by a token in its environment and killed by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

import pytest

from distnb.wire.discovery import list_jobs

from conftest import marked_processes, started_pids, wait_gone, wait_until

__all__ = ["LOOP_EXIT", "AttachableJob", "plain_job", "running_job"]

REPO = str(Path(__file__).resolve().parents[1])

#: A job hung by a rank that leaves its loop early: rank 2 waits in the barrier (line 11), the
#: others in their 4th all_reduce (line 10).
LOOP_EXIT = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(1000):
    if rank == 2 and step == 3:
        break  # rank 2 leaves the loop early
    dist.all_reduce(t)
dist.barrier()
"""


class AttachableJob:
    """``python -m distnb run -- torchrun --nproc-per-node N SCRIPT`` in ``folder``, marked with
    ``mark`` = a fresh token: torchrun starts each rank in a session of its own, so only the token
    finds them all. ``env`` is added to the test's environment; ``stderr`` is where the job's goes;
    ``run_args`` go to ``python -m distnb run`` (``--watch`` …)."""

    def __init__(self, folder: Path, script: str, nproc: int, mark: str, env: dict[str, str] | None = None,
                 stderr: int | IO[Any] = subprocess.DEVNULL, standalone: bool = False, job_id: str | None = None,
                 run_args: tuple[str, ...] = ()) -> None:
        self.folder, self.mark, self.token = folder, mark, uuid.uuid4().hex
        self.job_id = job_id or f"test-{uuid.uuid4().hex[:6]}"
        full = {**os.environ, **(env or {}), mark: self.token,
                "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
        torchrun = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
                    "--nproc-per-node", str(nproc), "--monitor-interval", "1", script]
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            [sys.executable, "-m", "distnb", "run", "--job-id", self.job_id, *run_args, "--", *torchrun], cwd=folder, env=full,
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr, text=True)

    def processes(self) -> set[int]:
        """The wrapper, torchrun and the ranks: every live process carrying the job's token."""
        return marked_processes(self.mark, self.token)

    def kill(self) -> list[int]:
        """Kill every process of the job by PID (the wrapper first); those still alive 10 s later."""
        pids = self.processes()
        started_pids.update(pids)
        for pid in sorted(pids, key=lambda p: p != self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)
        return wait_gone(pids, 10)


@contextlib.contextmanager
def running_job(folder: Path, script: str, nproc: int, mark: str, env: dict[str, str] | None = None, stderr: Path | None = None,
                standalone: bool = False) -> Iterator[AttachableJob]:
    """The job started and its ``nproc`` discovery files published, with DISTNB_JOBS_DIR set to
    ``folder/jobs`` in this process too (the tests attach from it); killed by PID at the end, every
    process of it gone. ``stderr``: a file for the job's own."""
    jobs_dir = pytest.MonkeyPatch()
    jobs_dir.setenv("DISTNB_JOBS_DIR", str(folder / "jobs"))
    with stderr.open("w") if stderr is not None else contextlib.nullcontext(subprocess.DEVNULL) as err:
        job = AttachableJob(folder, script, nproc, mark, env, stderr=err, standalone=standalone)
    try:
        wait_until(lambda: any(len(f.ranks) == nproc for f in list_jobs()), 120, f"the job's {nproc} discovery files")
        started_pids.update(job.processes())
        yield job
    finally:
        left = job.kill()
        jobs_dir.undo()
        assert not left, f"the job's processes outlived the test: {left}"


@contextlib.contextmanager
def plain_job(folder: Path, script: str, nproc: int, mark: str, ready: int | None = None) -> Iterator[AttachableJob]:
    """``torchrun --nproc-per-node N SCRIPT`` with nothing of distnb anywhere in its environment (no
    wrapper, no hook, no distnb on its path): a job as users start theirs. Found by ``mark``'s
    token and killed by PID at the end, as :func:`running_job`'s. Yields once ``ready`` (default
    ``nproc``) ranks have started."""
    job = AttachableJob.__new__(AttachableJob)
    job.folder, job.mark, job.token, job.job_id = folder, mark, uuid.uuid4().hex, ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTNB_") and k != "PYTHONPATH"}
    env[mark] = job.token
    job.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval", "1",
                                 script], cwd=folder, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: len(job.processes()) > (ready if ready is not None else nproc), 120, f"torchrun and its {nproc} ranks")
        started_pids.update(job.processes())
        yield job
    finally:
        left = job.kill()
        assert not left, f"the job's processes outlived the test: {left}"
