"""Where an attachable job's ranks listen: one discovery file per rank, written by the rank
(``worker/process/attachable.py``), read by ``%dist_attach`` (``distnb/attached.py``).

``$TMPDIR/distnb-jobs/<job id>/rank<N>.json`` (the folders 0700, the files 0600: each holds the
key that signs the frames its rank accepts). A file whose process is gone is stale: listing the
jobs says so rather than offering it. Each machine lists only the files it wrote, so a folder shared
by several (``DISTNB_JOBS_DIR`` on a shared home) works as one per machine.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "JobFiles", "RankEndpoint", "job_id_from_env", "jobs_from_json", "jobs_json", "jobs_root", "list_jobs", "listed_by", "read_endpoint",
           "write_endpoint"]

FORMAT = "distnb-attach-1"


@dataclass(frozen=True)
class RankEndpoint:
    """One rank of an attachable job, as its discovery file says."""

    job: str
    rank: int
    world_size: int
    pid: int
    host: str
    port: int
    key: bytes
    started: float  # the rank's wall clock when it wrote the file
    path: str = ""
    #: The rank's own command line (``sys.argv``: the script and its arguments) and working
    #: folder: what ``%dist_reproduce`` needs to turn the job into a notebook.
    argv: tuple[str, ...] = ()
    cwd: str = ""
    #: A rank listening on an address other machines reach also serves CURVE: what a notebook
    #: needs to connect (``Credentials.dumps``: the key, the server's public key, a client pair).
    creds: str = ""
    #: The machine the file was read on, over ssh ("" this one): its process can't be asked here.
    machine: str = ""
    #: The name of the machine that wrote it (``socket.gethostname()``): in a folder several
    #: machines share (a home on NFS), a file from another machine is listed there, not here —
    #: its pid means nothing on this one. "" in files written before it was recorded.
    node: str = ""

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def alive(self) -> bool:
        """Whether the process that wrote the file still runs (signal 0; EPERM means it does); a
        file read on another machine was judged there."""
        if self.machine:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass
class JobFiles:
    """The discovery files of one job: the ranks that published, and the stale ones."""

    job: str
    folder: str
    ranks: dict[int, RankEndpoint]
    stale: dict[int, RankEndpoint]

    @property
    def world_size(self) -> int:
        sizes = [e.world_size for e in (*self.ranks.values(), *self.stale.values())]
        return max(sizes, default=0)

    def line(self) -> str:
        """The job in one line, as ``%dist_attach`` lists it."""
        pids = ",".join(str(e.pid) for _, e in sorted(self.ranks.items()))
        extra = f", {len(self.stale)} stale" if self.stale else ""
        return f"{self.job}: {len(self.ranks)}/{self.world_size} ranks alive{extra} (pids {pids or 'none'})"


def jobs_root() -> Path:
    """``$DISTNB_JOBS_DIR``, else ``$TMPDIR/distnb-jobs``."""
    return Path(os.environ.get("DISTNB_JOBS_DIR") or os.path.join(tempfile.gettempdir(), "distnb-jobs"))


def job_id_from_env(env: dict[str, str] | None = None) -> str:
    """The job's id, the same on every rank: ``DISTNB_JOB_ID`` (set by ``python -m distnb run``),
    else Slurm's job id, else torchrun's run id unless it is its default ``none``, else the
    rendezvous' master port."""
    env = dict(os.environ) if env is None else env
    if env.get("DISTNB_JOB_ID"):
        return _safe(env["DISTNB_JOB_ID"])
    if env.get("SLURM_JOB_ID"):
        return _safe(f"slurm-{env['SLURM_JOB_ID']}")
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id and run_id != "none":
        return _safe(f"torchrun-{run_id}")
    return _safe(f"port-{env.get('MASTER_PORT', 'unknown')}")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100] or "job"


def _data(endpoint: RankEndpoint) -> dict[str, object]:
    return {"format": FORMAT, "job": endpoint.job, "rank": endpoint.rank, "world_size": endpoint.world_size, "pid": endpoint.pid,
            "host": endpoint.host, "port": endpoint.port, "key": endpoint.key.hex(), "started": endpoint.started,
            "argv": list(endpoint.argv), "cwd": endpoint.cwd, "creds": endpoint.creds, "node": endpoint.node}


def _endpoint(data: dict[str, object], path: str, machine: str = "") -> RankEndpoint:
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
    d: dict[str, Any] = dict(data)
    return RankEndpoint(str(d["job"]), int(d["rank"]), int(d["world_size"]), int(d["pid"]), str(d["host"]), int(d["port"]),
                        bytes.fromhex(d["key"]), float(d["started"]), path, tuple(str(a) for a in d.get("argv", [])),
                        str(d.get("cwd", "")), str(d.get("creds", "")), machine, str(d.get("node", "")))


def write_endpoint(endpoint: RankEndpoint, root: Path | None = None) -> str:
    """Write the rank's file atomically (0600 in a 0700 folder); returns its path."""
    folder = (root or jobs_root()) / endpoint.job
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"rank{endpoint.rank}.json"
    tmp = folder / f".rank{endpoint.rank}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(_data(endpoint), f)
    os.replace(tmp, path)
    return str(path)


def read_endpoint(path: str | Path) -> RankEndpoint:
    """One discovery file; ValueError (in words) when it is not one."""
    try:
        return _endpoint(json.loads(Path(path).read_text()), str(path))
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a distnb discovery file ({type(exc).__name__}: {exc})") from None


def jobs_json(jobs: list[JobFiles]) -> str:
    """The listing as ``python -m distnb jobs --json`` prints it, for a notebook on another machine
    (read over ssh, by the user who may read the files: the keys travel with it)."""
    import socket

    return json.dumps({"machine": socket.gethostname(), "jobs": [
        {"job": j.job, "folder": j.folder, "ranks": [_data(e) for e in j.ranks.values()], "stale": [_data(e) for e in j.stale.values()]}
        for j in jobs]})


def listed_by(text: str) -> str:
    """The name of the machine that printed ``jobs_json``'s listing ("" when it is not one)."""
    try:
        listing = json.loads(text)
    except ValueError:
        return ""
    return str(listing.get("machine", "")) if isinstance(listing, dict) else ""


def jobs_from_json(text: str, machine: str | None = None) -> list[JobFiles]:
    """``jobs_json``'s listing, read from ``machine`` (default: the name the listing gives): each
    rank's address is the one it bound, or the machine's where it bound every interface. ValueError
    (in words) when it is not one."""
    try:
        listing = json.loads(text)
        machine = machine or str(listing["machine"])
        out = []
        for j in listing["jobs"]:
            ranks, stale = ([_endpoint(d, f"{machine}:{j['folder']}", machine) for d in j[k]] for k in ("ranks", "stale"))
            fix = [e if e.host not in ("0.0.0.0", "*", "") else replace(e, host=machine) for e in ranks]
            out.append(JobFiles(str(j["job"]), f"{machine}:{j['folder']}", {e.rank: e for e in fix}, {e.rank: e for e in stale}))
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"the listing from {machine or 'a node'} is not distnb's ({type(exc).__name__}: {exc}); is distnb there the same "
                         "version?") from None


def list_jobs(root: Path | None = None) -> list[JobFiles]:
    """Every job with at least one discovery file under ``root``, newest first; unreadable files
    are skipped."""
    base = root or jobs_root()
    here = socket.gethostname()
    jobs = []
    try:
        folders = [p for p in base.iterdir() if p.is_dir()]
    except OSError:
        return []
    for folder in folders:
        live: dict[int, RankEndpoint] = {}
        stale: dict[int, RankEndpoint] = {}
        for f in folder.glob("rank*.json"):
            try:
                e = read_endpoint(f)
            except ValueError:
                continue
            if e.node and e.node != here:
                continue  # another machine's, in a shared folder: listed there
            (live if e.alive() else stale)[e.rank] = e
        if live or stale:
            jobs.append((max(e.started for e in (*live.values(), *stale.values())), JobFiles(folder.name, str(folder), live, stale)))
    return [j for _, j in sorted(jobs, key=lambda x: -x[0])]
