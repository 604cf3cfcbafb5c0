"""Attaching to a job distnb did not launch (issue 40): the errors a bad input gets, each one line
saying what to do, and the wrapper's pieces — without starting a job (tests/e2e/test_attach_e2e.py
starts one)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import distnb
from distnb.jobs.attached import current_attached
from distnb.launching.attach_run import SITECUSTOMIZE, attach_env, run, write_site
from distnb.wire.discovery import RankEndpoint, write_endpoint
from distnb.worker.process import attachable

GONE_PID = 2**30


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A jobs folder of the test's own; no torchrun job on this machine is found by its processes
    (another test's, running beside this one, would be: tests/e2e/test_bare_attach_e2e.py finds those)."""
    from distnb.jobs import attached

    monkeypatch.setenv("DISTNB_JOBS_DIR", str(tmp_path))
    monkeypatch.setattr(attached, "find_bare_jobs", lambda: [])
    return tmp_path


def publish(root: Path, job: str, rank: int = 0, pid: int | None = None, port: int | None = None) -> None:
    if port is None:
        with socket.socket() as s:  # a port nobody listens on once closed
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    write_endpoint(RankEndpoint(job, rank, 1, os.getpid() if pid is None else pid, "127.0.0.1", port, os.urandom(32), time.time()), root)


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_no_job_says_how_to_start_one(jobs: Path) -> None:
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach()
    assert ("no attachable job on this machine, nor any other torchrun job here: start one with python -m distnb run -- torchrun"
            in one_line(exc)) and "%dist_attach --pid PID" in one_line(exc)


def test_a_job_whose_processes_are_gone_is_not_offered(jobs: Path) -> None:
    publish(jobs, "old", pid=GONE_PID)
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach()
    assert "(1 with stale files only: old, their processes gone)" in one_line(exc)
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach("old")
    assert f"job old has ended: the processes of its discovery files are gone (rank 0 pid {GONE_PID}); remove " in one_line(exc)


def test_several_jobs_are_listed_and_a_wrong_name_lists_the_known(jobs: Path) -> None:
    publish(jobs, "a")
    publish(jobs, "b")
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach()
    text = one_line(exc)
    assert text.startswith("several attachable jobs on this machine; name one, e.g. %dist_attach ") and "a: 1/1 ranks alive" in text
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach("c")
    assert "no attachable job 'c'" in one_line(exc) and "(jobs there: " in one_line(exc)


def test_ranks_that_do_not_answer(jobs: Path) -> None:
    publish(jobs, "mute")
    t0 = time.monotonic()
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach(timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert f"no rank of job mute answered within 0.3 s (pids {os.getpid()}): their control threads are not serving" in one_line(exc)
    assert current_attached() is None


def test_the_wrapper_makes_the_environment_attachable(tmp_path: Path) -> None:
    site = write_site(tmp_path / "site")
    compile(SITECUSTOMIZE, "sitecustomize.py", "exec")
    assert (Path(site) / "sitecustomize.py").read_text() == SITECUSTOMIZE
    env = attach_env(site, {"PYTHONPATH": "/x"}, job_id="j")
    assert env["DISTNB_ATTACH"] == "1" and env["DISTNB_JOB_ID"] == "j"
    assert attach_env(site, {}, job_id="exp/1")["DISTNB_JOB_ID"] == "exp_1"  # as the ranks name their folder
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == site and parts[-1] == "/x"
    assert run([]) == 2  # no command: says what to give


def test_the_hook_does_nothing_outside_an_attachable_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTNB_ATTACH", raising=False)
    assert not attachable.maybe_start()
    monkeypatch.setenv("DISTNB_ATTACH", "1")
    monkeypatch.delenv("RANK", raising=False)
    assert not attachable.maybe_start()  # torchrun's agent itself: not a rank
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("DISTNB_ATTACH_STARTED", str(os.getppid()))
    assert not attachable.maybe_start()  # a process an attachable rank started (a DataLoader worker)
    monkeypatch.delenv("DISTNB_ATTACH_STARTED")
    monkeypatch.setenv("DISTNB_ADDR", "tcp://127.0.0.1:1")
    assert not attachable.maybe_start()  # a rank of distnb's own pool has its control thread


def test_a_programs_stack_gives_its_script_line() -> None:
    from distnb.analysis.verdicts.position import position_from_stack
    from distnb.analysis.verdicts.stacks import Frame, RankStack, ThreadStack

    frames = [Frame("/home/u/train.py", 40, "<module>", "main()"), Frame("/home/u/train.py", 12, "main", "dist.all_reduce(t)"),
              Frame("/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3252, "all_reduce", "work.wait()")]
    program = RankStack(0, "in the job", "control thread", [ThreadStack("MainThread", True, frames, program=True)])
    pos = position_from_stack(program)
    assert pos.state == "collective" and pos.op == "all_reduce"
    assert pos.where().endswith("in main() (train.py:12) (dist.all_reduce(t))"), pos.where()
    assert program.body()[0] == "    /home/u/train.py:40 in <module>: main()"
    # The same frames on a pool rank's main thread are distnb's serve loop, outside any cell.
    pool_rank = RankStack(0, "idle", "control thread", [ThreadStack("MainThread", True, frames)])
    assert position_from_stack(pool_rank).line is None and pool_rank.body() == ["    (idle: waiting for a cell)"]


@contextlib.contextmanager
def served_rank(jobs: Path, job: str, world: int = 1) -> Iterator[Any]:
    """Rank 0 of ``job``: an attachable control thread served from this process, published under ``jobs``."""
    import threading

    import torch.distributed  # noqa: F401  (the control thread reads the recorders: not its first import of torch)
    import zmq

    from distnb.wire.security import Credentials
    from distnb.worker.process.execute import Executor

    ctx: zmq.Context = zmq.Context(1)
    creds = Credentials.new()
    control = attachable._attachable_control(ctx, "tcp://127.0.0.1:*", creds, 0, Executor({}, lambda cell, bundle: None))
    thread = threading.Thread(target=control.run, daemon=True)
    thread.start()
    try:
        port = int(control.addr.rsplit(":", 1)[1])
        write_endpoint(RankEndpoint(job, 0, world, os.getpid(), "127.0.0.1", port, creds.key, time.time()), jobs)
        yield control
    finally:
        closing = threading.Thread(target=ctx.term, daemon=True)  # wakes the control thread with ContextTerminated
        closing.start()
        thread.join(5)
        control.sock.close(linger=0)  # then the context can end
        closing.join(5)
    assert not thread.is_alive() and not closing.is_alive()


def test_a_rank_that_does_not_answer_is_named_and_the_rank_refuses_to_be_changed(jobs: Path) -> None:
    """An attachable control thread served from this process (rank 0) beside a rank whose port
    nobody listens on (rank 1): the attach goes on with the one that answers, and says why the
    other gave nothing; the rank refuses an interrupt (read-only)."""
    from distnb.controller.attach_link import AttachLink
    from distnb.wire.protocol import Msg

    with served_rank(jobs, "half", world=2):
        publish(jobs, "half", rank=1)
        with distnb.attach() as job:  # the product's bound (2 s) for each answer
            status = job.status(with_diagnosis=False).text()
            assert "rank 0: pid" in status and "computing" in status, status
            assert "rank 1: pid" in status and "no answer: its control thread did not answer within 2 s" in status, status
            # A second notebook attached at the same time gets its own replies.
            link = AttachLink({0: job.files.ranks[0]})
            try:
                reply = link.ask([0], {"t": Msg.INTERRUPT, "cell": None}, 2.0)
            finally:
                link.close()
            assert reply[0]["error"] == "this job is attached read-only: distnb does not interrupt or pause it"
            assert "stacks" in job.stacks([0]).ranks[0].source or job.stacks([0]).ranks[0].threads


def test_a_rank_is_looked_into_only_when_the_notebook_asks_and_never_when_the_job_said_no(jobs: Path,
                                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """PEEK and DAP without the notebook's consent are refused with what to do; with it, the rank's
    frames come back (here: this test's own, the main thread waiting for the answer); a job started
    with DISTNB_ATTACH_DEBUG=0 refuses even that, and says so through the API."""
    from distnb.controller.attach_link import AttachLink
    from distnb.wire.protocol import Msg

    waiting_here = 7  # noqa: F841  (read by the rank, in this frame)
    with served_rank(jobs, "look"), distnb.attach("look") as job:
        link = AttachLink({0: job.files.ranks[0]})
        try:
            for msg in ({"t": Msg.PEEK, "what": "frames"}, {"t": Msg.DAP, "msgs": []}):
                reply = link.ask([0], msg, 5.0)[0]
                assert reply["error"].startswith("debugging a rank of a live job runs code in it and may pause it, so it is done only "
                                                 "when asked: %dist_debug RANK"), reply
        finally:
            link.close()
        frames = job.peek(0)["frames"]
        mine = max(i for i, f in enumerate(frames) if f.function == "test_a_rank_is_looked_into_only_when_the_notebook_asks_and_never_when_the_job_said_no")
        assert frames[mine].user and job.peek(0, "eval", mine, "waiting_here * 6")["value"] == "42"
        monkeypatch.setenv(attachable.DEBUG_SWITCH, "0")  # as the job's environment would have it (read by the rank, here)
        with pytest.raises(distnb.AttachError) as refused:
            job.peek(0)
        assert one_line(refused) == "rank 0 gave no look: this job was started with DISTNB_ATTACH_DEBUG=0: its ranks can be looked at " \
            "(%dist_stacks …), not debugged."


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_pth_hook_makes_a_rank_attachable_only_when_asked(tmp_path: Path) -> None:
    """``python -m distnb run --install-hook DIR`` for launchers that cannot be wrapped: an
    interpreter reading DIR's .pth with DISTNB_ATTACH=1 and a rank's variables publishes itself
    (and removes its file at exit); without the variable it does nothing."""
    import subprocess
    import sys

    site_dir, jobs_dir = tmp_path / "site", tmp_path / "jobs"
    site_dir.mkdir()
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo, "DISTNB_JOBS_DIR": str(jobs_dir), "RANK": "0", "WORLD_SIZE": "1", "DISTNB_JOB_ID": "pth"}
    subprocess.run([sys.executable, "-m", "distnb", "run", "--install-hook", str(site_dir)], env=env, check=True, capture_output=True)
    probe = ("import os, site, sys, time; site.addsitedir(sys.argv[1]); path = os.path.join(sys.argv[2], 'pth', 'rank0.json')\n"
             "deadline = time.monotonic() + 20\n"
             "while not os.path.exists(path) and time.monotonic() < deadline and os.environ.get('DISTNB_ATTACH') == '1': time.sleep(0.02)\n"
             "print(os.path.exists(path), 'DISTNB_ATTACH_STARTED' in os.environ)")
    asked = subprocess.run([sys.executable, "-c", probe, str(site_dir), str(jobs_dir)], env={**env, "DISTNB_ATTACH": "1"},
                           capture_output=True, text=True, timeout=40)
    assert asked.stdout.strip() == "True True", asked.stderr
    assert not (jobs_dir / "pth" / "rank0.json").exists()  # removed at exit
    plain = subprocess.run([sys.executable, "-c", probe, str(site_dir), str(jobs_dir)], env=env, capture_output=True, text=True, timeout=40)
    assert plain.stdout.strip() == "False False", plain.stderr  # no thread started
    subprocess.run([sys.executable, "-m", "distnb", "run", "--uninstall-hook", str(site_dir)], env=env, check=True, capture_output=True)
    assert not list(site_dir.iterdir())


def test_the_wrapper_forgets_what_its_ranks_left(jobs: Path) -> None:
    from distnb.launching.attach_run import _forget_job

    publish(jobs, "done", pid=GONE_PID)
    publish(jobs, "done", rank=1, pid=GONE_PID)
    _forget_job("done")
    assert not (jobs / "done").exists()
    publish(jobs, "running")  # this process: alive
    _forget_job("running")
    assert (jobs / "running" / "rank0.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_wrapper_returns_the_commands_status(jobs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import sys

    assert run([sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['DISTNB_ATTACH'] == '1' else 1)"], job_id="rc") == 3
    assert "distnb: job rc is attachable" in capfd.readouterr().err
    assert run(["/nonexistent/torchrun"]) == 127
    assert "cannot start '/nonexistent/torchrun'" in capfd.readouterr().err


def test_the_magics_say_it_in_one_line(jobs: Path) -> None:
    from IPython.core.error import UsageError
    from magic_shell import Shell

    shell = Shell()
    with pytest.raises(UsageError, match="no attachable job on this machine, nor any other torchrun job here: start one with python -m distnb run"):
        shell.ip.run_line_magic("dist_attach", "")
    with pytest.raises(UsageError, match="no attachable job 'nope'"):
        shell.ip.run_line_magic("dist_attach", "nope")
    _, out, _ = shell.line("dist_detach")
    assert out == "not attached to any job (%dist_attach attaches to one; %dist_load reads the records of one that ended).\n"
    with pytest.raises(UsageError, match=r"no job to reproduce: %dist_attach to a running job, or %dist_load the records of one that ended"):
        shell.ip.run_line_magic("dist_reproduce", "")


def test_a_machine_that_cannot_be_read_is_named_with_why(jobs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTNB_SSH", "false")  # an ssh that always fails, as an unreachable host does
    with pytest.raises(distnb.AttachError, match=r"no attachable job on this machine or the machines asked.*; node7: ssh node7 failed: exit status 1"):
        distnb.attach(hosts="node7")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(distnb.AttachError, match="slurm: not inside a Slurm allocation"):
        distnb.attach(slurm=True)


def test_several_torchrun_jobs_not_started_with_distnb_are_listed_by_pid(jobs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distnb.jobs import attached
    from distnb.launching.bare_jobs import BareJobFiles, BareRank

    def job(agent: int) -> BareJobFiles:
        rank = BareRank(0, agent + 1, 0, ("python", "-u", "train.py"), "/w", {"LOCAL_WORLD_SIZE": "2"}, 0.0)
        return BareJobFiles(agent, "none", 2, {0: rank})

    monkeypatch.setattr(attached, "find_bare_jobs", lambda: [job(100), job(200)])
    with pytest.raises(distnb.AttachError) as exc:
        distnb.attach()
    said = one_line(exc)
    assert "several torchrun jobs on this machine, none started with distnb; name one by its agent's pid" in said, said
    assert "torchrun-100: 1 rank here of 2, train.py (%dist_attach --pid 100)" in said and "--pid 200" in said, said
