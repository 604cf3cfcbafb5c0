"""Attach to a torchrun job with no preparation (issue 48): the test starts plain ``torchrun`` jobs
— nothing of distnb in their environment, no wrapper, no hook — hung the ways jobs hang, finds
them by a process of theirs, and reads them from outside (py-spy, /proc): the culprit named,
"likely" said and why; a healthy job is not called hung. Every job is killed by PID."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
from attachable_jobs import LOOP_EXIT, AttachableJob, plain_job

import distnb
from distnb.analysis.verdicts.verdict import Certainty, VerdictState
from distnb.jobs.bare import BareJob
from distnb.launching.bare_jobs import find_bare_jobs
from distnb.services.native_stacks import py_spy_path

from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHAPES = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(8 if rank == 1 else 4)  # rank 1's buffer is another size
dist.all_reduce(t)
dist.barrier()
"""

HEALTHY = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(64, 64)
for step in range(10**9):
    loss = model(torch.randn(16, 64)).sum()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
"""

MARK = "DISTNB_BARE_TEST"


@pytest.fixture(autouse=True)
def _needs_py_spy() -> None:
    if py_spy_path() is None:
        pytest.skip("py-spy is not installed (pip install distnb[native]); the test extra installs it")


@contextlib.contextmanager
def _job(tmp_path: Path, name: str, code: str) -> Iterator[AttachableJob]:
    (tmp_path / name).write_text(code)
    with plain_job(tmp_path, name, 4, MARK) as job:
        yield job


@pytest.fixture(scope="module")
def loop_exit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AttachableJob]:
    """One hung job for the tests that only read it (a job's start is most of a test's time)."""
    if py_spy_path() is None:
        pytest.skip("py-spy is not installed (pip install distnb[native]); the test extra installs it")
    with _job(tmp_path_factory.mktemp("loop_exit"), "loop_exit.py", LOOP_EXIT) as job:
        yield job


def _settled(job: AttachableJob, culprit: int) -> distnb.Verdict:
    """The job's verdict once its ranks are where they hang (they import torch and meet first)."""
    found: list[distnb.Verdict] = []

    def named() -> bool:
        attached = distnb.attach(pid=job.proc.pid)
        assert isinstance(attached, BareJob), attached
        try:
            found.append(attached.diagnose())
        finally:
            attached.detach()
        return found[-1].culprits == [culprit]

    # Each look takes ~1 s; the job takes up to a minute to start on two busy cores.
    wait_until(named, 150, f"the verdict naming rank {culprit}", poll=0.5)
    return found[-1]


def test_a_rank_that_left_its_loop_is_named_from_outside(loop_exit: AttachableJob, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _settled(loop_exit, 2)
    assert verdict.state is VerdictState.HANG and verdict.certainty is Certainty.LIKELY
    text = verdict.text()
    assert "rank 2" in text and "loop_exit.py:10" in text and "loop_exit.py:11 (dist.barrier())" in text, text
    assert "likely, from the ranks' stacks alone" in text, text
    # Found with no argument too (the one job there is: another test's torchrun beside this one is
    # left out of the real discovery), by its name, and by a rank's pid.
    from distnb.jobs import attached

    monkeypatch.setattr(attached, "find_bare_jobs", lambda: [j for j in find_bare_jobs() if j.agent == loop_exit.proc.pid])
    by_rank = next(p for p in loop_exit.processes() if p != loop_exit.proc.pid and _is_rank(p))
    for how in ({}, {"job": f"torchrun-{loop_exit.proc.pid}"}, {"pid": by_rank}):
        with _attached(**how) as job:
            assert job.job == f"torchrun-{loop_exit.proc.pid}" and len(job.pids()) == 4
    with _attached(pid=loop_exit.proc.pid) as job:
        stacks = job.stacks().text()
        assert "loop_exit.py:10 in <module>: dist.all_reduce(t)" in stacks and "[py-spy]" in stacks, stacks
        status = job.status().text()
        assert "not started with distnb" in status and "rank 2" in status, status
        assert job.env().env[3]["RANK"] == "3"
        assert all(s["rss"] > 0 for s in job.memory().current.values())
        with pytest.raises(distnb.AttachError, match="not started with distnb"):
            job.collectives()


def test_a_mismatched_shape_names_the_rank_left_in_the_call(tmp_path: Path) -> None:
    with _job(tmp_path, "shapes.py", SHAPES) as job:
        verdict = _settled(job, 1)
        assert verdict.state is VerdictState.HANG and "all_reduce" in verdict.text(), verdict.text()


def test_a_healthy_job_is_not_called_hung(tmp_path: Path) -> None:
    with _job(tmp_path, "healthy.py", HEALTHY) as job:
        wait_until(lambda: _in_loop(job), 150, "every rank in its training loop", poll=0.5)
        for _ in range(3):
            with _attached(pid=job.proc.pid) as attached:
                verdict = attached.diagnose()
            assert not verdict.is_problem, verdict.text()


def test_magics_attach_by_pid_and_say_what_needs_records(loop_exit: AttachableJob, monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.core.error import UsageError
    from magic_shell import Shell

    from distnb.jobs import pools

    monkeypatch.setattr(pools, "_current", None)
    _settled(loop_exit, 2)
    shell = Shell()
    value, _, _ = shell.line("dist_attach", f"--pid {loop_exit.proc.pid}")
    try:
        assert f"attached to job torchrun-{loop_exit.proc.pid} from outside" in repr(value), repr(value)
        value, _, _ = shell.line("dist_stacks")
        assert "dist.barrier()" in repr(value), repr(value)
        with pytest.raises(UsageError, match="not started with distnb"):
            shell.ip.run_line_magic("dist_collectives", "")
        with pytest.raises(UsageError, match="py-spy dump --locals --pid"):
            shell.ip.run_line_magic("dist_debug", "2")
        with pytest.raises(UsageError, match="read-only"):
            shell.ip.run_cell_magic("on_ranks", "", "x = 1")
    finally:
        _, out, _ = shell.line("dist_detach")
    assert f"detached from job torchrun-{loop_exit.proc.pid}" in out
    assert loop_exit.proc.poll() is None  # looked at, not changed


def test_what_is_not_a_job_is_said(tmp_path: Path) -> None:
    with pytest.raises(distnb.AttachError, match="neither a torchrun agent .* nor a worker"):
        distnb.attach(pid=_this_process())
    with pytest.raises(distnb.AttachError, match="no torchrun job 'torchrun-1' on this machine now"):
        distnb.attach("torchrun-1")


def _attached(**how: object) -> BareJob:
    job = distnb.attach(**how)  # type: ignore[arg-type]
    assert isinstance(job, BareJob), job
    return job


def _this_process() -> int:
    import os

    return os.getpid()


def _is_rank(pid: int) -> bool:
    return any(r.pid == pid for j in find_bare_jobs() for r in j.ranks.values())


def _in_loop(job: AttachableJob) -> bool:
    with _attached(pid=job.proc.pid) as attached:
        return all("healthy.py" in rs.body()[0] if rs.threads and rs.body() else False for rs in attached.stacks().ranks)
