"""torchrun jobs on this machine that were not started with distnb, found from the process tree.

torchrun gives every worker it starts ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``TORCHELASTIC_RUN_ID`` (torch/distributed/elastic/agent/
server/local_elastic_agent.py); a job is the workers that share a run id and an agent (their
parent). Nothing in the job is asked or changed: /proc is read, as ``ps`` does. A pool's own
ranks (``distnb.worker``) and an attachable job's (``DISTNB_ATTACH=1``) are left out: the pool,
and the job's control threads, are their view.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from distnb import _processes

__all__ = ["BareJobFiles", "BareRank", "bare_job_of", "find_bare_jobs", "script_argv", "unreadable_note"]

#: The variables torchrun sets on each worker that a job is found by.
_NEEDED = (b"RANK", b"WORLD_SIZE", b"TORCHELASTIC_RUN_ID")
#: Processes of distnb's own pools: never a job to attach to.
_OURS = (b"distnb.worker", b"distnb.node")


@dataclass(frozen=True)
class BareRank:
    """One worker of a job, as /proc shows it."""

    rank: int
    pid: int
    local_rank: int
    argv: tuple[str, ...]  # the worker's command line: the interpreter, its options, the script, its arguments
    cwd: str
    env: dict[str, str]
    started: float  # seconds since the epoch


@dataclass
class BareJobFiles:
    """A job found on this machine: its agent (torchrun), run id, world size and the ranks here."""

    agent: int  # the workers' parent: torchrun's agent process
    run_id: str
    world_size: int
    ranks: dict[int, BareRank]

    @property
    def job(self) -> str:
        """``torchrun-81234``: named by its agent's pid (torchrun's run id is often the default, "none")."""
        return f"torchrun-{self.agent}"

    @property
    def here(self) -> bool:
        """Whether every rank of the job runs on this machine (one node)."""
        first = next(iter(self.ranks.values()), None)
        return first is not None and first.env.get("LOCAL_WORLD_SIZE") == str(self.world_size)

    def line(self) -> str:
        """``torchrun-81234: 4 ranks here of 4, train.py (%dist_attach --pid 81234)``."""
        script = next(iter(script_argv(next(iter(self.ranks.values())))), "?") if self.ranks else "?"
        here = f"{len(self.ranks)} rank{'' if len(self.ranks) == 1 else 's'} here"
        return (f"{self.job}: {here} of {self.world_size}, {os.path.basename(script)} "
                f"(%dist_attach --pid {self.agent})")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _environ(raw: bytes) -> dict[str, str]:
    """A process's environment from its /proc/PID/environ bytes."""
    out = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _worker(pid: int) -> tuple[int, BareRank, str, int] | None:
    """(agent pid, rank, run id, world size) of a torchrun worker; None for any other process."""
    cmdline = _read(f"/proc/{pid}/cmdline")
    if not cmdline or any(m in cmdline for m in _OURS):
        return None
    raw = _read(f"/proc/{pid}/environ")
    if raw is None or not all(b"\0" + k + b"=" in b"\0" + raw for k in _NEEDED):
        return None
    env = _environ(raw)
    if env.get("DISTNB_ATTACH") == "1":
        return None  # made attachable (python -m distnb run): its control thread is the way in
    fields = _processes._stat_fields(pid)
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        return None
    if fields is None:
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = ""
    argv = tuple(a.decode(errors="replace") for a in cmdline.rstrip(b"\0").split(b"\0"))
    started = _started(pid)
    return int(fields[1]), BareRank(rank, pid, local, argv, cwd, env, started), env["TORCHELASTIC_RUN_ID"], world


def _started(pid: int) -> float:
    """When ``pid`` started, in seconds since the epoch (its start time in ticks since boot)."""
    return _boot_time() + (_processes.start_time(pid) or 0) / os.sysconf("SC_CLK_TCK")


@functools.cache
def _boot_time() -> float:
    """When this machine booted, in seconds since the epoch (/proc/stat's btime): read once."""
    stat = _read("/proc/stat") or b""
    return next((float(line.split()[1]) for line in stat.splitlines() if line.startswith(b"btime ")), 0.0)


def find_bare_jobs() -> list[BareJobFiles]:
    """Every torchrun job on this machine whose workers this user may read, by agent."""
    jobs: dict[tuple[int, str], BareJobFiles] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        found = _worker(int(name))
        if found is None:
            continue
        agent, rank, run_id, world = found
        job = jobs.setdefault((agent, run_id), BareJobFiles(agent, run_id, world, {}))
        job.ranks[rank.rank] = rank
    return sorted(jobs.values(), key=lambda j: j.agent)


def bare_job_of(pid: int) -> BareJobFiles | None:
    """The job ``pid`` belongs to: as its agent (torchrun) or as one of its ranks."""
    for job in find_bare_jobs():
        if pid == job.agent or any(r.pid == pid for r in job.ranks.values()):
            return job
    return None


def unreadable_note(pid: int) -> str:
    """Why ``pid`` is not a job's process this user can read, in words."""
    if not _processes.pid_alive(pid):
        return f"there is no process {pid} on this machine"
    if _read(f"/proc/{pid}/environ") is None:
        return (f"process {pid}'s environment can't be read by this user (another user's process): run the notebook as the "
                "job's user, or as root")
    return (f"process {pid} is neither a torchrun agent (no worker of a torchrun job is its child) nor a worker (it has no RANK, "
            "WORLD_SIZE and TORCHELASTIC_RUN_ID in its environment); give the pid of torchrun or of a rank (ps -ef | grep torchrun)")


def _script_args(argv: tuple[str, ...]) -> list[str]:
    """The script and its arguments from a worker's command line: past the interpreter and its
    options (``python -u train.py --lr 3``); ``-m module`` keeps the module's name first."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return list(argv[i + 1 :])
        if arg in ("-X", "-W", "-Q"):
            i += 2
            continue
        if arg.startswith("-") and arg != "-":
            i += 1
            continue
        return list(argv[i:])
    return []


def script_argv(rank: BareRank) -> tuple[str, ...]:
    """The worker's ``sys.argv`` as its script saw it (the script first)."""
    return tuple(_script_args(rank.argv))
