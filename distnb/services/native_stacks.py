"""Native frames of the ranks on this machine, through py-spy (``%dist_stacks --native``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NATIVE_TIMEOUT", "py_spy_dumps", "py_spy_path", "py_spy_runs"]

#: How long py-spy may take for all ranks together. A native dump of a process with torch loaded
#: reads the symbols of libtorch (hundreds of MB) first: 1-3 s of CPU each, measured on this
#: project's 2-core machine, and several at once on a machine busy with other work take a
#: multiple of that. A dump that takes longer is reported as such, never waited for in silence.
NATIVE_TIMEOUT = 30.0

_PTRACE_HINT = (
    "py-spy may not attach to the rank: it needs ptrace permission over it. Run Jupyter as the ranks' own "
    "user with kernel.yama.ptrace_scope 0 (sysctl -w kernel.yama.ptrace_scope=0), or give py-spy the "
    "CAP_SYS_PTRACE capability (in a container: --cap-add SYS_PTRACE)."
)


def py_spy_path() -> str | None:
    """py-spy's executable: the one installed beside this Python (``pip install distnb[native]`` in
    a virtual environment whose bin/ is not on PATH, as when Jupyter is started by its full path),
    else the first on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def py_spy_dumps(pids: dict[int, int], timeout: float = NATIVE_TIMEOUT) -> dict[int, str]:
    """Native + Python frames of each rank (``{rank: pid}``) through py-spy, all ranks at once,
    when it is installed (``pip install distnb[native]``)."""
    return {r: text.strip() for r, (_gave, text) in py_spy_runs(pids, ["--native"], timeout).items()}


def py_spy_runs(pids: dict[int, int], options: list[str], timeout: float) -> dict[int, tuple[bool, str]]:
    """``py-spy dump OPTIONS --pid PID`` for each rank (``{rank: pid}``), all at once: per rank,
    whether it gave its dump, and the dump or why not in words (py-spy missing, too slow, no
    ptrace permission: what to change)."""
    exe = py_spy_path()
    if exe is None:
        return {r: (False, "py-spy is not installed; `pip install py-spy` (or distnb[native]) for native frames.") for r in pids}
    procs = {r: subprocess.Popen([exe, "dump", *options, "--pid", str(pid)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for r, pid in pids.items()}
    deadline = time.monotonic() + timeout
    out = {}
    for r, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[r] = (False, f"py-spy did not finish within {timeout:g} s.")
            continue
        if proc.returncode == 0:
            out[r] = (True, stdout)
            continue
        text = (stderr or stdout).strip().split("\nStack backtrace:")[0].strip()
        if any(w in stderr for w in ("ermission", "ptrace", "not permitted")):
            text += "\n" + _PTRACE_HINT
        out[r] = (False, text)
    return out
