"""The attachable jobs of other machines (``%dist_attach --hosts``, ``--slurm``): each machine's
discovery files, listed there by ``python -m distnb jobs --json`` and read here over ssh (as
``%dist_launch --hosts`` starts its node agents: ``DISTNB_SSH`` replaces the client) or, inside
a Slurm allocation, by one srun step on every node (``DISTNB_SRUN`` adds what the cluster needs).

The listing carries each rank's keys: it travels over ssh or srun, read by the user who may read
the files. A machine that cannot be read is named with why; the others are still used.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from distnb.wire.discovery import JobFiles, jobs_from_json, listed_by

__all__ = ["LIST_TIMEOUT", "jobs_in_allocation", "jobs_on", "list_command", "merge_jobs", "slurm_command"]

#: How long reading one machine's listing may take (ssh's own connection, Python's start).
LIST_TIMEOUT = 30.0


def list_command(python: str | None = None) -> list[str]:
    """What runs on the other machine: its distnb listing this machine's jobs as JSON."""
    return [python or os.environ.get("DISTNB_NODE_PYTHON") or sys.executable, "-m", "distnb", "jobs", "--json"]


def slurm_command(python: str | None = None) -> list[str]:
    """One listing per node of the current allocation (a step that shares the job's nodes)."""
    srun = shlex.split(os.environ.get("DISTNB_SRUN", "srun"))
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return [*srun, "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *list_command(python)]


def _over_ssh(host: str, python: str | None) -> tuple[list[JobFiles], str]:
    ssh = shlex.split(os.environ.get("DISTNB_SSH", "ssh"))
    try:
        done = subprocess.run([*ssh, "-o", "BatchMode=yes", host, shlex.join(list_command(python))], capture_output=True, text=True,
                              timeout=LIST_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [], f"no listing within {LIST_TIMEOUT:g} s (ssh {host} hangs: check it answers, e.g. ssh {host} true)"
    except OSError as exc:
        return [], f"cannot run ssh: {exc.strerror or exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return [], f"ssh {host} failed: {last}"
    try:
        return jobs_from_json(done.stdout.strip().splitlines()[-1], host), ""
    except ValueError as exc:
        return [], str(exc)


def jobs_on(hosts: list[str], python: str | None = None) -> tuple[list[JobFiles], dict[str, str]]:
    """The jobs listed on each of ``hosts`` over ssh, and why each machine that gave none failed."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        results = list(pool.map(lambda h: _over_ssh(h, python), hosts))
    jobs = [j for found, _ in results for j in found]
    return jobs, {h: why for h, (_, why) in zip(hosts, results) if why}


def jobs_in_allocation(python: str | None = None) -> tuple[list[JobFiles], dict[str, str]]:
    """The jobs listed on every node of the current Slurm allocation (one srun step), each node
    named as it names itself."""
    if "SLURM_JOB_ID" not in os.environ:
        return [], {"slurm": "not inside a Slurm allocation (no SLURM_JOB_ID): run the notebook in the job's allocation, or name the hosts"}
    try:
        done = subprocess.run(slurm_command(python), capture_output=True, text=True, timeout=LIST_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [], {"slurm": f"srun gave no listing within {LIST_TIMEOUT:g} s (the allocation's nodes busy, or srun waiting for resources)"}
    except OSError as exc:
        return [], {"slurm": f"cannot run srun: {exc.strerror or exc}"}
    jobs, why = [], {}
    here = socket.gethostname()
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            try:
                listed = jobs_from_json(line)
            except ValueError as exc:
                why["slurm"] = str(exc)
                continue
            if listed_by(line) != here:  # this machine's own node: its files are read here, as this machine's
                jobs += listed
    if done.returncode != 0 and not jobs:
        why["slurm"] = f"srun failed: {(done.stderr.strip().splitlines() or [f'exit status {done.returncode}'])[-1]}"
    return jobs, why


def merge_jobs(listings: list[JobFiles]) -> list[JobFiles]:
    """One job per id across machines: each machine holds the files of its own ranks."""
    out: dict[str, JobFiles] = {}
    for j in listings:
        held = out.get(j.job)
        if held is None:
            out[j.job] = JobFiles(j.job, j.folder, dict(j.ranks), dict(j.stale))
            continue
        held.ranks.update(j.ranks)
        held.stale.update({r: e for r, e in j.stale.items() if r not in held.ranks})
        held.folder = held.folder if j.folder in held.folder else f"{held.folder}, {j.folder}"
    return list(out.values())
