"""``python -m distnb run -- torchrun … train.py``: run a job, unchanged, with attachable ranks.

The command runs with ``DISTNB_ATTACH=1``, a ``DISTNB_JOB_ID`` of its own and, first on
``PYTHONPATH``, a folder holding a ``sitecustomize.py`` that starts each rank's attachable control
thread (``worker/process/attachable.py``) and then loads the user's own ``sitecustomize``, if any.
The wrapper forwards SIGINT/SIGTERM to the command, exits with its exit status and removes the
folder. Launchers that cannot be wrapped (Slurm scripts, Kubernetes) set ``DISTNB_ATTACH=1`` in an
environment where ``python -m distnb run --install-hook`` put ``distnb-attach.pth`` into
site-packages (inert without the variable), or put the folder ``--write-site DIR`` fills first on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from types import FrameType
from typing import Any, Callable

__all__ = ["PTH_LINE", "SITECUSTOMIZE", "attach_env", "install_hook", "run", "write_site"]

#: The start-up hook: start the control thread, then hand over to the next sitecustomize on the path.
SITECUSTOMIZE = '''"""distnb's start-up hook for attachable jobs (python -m distnb run)."""
import os as _os
import sys as _sys

if _os.environ.get("DISTNB_ATTACH") == "1" and "RANK" in _os.environ:  # a rank (torchrun's agent has no RANK)
    try:
        from distnb.worker.process.attachable import maybe_start as _start
        _start()
    except Exception as _exc:  # the job comes first
        print(f"distnb: this rank is not attachable: {type(_exc).__name__}: {_exc}", file=_sys.stderr, flush=True)

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_me = _sys.modules.pop("sitecustomize", None)
try:
    import sitecustomize  # noqa: F401  (the user's own, when there is one)
except ImportError:
    pass
if _me is not None:  # the import machinery looks this module up once it has run
    _sys.modules.setdefault("sitecustomize", _me)
'''


#: The same hook as one line of a ``.pth`` file in site-packages (``python -m distnb run
#: --install-hook``): every interpreter of that environment reads it at start-up, and it does
#: nothing unless ``DISTNB_ATTACH=1`` — for launchers that cannot be wrapped (Slurm, Kubernetes).
PTH_LINE = ('import os; os.environ.get("DISTNB_ATTACH") == "1" and '
            '__import__("distnb.worker.process.attachable", fromlist=["maybe_start"]).maybe_start()\n')
PTH_NAME = "distnb-attach.pth"


def install_hook(folder: str | Path | None = None, remove: bool = False) -> str:
    """Write (or with ``remove``, delete) ``distnb-attach.pth`` in ``folder`` (default: this
    interpreter's site-packages); returns its path."""
    import sysconfig

    path = Path(folder or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if remove:
        path.unlink(missing_ok=True)
    else:
        path.write_text(PTH_LINE)
    return str(path)


def write_site(folder: str | Path) -> str:
    """Write the hook into ``folder`` (made if needed); returns the folder."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(path)


def attach_env(site: str, env: dict[str, str] | None = None, job_id: str | None = None) -> dict[str, str]:
    """``env`` (default: this process's) made attachable: the switch, a job id, the hook and this
    distnb first on ``PYTHONPATH``."""
    out = dict(os.environ if env is None else env)
    out["DISTNB_ATTACH"] = "1"
    from distnb.wire.discovery import job_id_from_env

    # As the ranks will name their folder (a path-safe name), so the id printed is the one to attach to.
    out["DISTNB_JOB_ID"] = job_id_from_env({"DISTNB_JOB_ID": job_id or out.get("DISTNB_JOB_ID") or f"run-{uuid.uuid4().hex[:8]}"})
    package_parent = str(Path(__file__).resolve().parents[2])
    paths = [site, package_parent, *[p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out


#: Started with the job, given its process and environment; returns how to stop it (the job watch,
#: ``jobs/watch.py``, which this layer does not import).
Watcher = Callable[["subprocess.Popen[Any]", dict[str, str]], Callable[[], None]]


def run(command: list[str], job_id: str | None = None, watcher: Watcher | None = None) -> int:
    """Run ``command`` attachable; its exit status (128 + signal when a signal ended it).
    ``watcher`` is started on it once it runs, and stopped when it ends."""
    if not command:
        print("distnb run: give the command to run after --, e.g. python -m distnb run -- torchrun --nproc-per-node 4 train.py",
              file=sys.stderr)
        return 2
    site = write_site(tempfile.mkdtemp(prefix="distnb-site-"))
    env = attach_env(site, job_id=job_id)
    try:
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"distnb run: cannot start {command[0]!r}: {exc.strerror or exc}; check the command after --.", file=sys.stderr)
            return 127
        print(f"distnb: job {env['DISTNB_JOB_ID']} is attachable (%dist_attach {env['DISTNB_JOB_ID']} in a notebook on this machine)",
              file=sys.stderr, flush=True)

        def forward(signum: int, frame: FrameType | None) -> None:
            proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        stop_watch = watcher(proc, env) if watcher is not None else None
        try:
            rc = proc.wait()
        finally:
            if stop_watch is not None:
                stop_watch()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 128 - rc if rc < 0 else rc
    finally:
        shutil.rmtree(site, ignore_errors=True)
        _say_records(env)
        _forget_job(env["DISTNB_JOB_ID"])


def _say_records(env: dict[str, str]) -> None:
    """At the job's end: one line naming the records its ranks left (``%dist_load``), if any; an
    empty records folder (faulthandler files of ranks that met no fatal signal) is removed."""
    from distnb.wire.job_dumps import FAULT_PREFIX, records_dir

    folder = records_dir(env)
    try:
        for f in folder.glob(f"{FAULT_PREFIX}*.txt"):
            if f.stat().st_size == 0:  # a rank killed before its exit could remove it
                f.unlink(missing_ok=True)
        left = sorted(p.name for p in folder.iterdir())
    except OSError:
        return
    if not left:
        try:
            folder.rmdir()
        except OSError:
            pass
        return
    ranks = sorted({int(n[4:-5]) for n in left if n.startswith("rank") and n.endswith(".json") and n[4:-5].isdigit()})
    who = f"ranks {','.join(map(str, ranks))} left records" if ranks else "the job left records"
    print(f"distnb: {who} in {folder}: %dist_load {folder} in a notebook (distnb.load({str(folder)!r})) explains how it ended.",
          file=sys.stderr, flush=True)


def _forget_job(job_id: str) -> None:
    """Once the command ended: its ranks' discovery files whose processes are gone (a rank killed
    never removed its own), and the job's folder when nothing is left in it — never its records
    folder (``%dist_load`` reads it; the folder then stays)."""
    from distnb.wire.discovery import jobs_root, list_jobs

    for files in list_jobs():
        if files.job == job_id:
            for e in files.stale.values():
                Path(e.path).unlink(missing_ok=True)
    try:
        (jobs_root() / job_id).rmdir()
    except OSError:
        pass  # a rank still runs (or never published): its file stays
