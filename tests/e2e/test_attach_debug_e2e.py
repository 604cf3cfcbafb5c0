"""Stepping into a rank of a live job (issue 40): a real 2-rank torchrun job, made attachable by
``python -m distnb run`` and started by the test, runs a Python loop with an all_reduce every 20
steps. From the notebook's API: rank 1 is paused, stepped and let go (rank 0 waits for it at its
next collective meanwhile), and is untraced once left; a pause whose notebook goes quiet is let go
by the rank after the lease; an interrupted console leaves nothing paused. The job runs on
throughout, and is killed by PID at the end."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import pytest
from attachable_jobs import AttachableJob, running_job

import distnb
from distnb.controller.attach_link import AttachLink
from distnb.jobs.attached import AttachedJob
from distnb.services.job_stepper import STEP_WAIT, JobStepper
from distnb.wire.discovery import list_jobs
from distnb.worker.process.attachable import LEASE_ENV, TICK_MS

from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # 2 ranks importing torch on 2 busy cores, then seconds per step

SCRIPT = """import itertools
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)


def work(step):
    total = step * 2
    return total


for step in itertools.count():
    value = work(step)
    if step % 20 == 0:
        dist.all_reduce(t)
    time.sleep(0.01)
"""
WORK_LINE = 12  # ``total = step * 2``, in work()
#: The lease the job is started with: short, so the test sees a quiet notebook's pause let go.
LEASE = 4.0
MARK = "DISTNB_ATTACH_DEBUG_TEST"
#: Whether rank's main thread runs untraced: no trace function on its frame, no debugger tool.
UNTRACED = ("(lambda sys: sys._current_frames()[__import__('threading').main_thread().ident].f_trace is None and "
            "(not hasattr(sys, 'monitoring') or sys.monitoring.get_tool(sys.monitoring.DEBUGGER_ID) is None))(__import__('sys'))")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AttachableJob]:
    folder = tmp_path_factory.mktemp("attach_debug")
    (folder / "loop.py").write_text(SCRIPT)
    with running_job(folder, "loop.py", 2, MARK, {LEASE_ENV: str(LEASE)}, stderr=folder / "stderr.txt", standalone=True) as j:
        try:
            wait_until(lambda: steps(j, 1) is not None and steps(j, 1) > 25, 120, "the loop past its second all_reduce", poll=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the job's stderr:\n{stderr(j)[-3000:]}") from None
        yield j


def stderr(job: AttachableJob) -> str:
    return (job.folder / "stderr.txt").read_text()


def steps(job: AttachableJob, rank: int, attached: AttachedJob | None = None) -> int | None:
    """Rank ``rank``'s loop counter now (read without stopping it), or None while it can't be read."""
    try:
        own = attached is None
        attached = attached or distnb.attach(job.job_id)
    except distnb.AttachError:
        return None
    try:
        return int(look(attached, rank, "step"))
    except (distnb.AttachError, ValueError):
        return None
    finally:
        if own:
            attached.detach()


def look(attached: AttachedJob, rank: int, expr: str) -> str:
    frames = attached.peek(rank)["frames"]
    module = max(i for i, f in enumerate(frames) if f.filename.endswith("loop.py") and f.function == "<module>")
    return attached.peek(rank, "eval", module, expr).get("value", "")


def scripted(lines: list[str | Callable[[], str]]) -> Callable[[str], str]:
    """An ``ask`` giving the console these lines in turn (a callable: run, then its line)."""
    it = iter(lines)

    def ask(prompt: str) -> str:
        line = next(it, "q")
        return line() if callable(line) else line

    return ask


def test_pause_step_and_let_go_a_rank_while_the_others_wait_for_it(job: AttachableJob) -> None:
    said: list[str] = []
    waited: list[tuple[int | None, int | None]] = []
    with distnb.attach(job.job_id) as attached:

        def rank_0_waits() -> str:
            # Rank 1 is paused: rank 0 reaches its next all_reduce and waits there — once it got
            # there (a step at an all_reduce, read the same twice), however slow the machine.
            seen: list[int | None] = [None]

            def at_its_all_reduce() -> bool:
                now = steps(job, 0, attached)
                held, seen[0] = now is not None and now % 20 == 0 and now == seen[0], now
                return held

            wait_until(at_its_all_reduce, 60, "rank 0 held at its next all_reduce", poll=0.5)
            first = steps(job, 0, attached)
            time.sleep(1.5)
            waited.append((first, steps(job, 0, attached)))
            return "p step"

        attached.debug(1, ask=scripted(["pause", "where", "p step", "n", "n", rank_0_waits, "a", "c"]), say=said.append)
        text = "\n".join(said)
        assert said[0].startswith(f"[distnb] debugging rank 1 of the live job {job.job_id} (pid "), said[0]
        assert "[distnb] rank 1 paused (pause)\n> " in text and "loop.py:" in text, text
        assert "[distnb] rank 1 paused (step)" in text, text
        assert text.rstrip().endswith("[distnb] rank 1 goes on; left it."), text
        first, second = waited[0]
        assert first is not None and first == second and first % 20 == 0, waited  # held at its all_reduce, as long as rank 1 was
        # Let go: both ranks run on, and rank 1 is untraced again (as fast as before the pause).
        before = (steps(job, 0, attached) or 0, steps(job, 1, attached) or 0)
        wait_until(lambda: (steps(job, 0, attached) or 0) > before[0] + 20 and (steps(job, 1, attached) or 0) > before[1] + 20,
                   60, "both ranks past their next all_reduce", poll=0.2)
        wait_until(lambda: look(attached, 1, UNTRACED) == "True", 10 * TICK_MS / 1000 + STEP_WAIT, "rank 1 untraced once let go", poll=0.2)
    assert "a notebook attached to this job is debugging this rank (%dist_debug)" in stderr(job)


def test_a_breakpoint_stops_the_rank_there_and_is_cleared_on_leaving(job: AttachableJob) -> None:
    said: list[str] = []
    with distnb.attach(job.job_id) as attached:
        attached.debug(1, commands=[f"b {WORK_LINE}", "c", "a", "p total", "n", "p total", "q"], say=said.append)
        text = "\n".join(said)
        assert f"loop.py:{WORK_LINE} on rank 1: it pauses there" in text, text
        assert "[distnb] rank 1 paused (breakpoint)\n> " in text and f"loop.py:{WORK_LINE} in work: total = step * 2" in text, text
        step = int(text.split("(rank 1) a\nstep = ")[1].split("\n")[0])
        assert "(rank 1) p total\n*** NameError: name 'total' is not defined" in text, text  # not yet run
        assert f"(rank 1) p total\n{step * 2}\n" in text, text  # one line on
        assert said[-1] == "[distnb] rank 1 goes on; left it, its breakpoints cleared.", said[-1]
        held = steps(job, 1, attached) or 0
        wait_until(lambda: (steps(job, 1, attached) or -1) > held + 25, 60, "rank 1 past its breakpoint's line, unstopped", poll=0.2)
        wait_until(lambda: look(attached, 1, UNTRACED) == "True", 10, "rank 1 untraced once left", poll=0.2)


def test_a_pause_whose_notebook_goes_quiet_is_let_go_after_the_lease(job: AttachableJob) -> None:
    """Rank 1 paused, and rank 0 asked to pause while it waits for rank 1 in its all_reduce (native
    code: the pause would land when that returns) and given a breakpoint in work(); then the
    notebook is gone without a word. After the lease each rank lets itself go, rank 0's pause taken
    back before it lands and its breakpoint cleared: both run on."""
    with distnb.attach(job.job_id) as attached:
        script = next(f.filename for f in attached.peek(0)["frames"] if f.filename.endswith("loop.py"))
    files = next(f for f in list_jobs() if f.job == job.job_id)
    link = AttachLink(files.ranks)
    one, zero = JobStepper(link, 1), JobStepper(link, 0)
    assert one.pause() is not None and one.paused
    with distnb.attach(job.job_id) as attached:  # rank 0 reaches its next all_reduce, and waits there for rank 1
        wait_until(lambda: attached.peek(0)["frames"][-1].function == "all_reduce", 60, "rank 0 waiting in its all_reduce", poll=0.2)
    assert zero.pause(wait=1.0) is None and zero.pending
    assert zero.set_breakpoint(script, WORK_LINE) == ""
    link.close()  # no continue will come
    with distnb.attach(job.job_id) as attached:
        held = (steps(job, 0, attached) or 0, steps(job, 1, attached) or 0)
        wait_until(lambda: (steps(job, 0, attached) or -1) > held[0] + 25 and (steps(job, 1, attached) or -1) > held[1] + 25,
                   LEASE + 30, "both ranks going on after the lease", poll=0.5)
        for rank in (0, 1):
            wait_until(lambda r=rank: look(attached, r, UNTRACED) == "True", 10, f"rank {rank} untraced after the lease", poll=0.2)
    assert f"the notebook that paused this rank said nothing for {LEASE:g} s: the rank goes on" in stderr(job)


def test_an_interrupted_console_and_a_detach_leave_nothing_paused(job: AttachableJob) -> None:
    said: list[str] = []

    def interrupted() -> str:
        raise KeyboardInterrupt

    with distnb.attach(job.job_id) as attached:
        with pytest.raises(KeyboardInterrupt):
            attached.debug(0, ask=scripted(["pause", interrupted]), say=said.append)
        assert said[-1] == "[distnb] rank 0 goes on; left it.", said
        held = steps(job, 0, attached) or 0
        wait_until(lambda: (steps(job, 0, attached) or -1) > held + 5, 30, "rank 0 going on", poll=0.2)
        # Paused through the API and detached: the detach lets it go.
        stepper = attached._steppers[0]
        assert stepper.pause() is not None
    held = steps(job, 0) or 0
    wait_until(lambda: (steps(job, 0) or -1) > held + 5, 30, "rank 0 going on after the detach", poll=0.2)
    assert job.proc.poll() is None
