"""``distnb.load`` / ``%dist_load`` (issue 40, item 3) without a torchrun job: the readers on real
Flight Recorder dumps (torch's own dump functions in a real 2-rank gloo group over a FileStore),
a real torchrun error file (a ``@record``-decorated script), the rank-side recorder in real
processes, and every bad input, each a one-line error or note saying what to do.
tests/e2e/test_dist_load_e2e.py runs whole torchrun jobs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import distnb
from distnb.controller.dump_reader import read_job_dumps
from distnb.jobs.looking import current_job

from conftest import started_pids

pytestmark = pytest.mark.timeout(180)  # processes importing torch on 2 busy cores

REPO = str(Path(__file__).resolve().parents[1])
#: gloo's timeout in the dumps' group: the bound of every wait below comes from it.
PG_TIMEOUT = 3

DUMPS = f"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{{out}}/store", rank=rank, world_size=2, timeout=timedelta(seconds=120))
dist.distributed_c10d._set_pg_timeout(timedelta(seconds={PG_TIMEOUT}))  # once both are in: a slow start is no timeout
t = torch.ones(4)
for _ in range(2):
    dist.all_reduce(t)
try:
    if rank == 1:
        dist.all_reduce(t)  # rank 0 never makes it: gloo's timeout ends both
    else:
        dist.barrier()
except RuntimeError:
    pass
with open(f"{{out}}/pickle/nccl_trace_rank_{{rank}}", "wb") as f:
    f.write(c._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False))
with open(f"{{out}}/json/fr_json_rank_{{rank}}.json", "wb") as f:
    f.write(c._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
"""

ERROR = """
from torch.distributed.elastic.multiprocessing.errors import record


def check(step):
    raise ValueError(f"bad batch at step {step}")


@record
def main():
    check(3)


main()
"""

#: The rank-side recorder in a real gloo group: rank 1 waits for rank 0 (slow, not stuck: its
#: record comes and goes), then rank 0 raises in its own code and rank 1 is left in a barrier.
#: Its group's timeout is not PG_TIMEOUT: rank 1's all_reduce waits while rank 0 sees its record
#: written (1 s into the wait, then the write, on a busy machine); rank 0's exit ends the barrier.
RECORDED = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
from distnb.worker.process.job_records import JobRecorder

rank, out = int(sys.argv[1]), Path(sys.argv[2])
rec = JobRecorder(rank, 2, out / "records", after=1.0)
rec.install()
import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2, timeout=timedelta(seconds=120))
dist.distributed_c10d._set_pg_timeout(timedelta(seconds=30))
t = torch.ones(4)
if rank == 0:  # joins once rank 1's record of its wait is written (after=1.0 into the wait), however busy the machine
    waited = time.monotonic() + 60
    while not (out / "records" / "rank1.json").exists() and time.monotonic() < waited:
        time.sleep(0.05)
dist.all_reduce(t)
path = out / "records" / f"rank{rank}.json"
deadline = time.monotonic() + 30  # written during the wait, removed 1 s after it ended (a write takes a while on a busy machine)
while (path.exists() or rec.writes == 0) and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"writes={rec.writes} exists={path.exists()}", flush=True)


def check(step):
    if rank == 0:
        raise ValueError(f"bad batch at step {step}")


check(3)
dist.barrier()
"""


def _run_all(cmds: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once (the ranks of a group must), wait for all, kill by PID on a timeout."""
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c, env in cmds]
    started_pids.update(p.pid for p in procs)
    out = []
    try:
        for p, (c, _) in zip(procs, cmds):
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real dumps (pickle and JSON) of a 2-rank gloo group that hung until its timeout, a real
    torchrun error file, and the records of two recorded ranks."""
    base = tmp_path_factory.mktemp("dumps")
    for sub in ("pickle", "json", "logs/run_1/attempt_0/1", "rec"):
        (base / sub).mkdir(parents=True)
    (base / "dumps.py").write_text(DUMPS)
    (base / "err.py").write_text(ERROR)
    (base / "recorded.py").write_text(RECORDED)
    err_file = str(base / "logs/run_1/attempt_0/1/error.json")
    # Process start (torch's import, ~5-10 s here) plus the group's timeout, with margin.
    runs = _run_all([([sys.executable, "dumps.py", str(r), str(base)], _env()) for r in (0, 1)]
                    + [([sys.executable, "err.py"], _env(TORCHELASTIC_ERROR_FILE=err_file))]
                    + [([sys.executable, "recorded.py", str(r), str(base / "rec")], _env()) for r in (0, 1)], base, 150)
    for run in runs[:3]:
        assert "dumps.py" not in run.args or run.returncode == 0, run.stderr
    (base / "runs.json").write_text(json.dumps([[r.returncode, r.stdout, r.stderr] for r in runs]))
    return base


@pytest.fixture(autouse=True)
def _leave() -> Iterator[None]:
    yield
    distnb.detach()


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- the readers on real dumps ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["pickle", "json"])
@pytest.mark.slow
def test_real_flight_recorder_dumps_give_the_verdict(made: Path, kind: str) -> None:
    job = distnb.load(made / kind)
    assert current_job() is job and job.world_size == 2
    log = job.collectives().log
    assert [e["op"] for e in job._log.sequence(1, "0")] == ["all_reduce"] * 3, log.entries
    assert [e["op"] for e in job._log.sequence(0, "0")] == ["all_reduce", "all_reduce", "barrier"]
    assert log.groups["0"] == [0, 1]  # the default group's members, though torch names it "" in pg_config
    verdict = job.diagnose()
    assert verdict.rule == "disagree" and verdict.culprits == [0, 1], verdict.text()
    assert "rank 0 in barrier #3" in verdict.text() and "rank 1 in all_reduce #3" in verdict.text(), verdict.text()
    assert verdict.certainty == distnb.Certainty.LIKELY and "known by Flight Recorder dumps alone" in verdict.reason
    if kind == "pickle":  # the pickle keeps each call's Python frames: the call site in the script
        assert "dumps.py:17" in verdict.text() and "dumps.py:15" in verdict.text(), verdict.text()


@pytest.mark.slow
def test_dumps_alone_with_every_entry_completed_blame_by_sequence_numbers(made: Path, tmp_path: Path) -> None:
    """As NCCL's watchdog leaves them after its abort: every entry "completed", one rank a
    collective short (the real gloo dumps, made NCCL's)."""
    for r in (0, 1):
        dump = pickle.loads((made / "pickle" / f"nccl_trace_rank_{r}").read_bytes())
        dump["entries"] = dump["entries"][:2] if r == 0 else dump["entries"]
        for e in dump["entries"]:
            e["profiling_name"] = "nccl:" + e["profiling_name"].split(":")[-1]
            e["state"] = "completed"
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump))
    verdict = distnb.load(tmp_path).diagnose()
    assert verdict.rule == "seq_blame" and verdict.culprits == [0] and verdict.victims == [1], verdict.text()
    assert "rank 0 never arrived at all_reduce #3 on group 0, which rank 1 issued (rank 0 last #2)" in verdict.text(), verdict.text()
    assert verdict.certainty == distnb.Certainty.LIKELY and "known by Flight Recorder dumps alone" in verdict.text()


@pytest.mark.slow
def test_a_real_torchrun_error_file(made: Path) -> None:
    job = distnb.load(made / "logs")
    verdict = job.diagnose()
    assert verdict.culprits == [1] and verdict.rule == "raised", verdict.text()
    assert "rank 1 raised ValueError: bad batch at step 3" in verdict.text()
    assert "in check() (err.py:6)" in verdict.text(), verdict.text()
    assert "rank 0 left no record" in verdict.text()
    stacks = job.stacks().text()
    assert "err.py:11 in main: check(3)" in stacks and "[torchrun's error file]" in stacks, stacks
    assert job.launch.site == (str(made / "err.py"), 6)


@pytest.mark.slow
def test_the_recorder_in_a_real_group(made: Path) -> None:
    runs = json.loads((made / "runs.json").read_text())
    (rc0, _, err0), (rc1, out1, err1) = runs[3], runs[4]
    assert rc1 == 1, err1  # left in the barrier when rank 0 went: a peer gone
    assert rc0 == 1 and "ValueError: bad batch at step 3" in err0, err0
    # rank 1 waited for rank 0 until its record was written (after=1 s into the wait), then it was removed once it went on.
    writes = int(out1.split("writes=")[1].split()[0])
    assert writes >= 1 and "exists=False" in out1, (out1, err1)
    assert "distnb:" not in err0 + err1  # the recorder never failed
    job = distnb.load(made / "rec" / "records")
    rec = job.dumps.ranks[0].record
    assert rec is not None and rec["reason"] == "exception" and rec["argv"][0] == "recorded.py" and rec["backends"] == ["gloo"]
    assert rec["exception"]["site"][:3] == [str(made / "recorded.py"), 29, "check"]
    verdict = job.diagnose()
    assert verdict.culprits == [0] and verdict.rule == "raised", verdict.text()
    assert "rank 0 raised ValueError: bad batch at step 3" in verdict.text() and "recorded.py:29" in verdict.text()
    # The Flight Recorder's own pickle beside each record, readable by torch's fr_trace's loader.
    from torch.distributed.flight_recorder.components.loader import read_dump

    dump = read_dump("distnb_fr_rank_", str(made / "rec" / "records" / "distnb_fr_rank_0"))
    assert dump["rank"] == 0 and [e["profiling_name"] for e in dump["entries"]][:1] == ["gloo:all_reduce"]


# -- the recorder without torch: the job's own hooks stand ----------------------------------------
HOOKED = """
import sys
from pathlib import Path
from distnb.worker.process.job_records import JobRecorder

if sys.argv[2] == "own-hook":
    def hook(t, v, tb):
        print("the job's own hook ran", file=sys.stderr)
    sys.excepthook = hook
if sys.argv[2] != "plain":
    JobRecorder(0, 1, Path(sys.argv[1])).install()


def step():
    raise KeyError("no such batch")


step()
"""


@pytest.mark.slow
def test_the_excepthook_chains_and_the_output_does_not_change(tmp_path: Path) -> None:
    (tmp_path / "hooked.py").write_text(HOOKED)
    plain, recorded, own = _run_all([([sys.executable, "hooked.py", str(tmp_path / m), m], _env()) for m in ("plain", "recorded", "own-hook")],
                                    tmp_path, 60)
    assert plain.returncode == recorded.returncode == 1
    assert recorded.stderr == plain.stderr and "KeyError: 'no such batch'" in plain.stderr
    assert own.stderr.strip() == "the job's own hook ran"
    for mode in ("recorded", "own-hook"):
        rec = json.loads((tmp_path / mode / "rank0.json").read_text())
        assert rec["exception"]["type"] == "KeyError" and rec["exception"]["site"][1:3] == [15, "step"]
        assert rec["collectives"] == {"unavailable": "the job had not imported torch"}
    assert not (tmp_path / "recorded" / "faulthandler_rank0.txt").exists()  # no fatal signal: no file left


@pytest.mark.slow
def test_a_forked_child_leaves_the_ranks_record_alone(tmp_path: Path) -> None:
    code = ("import os, sys\nfrom pathlib import Path\nfrom distnb.worker.process.job_records import JobRecorder\n"
            "JobRecorder(0, 1, Path(sys.argv[1])).install()\npid = os.fork()\nif pid == 0:\n    raise ValueError('the child')\n"
            "os.waitpid(pid, 0)\nraise KeyError('the rank')\n")
    (tmp_path / "forks.py").write_text(code)
    (run,) = _run_all([([sys.executable, "forks.py", str(tmp_path / "rec")], _env())], tmp_path, 60)
    assert "ValueError: the child" in run.stderr and "KeyError: 'the rank'" in run.stderr  # both printed as Python prints them
    rec = json.loads((tmp_path / "rec" / "rank0.json").read_text())
    assert rec["exception"]["type"] == "KeyError" and rec["pid"] != 0


@pytest.mark.slow
def test_a_fatal_signal_goes_to_faulthandler_only_when_the_job_had_none(tmp_path: Path) -> None:
    code = ("import os, sys\nfrom pathlib import Path\nfrom distnb.worker.process.job_records import JobRecorder\n"
            "JobRecorder(0, 1, Path(sys.argv[1])).install()\n\ndef crash():\n    os.abort()\n\ncrash()\n")
    (tmp_path / "crash.py").write_text(code)
    ours, theirs = _run_all([([sys.executable, "crash.py", str(tmp_path / "ours")], _env()),
                             ([sys.executable, "crash.py", str(tmp_path / "theirs")], _env(PYTHONFAULTHANDLER="1"))], tmp_path, 60)
    assert ours.returncode == theirs.returncode == -6
    assert "Fatal Python error: Aborted" in (tmp_path / "ours" / "faulthandler_rank0.txt").read_text() and not ours.stderr
    assert "Fatal Python error: Aborted" in theirs.stderr and not (tmp_path / "theirs").exists()
    job = distnb.load(tmp_path / "ours")
    assert "rank 0: died: a fatal signal (Fatal Python error: Aborted)" in job.stacks().text()
    assert job.diagnose().culprits == [0]


# -- bad inputs: one line each, saying what to do --------------------------------------------------
def test_a_folder_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(distnb.LoadError) as exc:
        distnb.load(tmp_path / "nope")
    assert f"{tmp_path / 'nope'} does not exist: give the folder the job's records are in" in one_line(exc)


def test_a_folder_with_nothing_readable_lists_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(distnb.LoadError) as exc:
        distnb.load(tmp_path)
    assert "nothing readable in" in one_line(exc) and "looked for distnb's records (rank<N>.json" in one_line(exc)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(distnb.LoadError) as exc:
        distnb.load(tmp_path)
    assert "(1 file skipped: skipped " in one_line(exc) and "notes.txt: not a distnb record, Flight Recorder dump" in one_line(exc)
    assert current_job() is None


@pytest.mark.slow
def test_files_that_are_not_dumps_are_skipped_and_named(made: Path, tmp_path: Path) -> None:
    shutil.copy(made / "pickle" / "nccl_trace_rank_0", tmp_path)
    (tmp_path / "nccl_trace_rank_1").write_bytes(os.urandom(64))
    (tmp_path / "nccl_trace_rank_2").write_bytes(pickle.dumps(Path("/")))  # a pickle naming a class: never loaded
    (tmp_path / "trace_without_rank").write_bytes((made / "pickle" / "nccl_trace_rank_0").read_bytes())
    job = distnb.load(tmp_path)
    notes = "\n".join(job.dumps.notes)
    assert f"skipped {tmp_path / 'nccl_trace_rank_1'}: not a distnb record" in notes
    assert "nccl_trace_rank_2: a pickle that is not a Flight Recorder dump (it names a class (pathlib.PosixPath)" in notes
    assert "trace_without_rank: a Flight Recorder dump whose name does not end in its rank" in notes
    assert all("\n" not in n for n in job.dumps.notes) and sorted(job.dumps.ranks) == [0]
    assert "skipped" in job.status().text()


@pytest.mark.slow
def test_a_dump_from_another_torch_version_is_read_as_far_as_it_goes(made: Path, tmp_path: Path) -> None:
    dump = pickle.loads((made / "pickle" / "nccl_trace_rank_1").read_bytes())
    dump["version"] = "2.1"
    for e in dump["entries"]:
        del e["input_dtypes"], e["is_p2p"]
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps(dump))
    job = distnb.load(tmp_path)
    assert any("a Flight Recorder dump of version 2.1 (this torch writes 2.10) without input_dtypes, is_p2p: read what it has" in n
               for n in job.dumps.notes), job.dumps.notes
    assert [e["op"] for e in job._log.sequence(1, "0")] == ["all_reduce"] * 3


@pytest.mark.slow
def test_a_partial_set_of_ranks_names_the_missing(made: Path, tmp_path: Path) -> None:
    shutil.copy(made / "pickle" / "nccl_trace_rank_1", tmp_path)
    job = distnb.load(tmp_path)
    assert job.missing == [0]
    text = job.diagnose().text()
    assert "rank 0 left no record" in text, text
    assert "rank 0: pid ?, no record" in job.status().text()


@pytest.mark.slow
def test_two_dumps_for_one_rank_newest_wins(made: Path, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(made / "pickle" / "nccl_trace_rank_0", tmp_path / "a")
    shutil.copy(made / "pickle" / "nccl_trace_rank_0", tmp_path / "b" / "other_rank_0")
    old = time.time() - 100
    os.utime(tmp_path / "a" / "nccl_trace_rank_0", (old, old))
    dumps = read_job_dumps([str(tmp_path / "a"), str(tmp_path / "b")])
    assert dumps.notes == [f"two Flight Recorder dumps for rank 0: {tmp_path / 'b' / 'other_rank_0'} (newest) read, "
                           f"{tmp_path / 'a' / 'nccl_trace_rank_0'} left out"]


@pytest.mark.slow
def test_several_folders_one_per_machine(made: Path) -> None:
    job = distnb.load([str(made / "pickle"), str(made / "logs")])
    assert sorted(job.dumps.ranks) == [0, 1] and job.dumps.ranks[1].error is not None and job.dumps.ranks[1].fr is not None
    assert job.diagnose().culprits == [1]


@pytest.mark.slow
def test_error_files_of_several_machines_name_local_ranks_only_and_say_so(made: Path, tmp_path: Path) -> None:
    """Two machines' torchrun logs (each machine's local rank 1 raised): torchrun names only the
    local rank, so "rank 1" is a guess the verdict must not state as certain."""
    import shutil

    for machine in ("node-a", "node-b"):
        shutil.copytree(made / "logs", tmp_path / machine / "logs")
    job = distnb.load(tmp_path)
    verdict = job.diagnose()
    assert verdict.culprits == [1] and verdict.certainty.value == "likely", verdict.text()
    assert "rank 1 is a local rank read from torchrun's error files of several machines" in verdict.text(), verdict.text()
    assert any("taken as rank 1, its local rank" in n for n in job.dumps.notes), job.dumps.notes
    # One machine's logs alone: its local rank is its rank, as before — restarts included (a
    # second attempt under the same run folder is the same machine).
    assert distnb.load(made / "logs").diagnose().certainty.value == "certain"
    shutil.copytree(made / "logs", tmp_path / "restarted")
    shutil.copytree(tmp_path / "restarted" / "run_1" / "attempt_0", tmp_path / "restarted" / "run_1" / "attempt_1")
    again = distnb.load(tmp_path / "restarted")
    assert again.diagnose().certainty.value == "certain" and not again.dumps.guessed, again.dumps.notes


# -- %dist_load ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dist_load_and_the_read_only_magics(made: Path) -> None:
    from IPython.core.error import UsageError
    from magic_shell import Shell

    from distnb.jobs import pools

    shell = Shell()
    pools.set_current(None)  # a shared pool an earlier module started is "current"; the launch below must meet the loaded job
    value, _, _ = shell.line("dist_load", str(made / "rec" / "records"))
    text = repr(value)
    assert text.startswith(f"loaded job {made.name}") or "loaded job" in text, text
    assert "rank 0 raised ValueError: bad batch at step 3" in text, text
    value, _, _ = shell.line("dist_stacks")
    assert "recorded.py:29 in check" in repr(value), repr(value)
    value, _, _ = shell.line("dist_collectives")
    assert "all_reduce" in repr(value)
    _, out, _ = shell.line("dist_timeline", "--no-plot")
    assert "group 0" in out or "rank" in out, out
    value, _, _ = shell.line("dist_env")
    assert "environment of ranks 0,1" in repr(value) and "OMP_NUM_THREADS      1" in repr(value), repr(value)
    _, out, _ = shell.line("dist_status")
    assert "loaded job" in out and "raised ValueError" in out, out
    _, out, _ = shell.line("dist_memory")
    assert "rank" in out, out
    with pytest.raises(UsageError, match="looking into the records of job .* read-only"):
        shell.ip.run_cell_magic("on_ranks", "", "x = 1")
    with pytest.raises(UsageError, match="%dist_detach first, then launch a pool"):
        shell.ip.run_line_magic("dist_launch", "-n 2")
    _, out, _ = shell.line("dist_detach")
    assert "left the loaded job" in out and current_job() is None
    with pytest.raises(UsageError) as exc:
        shell.ip.run_line_magic("dist_load", str(made / "missing"))
    assert "does not exist" in str(exc.value) and "\n" not in str(exc.value)


def test_the_wrapper_names_the_records_and_leaves_no_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from distnb.launching.attach_run import _forget_job, _say_records

    records = tmp_path / "jobs" / "j" / "records"
    records.mkdir(parents=True)
    (records / "faulthandler_rank0.txt").write_text("")  # a rank killed before its exit removed it
    env = {"DISTNB_JOBS_DIR": str(tmp_path / "jobs"), "DISTNB_JOB_ID": "j"}
    _say_records(env)
    assert not records.exists() and capsys.readouterr().err == ""
    records.mkdir()
    (records / "rank2.json").write_text("{}")
    (records / "rank0.json").write_text("{}")
    _say_records(env)
    err = capsys.readouterr().err
    assert err == f"distnb: ranks 0,2 left records in {records}: %dist_load {records} in a notebook (distnb.load({str(records)!r})) explains how it ended.\n"
    monkeypatch.setenv("DISTNB_JOBS_DIR", str(tmp_path / "jobs"))
    _forget_job("j")  # the job's folder goes only when empty: its records stay
    assert (records / "rank0.json").exists()
