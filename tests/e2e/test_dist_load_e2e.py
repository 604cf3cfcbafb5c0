"""A job that already died or hung, loaded (issue 40, item 3): the test starts real 4-rank
torchrun jobs through ``python -m distnb run -- python -m torch.distributed.run …``, lets them end
on their own — (a) one rank raises mid-training, (b) a rank-conditional collective hangs the job
until gloo's own timeout — and reads what they left with ``distnb.load``, ``%dist_load`` in an
IPython shell and in a real kernel (nbclient). Every process a job starts is found by a token in
its environment and killed by PID if still there."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import hung_job
import nbformat
import pytest
import torch
from attachable_jobs import AttachableJob

import distnb
from distnb.config import LaunchConfig

from conftest import run_notebook

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: gloo's timeout in job (b): the job ends by it, and every bound below is built from it.
PG_TIMEOUT = 20
#: 4 ranks importing torch on 2 busy cores, and torchrun's own start and stop: a minute or more.
START = 120

RAISES = """
from datetime import timedelta
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
t = torch.ones(4)


def train_step(step):
    if rank == 2 and step == 3:
        raise ValueError(f"rank {rank} got a bad batch at step {step}")
    dist.all_reduce(t)


for step in range(6):
    train_step(step)
"""

HANGS = hung_job.script(PG_TIMEOUT)

MARK = "DISTNB_LOAD_TEST"


def run_job(folder: Path, script: str, bound: float) -> tuple[int, str, Path]:
    """Run ``script`` as a 4-rank torchrun job under ``python -m distnb run`` until it ends (within
    ``bound`` seconds, else kill it by PID and fail); its exit status, stderr and records folder."""
    name = f"{uuid.uuid4().hex[:6]}.py"
    (folder / name).write_text(script)
    job = AttachableJob(folder, name, 4, MARK, {"DISTNB_JOBS_DIR": str(folder / "jobs"), "OMP_NUM_THREADS": "1"},
                        stderr=subprocess.PIPE, job_id=f"load-{uuid.uuid4().hex[:6]}")
    try:
        _, err = job.proc.communicate(timeout=bound)
    finally:
        left = job.kill()
    assert not left, f"the job's processes outlived it: {left}"
    return job.proc.returncode, err, folder / "jobs" / job.job_id / "records"


@pytest.fixture(scope="module")
def raised(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    return run_job(tmp_path_factory.mktemp("raises"), RAISES, START)


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    return run_job(tmp_path_factory.mktemp("hangs"), HANGS, START + PG_TIMEOUT)


def test_a_rank_that_raised(raised: tuple[int, str, Path]) -> None:
    rc, err, records = raised
    assert rc == 1, err[-3000:]
    # The wrapper's one line at the job's end: where the records are, and how to load them.
    assert f"left records in {records}: %dist_load {records} in a notebook" in err, err[-3000:]
    job = distnb.load(records)
    try:
        assert job.world_size == 4 and 2 in job.dumps.ranks
        verdict = job.diagnose()
        assert verdict.culprits == [2] and verdict.rule == "raised", verdict.text()
        assert "rank 2 raised ValueError: rank 2 got a bad batch at step 3" in verdict.text(), verdict.text()
        assert "in train_step() (" in verdict.text() and ".py:13)" in verdict.text(), verdict.text()
        assert job.launch.argv[0].endswith(".py") and job.launch.world_size == 4 and job.launch.backend == "gloo"
        assert job.launch.site is not None and job.launch.site[1] == 13
        stacks = job.stacks().text()
        assert "raise ValueError(f\"rank {rank} got a bad batch at step {step}\")" in stacks, stacks
        # %dist_reproduce from the records: train_step() is called inside the loop, so the loop is the failing cell.
        made = job.reproduce(str(records.parent / "repro.ipynb"))
        code = [c for c in nbformat.read(made.path, as_version=4).cells if c.cell_type == "code"]
        assert code[0].source.startswith("%load_ext distnb\n%dist_launch -n 4 --backend gloo"), code[0].source
        assert code[-2].source == "%%on_ranks\nfor step in range(6):\n    train_step(step)", code[-2].source  # raised: no --timeout
        assert code[-2].metadata["tags"] == ["raises-exception"] and any("train_step() leads to the failing line" in n for n in made.notes)
        # A rank that left no record (killed by torchrun before it could) is named, never guessed.
        missing = [r for r in range(4) if r not in job.dumps.ranks]
        if missing:
            assert "left no record" in verdict.text()
    finally:
        job.detach()

    from magic_shell import Shell

    shell = Shell()
    value, _, _ = shell.line("dist_load", str(records))
    try:
        assert "rank 2 raised ValueError: rank 2 got a bad batch at step 3" in repr(value), repr(value)
        _, out, _ = shell.line("dist_status")
        assert "rank 2: pid" in out and "raised ValueError" in out, out
    finally:
        shell.line("dist_detach")


@pytest.mark.timeout(START + 120 + LaunchConfig.start_timeout + 60)  # the job (when first), its kernel, the reproduction's
def test_a_rank_that_raised_loaded_in_a_real_kernel(raised: tuple[int, str, Path], tmp_path: Path) -> None:
    _, _, records = raised
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext distnb"), nbformat.v4.new_code_cell(f"%dist_load {records}"),
                nbformat.v4.new_code_cell("%dist_stacks 2"), nbformat.v4.new_code_cell("%dist_reproduce repro.ipynb --ranks 3")]
    ran = run_notebook(nb, str(tmp_path), "DISTNB_LOAD_KERNEL", timeout=120)
    shown = "\n".join(o.get("data", {}).get("text/plain", "") + o.get("text", "") for c in ran.cells for o in c.get("outputs", []))
    assert not any(o.get("output_type") == "error" for c in ran.cells for o in c.get("outputs", [])), shown
    assert "rank 2 raised ValueError: rank 2 got a bad batch at step 3" in shown and "in train_step() (" in shown, shown
    assert "rank 2: raised ValueError" in shown, shown
    # The notebook reproduced from the dead job's records, on 3 of its 4 ranks (rank 2 and a
    # majority apart), run by a real kernel: it fails as the job did.
    assert "on a pool of 3 ranks (the job had 4" in shown, shown
    repro = run_notebook(nbformat.read(str(tmp_path / "repro.ipynb"), as_version=4), str(tmp_path), "DISTNB_LOAD_REPRO",
                         timeout=LaunchConfig.start_timeout + 60)
    failing = [c for c in repro.cells if c.cell_type == "code"][-2]
    said = "\n".join(o.get("data", {}).get("text/plain", "") + o.get("text", "") + "\n".join(o.get("traceback", []))
                     for o in failing.get("outputs", []))
    assert "rank 2 raised ValueError: rank 2 got a bad batch at step 3" in said, said


def test_a_hang_ended_by_gloos_timeout(hung: tuple[int, str, Path]) -> None:
    rc, err, records = hung
    assert rc != 0, err[-3000:]
    job = distnb.load(records)
    try:
        verdict = job.diagnose()
        # The same verdict as attaching to the live hang (tests/e2e/test_attach_e2e.py).
        assert verdict.culprits == [0] and verdict.rule == "disagree", verdict.text()
        text = verdict.text()
        assert "rank 0 in all_reduce #4" in text and "barrier #4" in text and "The odd one out: rank 0." in text, text
        assert ".py:12 (dist.all_reduce(t)" in text, text  # the call site in the user's script
        assert "raised RuntimeError (the wait's end: a timeout, or a peer gone), and the job ended" in text, text
        report = job.collectives().text()
        assert "first divergence: collective #4 on group 0" in report, report
        assert job.launch.site is not None and job.launch.site[1] == 12
    finally:
        job.detach()
    # The Flight Recorder's own pickles beside the records: torch's fr_trace reads the folder as it is.
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(records)], capture_output=True,
                        text=True, timeout=START)
    if "gloo != 'nccl' or 'xccl'" in fr.stderr:
        # torch 2.11's fr_trace reads NCCL's (and XCCL's) dumps only: it refuses gloo's by name, whoever wrote them.
        assert torch.__version__ < "2.13", fr.stderr[-2000:]
    else:
        assert fr.returncode == 0 and "Culprit rank 0" in fr.stdout + fr.stderr, fr.stdout[-2000:] + fr.stderr[-2000:]
    from magic_shell import Shell

    shell = Shell()
    shell.line("dist_load", str(records))
    try:
        value, _, _ = shell.line("dist_stacks")
        assert "dist.barrier()" in repr(value) and "dist.all_reduce(t)" in repr(value), repr(value)
        value, _, _ = shell.line("dist_collectives", "--last 2")
        assert "first divergence" in repr(value), repr(value)
    finally:
        shell.line("dist_detach")
