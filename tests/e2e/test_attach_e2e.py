"""Attach to a torchrun job distnb did not launch (issue 40): the test starts a real 4-rank job
through ``python -m distnb run -- python -m torch.distributed.run …``, hung by a rank-conditional
collective, attaches from Python and from a real IPython shell, reads its status, stacks,
collectives and the diagnosis, detaches, checks the job ran on untouched, and kills it by PID."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pytest
from attachable_jobs import AttachableJob, running_job

import distnb
from distnb.config import LaunchConfig
from distnb.services.cases.reproduce import HUNG_CELL_TIMEOUT

from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # 4 ranks importing torch on 2 busy cores: a minute or more

SCRIPT = """from datetime import timedelta
import torch
import torch.distributed as dist


def main(steps):
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    t = torch.ones(4)
    for _ in range(steps):
        dist.all_reduce(t)
    if rank == 0:
        dist.all_reduce(t)  # only rank 0: the others go on to the barrier
    dist.barrier()


if __name__ == "__main__":
    main(3)
"""


#: Set to a fresh token in the job's environment: every process of the job inherits it (torchrun
#: starts each rank in a session of its own, so the wrapper's session does not hold them).
MARK = "DISTNB_ATTACH_TEST"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AttachableJob]:
    folder = tmp_path_factory.mktemp("attach")
    (folder / "hang.py").write_text(SCRIPT)
    with running_job(folder, "hang.py", 4, MARK) as j:

        def hung() -> bool:
            # Every rank in its 4th collective, for the pool's threshold (LaunchConfig.hang_after, 3 s).
            try:
                attached = distnb.attach(j.job_id)
            except distnb.AttachError:
                return False  # ranks still starting (importing torch) may not answer within the attach's bound
            with attached:
                log = attached.collectives().log
                return all(len(log.entries.get(r, {})) >= 4 for r in range(4)) and attached.diagnose().is_problem

        # 4 ranks importing torch on 2 busy cores, then the hang's threshold: the bound the other job tests use.
        wait_until(hung, 150, "the job's hang, diagnosed", poll=0.5)
        yield j


def test_attach_from_python_diagnoses_the_rank_conditional_collective(job: AttachableJob) -> None:
    pids = job.processes()
    assert len(pids) >= 6  # the wrapper, torchrun and 4 ranks
    attached = distnb.attach()  # the one job in this folder
    try:
        assert attached.job == job.job_id and attached.world_size == 4
        # What %dist_reproduce needs: each rank's own command line and folder.
        assert {e.argv for e in attached.files.ranks.values()} == {("hang.py",)}, attached.files.ranks
        assert len({e.cwd for e in attached.files.ranks.values()}) == 1 and Path(attached.files.ranks[0].cwd, "hang.py").exists()
        stacks = attached.stacks().text()
        assert "hang.py:13 in main: dist.all_reduce(t)" in stacks, stacks
        assert "hang.py:14 in main: dist.barrier()" in stacks, stacks
        collectives = attached.collectives()
        # The call log was wrapped on as the job imported torch.distributed: the calls before the attach are there.
        assert [c["op"] for c in sorted(collectives.log.calls[0].values(), key=lambda c: c["n"])] == ["all_reduce"] * 4
        assert [c["op"] for c in collectives.log.calls[1].values()][-1] == "barrier"
        report = collectives.text()
        assert "first divergence: collective #4 on group 0" in report and "(the odd one out: rank 0)" in report, report
        verdict = attached.diagnose()
        assert verdict.culprits == [0] and verdict.rule == "disagree", verdict.text()
        assert "rank 0 in all_reduce #4" in verdict.text() and "ranks 1-3 in barrier #4" in verdict.text(), verdict.text()
        memory = attached.memory()
        assert sorted(memory.current) == [0, 1, 2, 3] and all(m["rss"] > 0 for m in memory.current.values())
        env = attached.env()
        assert {e["RANK"] for e in env.env.values()} == {"0", "1", "2", "3"}
        timeline = attached.stragglers()
        assert timeline.ranks == [0, 1, 2, 3] and len(timeline.collectives) >= 3, timeline.text()  # the 3 every rank made
        status = attached.status().text()
        assert f"attached to job {job.job_id} (read-only): 4 ranks" in status, status
        assert "rank 0: pid" in status and "in all_reduce" in status and "The odd one out: rank 0." in status, status
    finally:
        attached.detach()
    assert not attached.attached and distnb.jobs.attached.current_attached() is None
    with pytest.raises(distnb.AttachError, match="is detached; attach again"):
        attached.stacks()
    # Detached: the job runs on as it was, every process the same, still hung where it was.
    time.sleep(0.5)
    assert job.processes() == pids and job.proc.poll() is None
    with distnb.attach(job.job_id) as again:
        assert again.diagnose().culprits == [0]


def test_attach_from_magics_and_read_only(job: AttachableJob, monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.core.error import UsageError
    from magic_shell import Shell

    from distnb.jobs import pools

    # No pool of this process's earlier tests is the notebook's current one (the shell is shared):
    # %dist_launch below must meet the attached job, not a pool that is already up.
    monkeypatch.setattr(pools, "_current", None)
    shell = Shell()
    pids = job.processes()
    value, _, _ = shell.line("dist_attach")
    try:
        assert f"attached to job {job.job_id}" in repr(value) and "The odd one out: rank 0." in repr(value), repr(value)
        value, _, _ = shell.line("dist_stacks")
        assert "dist.all_reduce(t)" in repr(value), repr(value)
        value, _, _ = shell.line("dist_collectives", "--last 2")
        assert "first divergence" in repr(value), repr(value)
        value, _, _ = shell.line("dist_env")
        assert "LOCAL_RANK" in repr(value), repr(value)
        _, out, _ = shell.line("dist_memory")
        assert "rank" in out, out
        _, out, _ = shell.line("dist_status")
        assert "ranks 1-3 in barrier #4" in out, out
        _, out, _ = shell.line("dist_debug", '1 -c "p rank"')
        assert "(rank 1) p rank\n1\n" in out and out.rstrip().endswith("[distnb] left rank 1; it runs on as it was."), out
        with pytest.raises(UsageError, match=f"job {job.job_id} has ranks 0-3, not 7; %dist_debug RANK names one of them"):
            shell.ip.run_line_magic("dist_debug", "7")
        with pytest.raises(UsageError, match=f"attached to job {job.job_id}, read-only"):
            shell.ip.run_cell_magic("on_ranks", "", "x = 1")
        with pytest.raises(UsageError, match="read-only"):
            shell.ip.run_line_magic("dist_shutdown", "")
        with pytest.raises(UsageError, match="%dist_detach first, then launch a pool"):
            shell.ip.run_line_magic("dist_launch", "-n 2")
    finally:
        _, out, _ = shell.line("dist_detach")
    assert f"detached from job {job.job_id}" in out
    _, out, _ = shell.line("dist_detach")
    assert "not attached" in out
    assert job.processes() == pids and job.proc.poll() is None


def test_debug_a_hung_rank_reads_its_frames_and_leaves_it_as_it_was(job: AttachableJob) -> None:
    """pdb's words on the rank the diagnosis blames, hung in native code: its frames are read where
    it stands, a pause can't land there (and is taken back on leaving), the job is as it was."""
    said: list[str] = []
    pids = job.processes()
    with distnb.attach(job.job_id) as attached:
        attached.debug(commands=["where", "p rank", "p t", "u", "p steps", "d", "a", "ranks all: p rank == 0", "pause", "n", "q"],
                       say=said.append)
        text = "\n".join(said)
        assert said[0].startswith(f"[distnb] debugging rank 0 of the live job {job.job_id} (pid "), said[0]  # the one blamed
        assert "\n[distnb] rank 0 is in all_reduce [4] f32 (#4 on group 0) for " in said[0], said[0]
        assert said[1].startswith("> ") and "hang.py:13 in main: dist.all_reduce(t)  # only rank 0" in said[1], said[1]  # the user's frame, not torch's
        assert "distributed_c10d.py" in text and "(rank 0) p rank\n0\n" in text, text
        assert "(rank 0) p t\ntensor([64., 64., 64., 64.])" in text, text  # three all_reduces of ones over 4 ranks
        assert "(rank 0) p steps\n*** NameError: name 'steps' is not defined" in text and "(rank 0) a\nsteps = 3" in text, text
        assert "(rank 0) ranks all: p rank == 0\nranks 1-3: False\nrank 0: True\n" in text, text  # each in its own frame
        assert "(rank 0) pause\n[distnb] rank 0 is in native code (a collective, a kernel, I/O)" in text, text
        assert "(rank 0) n\n*** rank 0 has not stopped yet" in text, text
        assert said[-1] == "[distnb] left rank 0; the pause asked for is taken back, it runs on.", said[-1]
        verdict = attached.diagnose()
        assert verdict.culprits == [0] and "rank 0 in all_reduce #4" in verdict.text(), verdict.text()
    assert job.processes() == pids and job.proc.poll() is None


@pytest.mark.timeout(LaunchConfig.start_timeout + HUNG_CELL_TIMEOUT + 180)  # the pool's start, the hung cell, the kernel's own start and end
def test_reproduce_writes_a_notebook_that_hangs_the_same_way_on_fewer_ranks(job: AttachableJob, tmp_path: Path) -> None:
    """%dist_reproduce from the attached job: the script cut into cells (main() inlined, the
    rank-conditional call alone in the last cell); written on 3 of the job's 4 ranks (rank 0 alone
    is to blame: it and a majority apart) and run by a real kernel, where distnb's diagnosis names the same rank and call as
    in the job."""
    import nbformat
    from nbtext import outputs_text

    from conftest import run_notebook

    with distnb.attach(job.job_id) as attached:
        made = attached.reproduce(str(tmp_path / "repro.ipynb"))
        # Rank 0 alone is to blame: three ranks (it and a majority apart) likely suffice; that smaller notebook is the one run.
        small = attached.reproduce(str(tmp_path / "repro3.ipynb"), ranks=3)
    assert made.world_size == 4 and made.failing == "dist.all_reduce(t)  # only rank 0: the others go on to the barrier", made.text()
    assert any("main()'s body is inlined" in n for n in made.notes), made.notes
    assert made.fewest == 3 and "--ranks 3 may fail the same way" in made.text(), made.text()
    assert nbformat.read(made.path, as_version=4).cells[1].source.startswith("%load_ext distnb\n%dist_launch -n 4 --backend auto")
    assert small.world_size == 3 and small.job_size == 4 and small.failing == made.failing
    nb = nbformat.read(small.path, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert sources[0].startswith("%load_ext distnb\n%dist_launch -n 3 --backend auto"), sources[0]
    assert "sys.argv = [" in sources[1] and "hang.py" in sources[1]
    assert sources[-2].startswith("%%on_ranks --timeout 30\nif rank == 0:\n    dist.all_reduce(t)"), sources[-2]
    assert sources[-3].startswith("%%on_ranks\nsteps = 3\n"), sources[-3]  # main(3)'s parameter, bound
    assert "dist.barrier()" in nb.cells[-1].source and nb.cells[-1].cell_type == "markdown"  # the rest, as text
    ran = run_notebook(nb, str(tmp_path), "DISTNB_REPRO_TEST", timeout=LaunchConfig.start_timeout + HUNG_CELL_TIMEOUT + 60)
    failing = [c for c in ran.cells if c.cell_type == "code"][-2]
    shown = outputs_text(failing)
    # The pool's diagnosis, where the job had "rank 0 in all_reduce #4, ranks 1-3 in barrier #4".
    assert "rank 0 entered all_reduce #4" in shown and "Root cause: rank 0." in shown and "timed out" in shown, shown
    assert "ranks 1-3" not in shown, shown  # three ranks


def test_attach_from_a_real_kernel(job: AttachableJob, tmp_path: Path) -> None:
    """The magics in a Jupyter kernel (nbclient), as a user runs them: attach, look, reproduce, detach."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook
    from nbtext import outputs_text

    from conftest import run_notebook

    nb = new_notebook(cells=[new_code_cell(c) for c in (
        f"import os\nos.environ['DISTNB_JOBS_DIR'] = {os.environ['DISTNB_JOBS_DIR']!r}\n%load_ext distnb",
        f"%dist_attach {job.job_id}", "%dist_stacks", "%dist_collectives --last 2", "%dist_reproduce from_kernel.ipynb", "%dist_detach",
        f"%dist_attach {job.job_id}", '%dist_debug 2 -c "p rank" -c where', "%dist_debug 1", "%dist_detach")])
    pids = job.processes()
    ran = run_notebook(nb, str(tmp_path), "DISTNB_ATTACH_KERNEL_TEST", timeout=120)
    shown = [outputs_text(c) for c in ran.cells]
    assert f"attached to job {job.job_id} (read-only): 4 ranks" in shown[1] and "The odd one out: rank 0." in shown[1], shown[1]
    assert "dist.all_reduce(t)  # only rank 0" in shown[2] and "first divergence" in shown[3], shown[2:4]
    assert "wrote from_kernel.ipynb: hang.py in" in shown[4] and nbformat.read(str(tmp_path / "from_kernel.ipynb"), as_version=4).cells
    assert f"detached from job {job.job_id}; it runs on as it was." in shown[5], shown[5]
    # nbclient's kernel gives no input line: said, and the rank left as it was.
    assert "this front-end gives no input line: %dist_debug RANK -c CMD" in shown[8] and "[distnb] left rank 1; it runs on as it was." in shown[8], shown[8]
    assert "(rank 2) p rank\n2\n(rank 2) where\n" in shown[7] and "> " in shown[7] and "hang.py:14 in main: dist.barrier()" in shown[7], shown[7]
    assert job.processes() == pids and job.proc.poll() is None  # the kernel came and went; the job is as it was
