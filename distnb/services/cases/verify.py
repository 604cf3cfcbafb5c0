"""Run an exported script under torchrun, as the pool ran its cells, and say whether it fails the
way the session did (analysis/verdicts/reproduction.py) — never "the same way" unseen.

The script runs here, bounded in time, with the pool's world size and backend, each rank's output
in its own file (torchrun's ``--redirects 3 --log-dir``). A rank's own error is the exception its
output ends with; a rank killed by a signal died; a rank torchrun stopped because another failed
did neither (a consequence). When the bound passes, the ranks that had not reached the end (each
rank marks it at exit, ``DISTNB_VERIFY_DIR``) hung.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from distnb import _processes
from distnb.analysis.verdicts.failures import is_timeout
from distnb.analysis.verdicts.reproduction import DIED, FailureSignature, compare_failures, last_exception
from distnb.config import LaunchConfig
from distnb.controller.session import CellRecord
from distnb.results import CellResult
from distnb.states import CellStatus

__all__ = ["GAVE_UP", "VERIFY_SECONDS", "Reproduction", "session_signature", "verify_script"]

#: How long %dist_export lets the script run by default: a failure that raises shows within it;
#: a hang ends by its own collective timeout (export.HANG_TIMEOUT, 30 s) within it, or reproduces
#: by still running when it passes.
VERIFY_SECONDS = 75.0
#: What a finished rank of an exported script prints when it stops waiting for the others
#: (services/cases/export.py): the ones that had not finished hung, and their closed connections after
#: it left are its consequence.
GAVE_UP = "other ranks still had not after"

#: torchrun's closing report names each failed rank and its exit code.
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class Reproduction:
    """What running the script showed: ``reproduced`` only when its failure's signature is the
    session's; else ``why`` says what differed, or why it could not run here."""

    reproduced: bool
    ran: bool
    session: FailureSignature
    script: FailureSignature | None
    seconds: float
    why: str = ""

    def text(self) -> str:
        if not self.ran:
            return f"not verified: {self.why}"
        if self.reproduced:
            return f"verified: running it under torchrun reproduced the failure ({self.session.text()}) in {self.seconds:.1f} s"
        return (f"NOT reproduced: under torchrun the script gave {self.script.text() if self.script else 'nothing'}, the session "
                f"{self.session.text()} ({self.why}). Export more cells (--cells, --all) or check what the notebook set up outside them.")


def session_signature(cell: CellResult | CellRecord) -> FailureSignature | None:
    """The failure of the session's last exported cell, as a signature (None: only a record of it
    is kept, its errors let go)."""
    if not isinstance(cell, CellResult):
        return None
    errors = {}
    for r, res in cell.results.items():
        if res.status == CellStatus.DEAD:
            errors[r] = DIED
        elif res.status == CellStatus.ERROR and res.error:
            errors[r] = f"{res.error.get('ename', 'Error')}: {res.error.get('evalue', '')}"
    return FailureSignature.of(errors, cell.running if cell.timed_out else [])


def cannot_run_here(config: LaunchConfig) -> str:
    """Why this machine can't run the script as the pool ran it; "" when it can."""
    if config.nnodes > 1 and not config.local_nodes:
        return f"the pool spans {config.nnodes} machines; run it there with the command above"
    if config.backend == "nccl" or (config.backend == "auto" and _cuda_count() > 0):
        have = _cuda_count()
        if have < config.world_size and not config.share_gpus:
            return f"it needs {config.world_size} GPUs for NCCL and this machine has {have}"
    return ""


def _cuda_count() -> int:
    torch = sys.modules.get("torch")
    try:
        return int(torch.cuda.device_count()) if torch is not None else 0
    except Exception:
        return 0


def verify_script(path: str | Path, config: LaunchConfig, session: FailureSignature, timeout: float) -> Reproduction:
    """Run the script at ``path`` under torchrun for at most ``timeout`` seconds and compare its
    failure with ``session``'s."""
    why = cannot_run_here(config)
    if why:
        return Reproduction(False, False, session, None, 0.0, why)
    with tempfile.TemporaryDirectory(prefix="distnb-verify-") as work:
        logs, marks = Path(work, "logs"), Path(work, "done")
        marks.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(config.world_size),
               "--redirects", "3", "--log-dir", str(logs), "--monitor-interval", "0.5", str(Path(path).resolve())]
        env = {**os.environ, "DISTNB_VERIFY_DIR": str(marks), "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=str(Path(path).resolve().parent), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        ran_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            ran_out = True
            _stop(proc)
            out, _ = proc.communicate()
        seconds = time.monotonic() - t0
        finished = {r for r in range(config.world_size) if (marks / f"rank{r}.done").exists()}
        script = _signature(logs, out.decode(errors="replace"), config.world_size, finished, ran_out)
    differs = compare_failures(session, script)
    return Reproduction(not differs, True, session, script, seconds, differs)


def _signature(logs: Path, torchrun_out: str, world: int, finished: set[int], ran_out: bool) -> FailureSignature:
    """The run's failure. When the bound ran out (``ran_out``), the ranks that had not finished
    hung. A rank whose collective timed out hung (the script's own timeout ended the hang); once one
    did, or a finished rank stopped waiting for the others, a rank that neither finished nor failed
    of its own was hung too (torchrun stopped it when the first timed out). Otherwise such a rank
    is a consequence."""
    hung = [r for r in range(world) if r not in finished] if ran_out else []
    errors: dict[int, str] = {}
    for r in range(world):
        found = sorted(logs.glob(f"**/attempt_*/{r}/stderr.log"))
        text = found[-1].read_text(errors="replace") if found else ""
        exc = last_exception(text)
        if exc is not None:
            errors[r] = exc
    for rank, code in _FAILED_RANK.findall(torchrun_out):
        if int(code) < 0 and int(rank) not in errors and int(code) != -signal.SIGTERM:
            errors[int(rank)] = DIED  # killed by a signal of its own (not torchrun's SIGTERM after another failed)
    timed_out = {r for r, e in errors.items() if is_timeout(e)}
    # A finished rank that stopped waiting for the others (the script's last wait) saw them hang:
    # their closed connections after it left are its consequence, not a failure of their own.
    gave_up = any(GAVE_UP in p.read_text(errors="replace") for p in logs.glob("**/attempt_*/*/stdout.log"))
    if timed_out or gave_up:
        own = FailureSignature.of(errors).errors
        hung = sorted(set(hung) | timed_out | {r for r in range(world) if r not in finished and r not in own})
    return FailureSignature.of({r: e for r, e in errors.items() if r not in hung}, hung)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """torchrun and every rank it started (one session, started for this run), by PID."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _processes.session_pids(proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=5.0)
            if not _processes.session_pids(proc.pid):
                return
        except subprocess.TimeoutExpired:
            pass
