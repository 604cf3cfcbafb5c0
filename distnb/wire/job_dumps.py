"""What an attachable job leaves behind when it dies or hangs (issue 40, ``%dist_load``): the
per-rank record a rank writes (``worker/process/job_records.py``) and ``distnb.load`` reads
(``controller/dump_reader.py``), typed once here, and where the files go.

A job's records folder is ``$DISTNB_RECORDS_DIR``, else ``<jobs_root()>/<job id>/records/``: a
folder of its own, never ``rank*.json`` beside the discovery files (``list_jobs`` globs those). In
it, per rank: ``rank<N>.json`` (:class:`RankRecordFile`), ``distnb_fr_rank_<N>`` (the Flight
Recorder's own pickle, the bytes torch's ``_dump_fr_trace``/``_dump_nccl_trace`` return, so
``python -m torch.distributed.flight_recorder.fr_trace`` reads the folder as it is) and, when the
job had not enabled faulthandler itself, ``faulthandler_rank<N>.txt``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final, Mapping, TypedDict

from distnb.wire.discovery import job_id_from_env, jobs_root
from distnb.wire.record_types import CollectivesRead

__all__ = ["FAULT_PREFIX", "FR_PREFIX", "RECORD_FORMAT", "RECORDS_ENV", "ExceptionRecord", "RankRecordFile", "StackFrame",
           "ThreadRecord", "WaitRecord", "record_name", "records_dir", "write_json_atomic"]

RECORD_FORMAT: Final = "distnb-record-1"
#: Where a job's ranks write their records (default: under the job's discovery folder).
RECORDS_ENV: Final = "DISTNB_RECORDS_DIR"
#: ``<prefix><rank>``, as NCCL's watchdog names its dumps: ``fr_trace`` infers the prefix from it.
FR_PREFIX: Final = "distnb_fr_rank_"
FAULT_PREFIX: Final = "faulthandler_rank"

#: A frame as ``traceback.extract_stack`` gives it: file, line, function, the line's text.
StackFrame = tuple[str, int, str, str]


class ThreadRecord(TypedDict):
    """A thread's Python stack, outermost frame first (the STACKS reply's form)."""

    thread: str
    ident: int
    main: bool
    frames: list[StackFrame]


class ExceptionRecord(TypedDict):
    """The exception that ended the main thread."""

    type: str  # the class's qualified name (``torch.distributed.DistBackendError`` → ``DistBackendError``)
    message: str
    traceback: str  # as Python printed it
    frames: list[StackFrame]  # the traceback's frames, outermost first
    site: StackFrame | None  # the innermost frame of the user's own code (outside site-packages and the stdlib)


class WaitRecord(TypedDict):
    """The rank waiting in a collective: since when (its wall clock), in what, and where."""

    since: float
    what: str  # ``all_reduce`` (its Python call) or ``all_reduce #4 on group 0`` (an open recorder entry)
    stacks: list[ThreadRecord]
    collectives: CollectivesRead


class _RankRecordCore(TypedDict):
    format: str
    job: str
    rank: int
    world_size: int
    pid: int
    host: str
    written: float  # the rank's wall clock when it wrote the file
    reason: str  # "exception" · "waiting"


class RankRecordFile(_RankRecordCore, total=False):
    """One rank's record (``rank<N>.json``)."""

    local_rank: int
    started: float
    argv: list[str]
    cwd: str
    torch: str  # torch.__version__
    backends: list[str]
    env: dict[str, str]
    stacks: list[ThreadRecord]  # the main thread when written
    collectives: CollectivesRead  # the Flight Recorder entries and the call log when written
    memory: dict[str, float]
    exception: ExceptionRecord
    waiting: WaitRecord  # the last wait seen, kept when an exception ends it (gloo's timeout)
    fr_file: str  # the Flight Recorder's own pickle beside it
    fault_file: str  # where faulthandler writes on a fatal signal


def records_dir(env: Mapping[str, str] | None = None) -> Path:
    """The job's records folder: ``$DISTNB_RECORDS_DIR``, else ``<jobs_root()>/<job id>/records``."""
    env = os.environ if env is None else env
    if env.get(RECORDS_ENV):
        return Path(env[RECORDS_ENV])
    root = Path(env["DISTNB_JOBS_DIR"]) if env.get("DISTNB_JOBS_DIR") else jobs_root()  # the environment given, not only ours
    return root / job_id_from_env(dict(env)) / "records"


def record_name(rank: int) -> str:
    return f"rank{rank}.json"


def write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` as JSON through a temporary file: a reader never sees half a record, and a
    rank killed mid-write leaves the previous one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)
