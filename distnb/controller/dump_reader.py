"""The files a finished (or hung) job leaves, read for ``distnb.load`` (issue 40): distnb's own
per-rank records (``wire/job_dumps.py``), PyTorch's Flight Recorder dumps (the pickle that NCCL's
watchdog writes on a timeout as ``<prefix><rank>``, or ``_dump_fr_trace`` returns; and their JSON
variant) and torchrun's per-rank error files (``<log_dir>/<run_id>/attempt_N/<local_rank>/error.json``,
written by ``torch.distributed.elastic.multiprocessing.errors.record``).

Folders are walked recursively (one per machine, or a whole log folder). What cannot be read is
skipped and named in :attr:`JobDumps.notes`, one line each; where two files speak for one rank
the newest wins, and the note says so. Pickles are loaded with an unpickler that refuses every
class (the Flight Recorder's dumps hold only dicts, lists, strings and numbers), so a file that
is not a dump cannot run code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from distnb.ranks import format_ranks
from distnb.wire.job_dumps import FAULT_PREFIX, RECORD_FORMAT, RankRecordFile
from distnb.wire.record_types import CollectiveEntry

__all__ = ["FR_FIELDS", "FrDump", "JobDumps", "RankDump", "TorchrunError", "callstack_frames", "fr_dump_from", "read_job_dumps"]

#: The fields of a Flight Recorder entry distnb reads (torch 2.13's dump, version "2.10"); a dump
#: from another torch may lack some: what can be read is, and the note names the rest.
FR_FIELDS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes", "input_dtypes",
             "state", "time_created_ns", "is_p2p")
_RANK_SUFFIX = re.compile(r"^(?P<prefix>[\w\-.]*?)(?P<rank>\d+)(\.(json|pkl|pickle))?$")
_CALLSTACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names a class ({module}.{name}), which no Flight Recorder dump does")


@dataclass
class FrDump:
    """One rank's Flight Recorder dump, its entries as distnb's log keeps them."""

    path: str
    rank: int
    version: str
    entries: list[CollectiveEntry]
    groups: dict[str, list[int]]
    descs: dict[str, str]
    mtime: float
    missing_fields: list[str] = field(default_factory=list)

    def call_site(self) -> tuple[str, int, str] | None:
        """``(file, line, function)`` of the oldest collective not completed (else the newest one)."""
        open_ = [e for e in self.entries if not e.get("done")]
        pick = min(open_, key=lambda e: e["id"]) if open_ else (self.entries[-1] if self.entries else None)
        if pick is None or not pick.get("file"):
            return None
        return pick["file"], int(pick.get("line") or 0), str(pick.get("func", ""))


@dataclass
class TorchrunError:
    """A rank's error file as torchrun's ``@record`` wrote it."""

    path: str
    local_rank: int
    message: str  # ``ValueError: bad batch``
    callstack: str
    timestamp: float
    site: tuple[str, int, str, str] | None  # the innermost frame of the user's code in the callstack


@dataclass
class RankDump:
    """Everything read for one rank."""

    rank: int
    record: RankRecordFile | None = None
    record_path: str = ""
    fr: FrDump | None = None
    error: TorchrunError | None = None
    fault: str = ""  # faulthandler's text (a fatal signal)
    fault_path: str = ""


@dataclass
class JobDumps:
    """What the folders held, by rank, and a line per file skipped or overruled."""

    folders: list[str]
    ranks: dict[int, RankDump] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: int = 0  # files looked at
    #: Ranks placed by a torchrun error file's local rank while error files of several machines
    #: were read and no record said which global rank each was: likely, not known.
    guessed: set[int] = field(default_factory=set)

    def rank(self, r: int) -> RankDump:
        return self.ranks.setdefault(r, RankDump(r))


def read_job_dumps(folders: list[str]) -> JobDumps:
    """Read every folder (recursively); raise nothing for a bad file (it is noted), but
    :class:`FileNotFoundError` for a folder that does not exist."""
    out = JobDumps([str(f) for f in folders])
    errors: list[TorchrunError] = []
    for folder in folders:
        base = Path(folder)
        if not base.exists():
            raise FileNotFoundError(str(base))
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if path.name.startswith("."):  # a record being written (its .tmp), or hidden
                continue
            out.files += 1
            _read_one(path, out, errors)
    _place_errors(errors, out)
    return out


def _read_one(path: Path, out: JobDumps, errors: list[TorchrunError]) -> None:
    name = path.name
    try:
        if name == "error.json":
            err = _torchrun_error(path)
            if err is None:
                out.notes.append(f"skipped {path}: an error.json that is not torchrun's (no message in it)")
            else:
                errors.append(err)
            return
        if name.startswith(FAULT_PREFIX) and name.endswith(".txt"):
            text = path.read_text(errors="replace")
            if text.strip() and name[len(FAULT_PREFIX):-4].isdigit():
                rd = out.rank(int(name[len(FAULT_PREFIX):-4]))
                rd.fault, rd.fault_path = text, str(path)
            return
        data = path.read_bytes()
        if name.startswith("rank") and name.endswith(".json"):
            if _record(path, data, out):
                return
        dump = fr_dump_from(data, str(path), path.stat().st_mtime)
        if dump is None:
            out.notes.append(f"skipped {path}: not a distnb record, Flight Recorder dump or torchrun error file")
            return
        if dump.missing_fields:
            out.notes.append(f"{path}: a Flight Recorder dump of version {dump.version} (this torch writes 2.10) without "
                             f"{', '.join(dump.missing_fields)}: read what it has")
        rd = out.rank(dump.rank)
        if rd.fr is not None:
            older, newer = sorted((rd.fr, dump), key=lambda d: d.mtime)
            out.notes.append(f"two Flight Recorder dumps for rank {dump.rank}: {newer.path} (newest) read, {older.path} left out")
            dump = newer
        rd.fr = dump
    except ValueError as exc:
        out.notes.append(f"skipped {path}: {exc}")
    except OSError as exc:
        out.notes.append(f"skipped {path}: {exc.strerror or exc}")


def _record(path: Path, data: bytes, out: JobDumps) -> bool:
    """A distnb record (True), a discovery file (True: noted), or neither (False: look further)."""
    try:
        rec = json.loads(data)
    except ValueError:
        return False
    if not isinstance(rec, dict):
        return False
    if rec.get("format") == "distnb-attach-1":
        out.notes.append(f"skipped {path}: a discovery file of a running job (%dist_attach {rec.get('job', '')} attaches to it)")
        return True
    if rec.get("format") != RECORD_FORMAT:
        return False
    if not isinstance(rec.get("rank"), int):
        raise ValueError("a distnb record without its rank")
    rd = out.rank(rec["rank"])
    if rd.record is not None:
        old = rd.record
        keep, drop = (rec, rd.record_path) if float(rec.get("written", 0)) >= float(old.get("written", 0)) else (old, str(path))
        out.notes.append(f"two distnb records for rank {rec['rank']}: the newest read, {drop} left out")
        if keep is old:
            return True
    rd.record, rd.record_path = cast(RankRecordFile, rec), str(path)
    return True


def fr_dump_from(data: bytes, path: str, mtime: float = 0.0) -> FrDump | None:
    """A Flight Recorder dump (pickle or JSON) read from ``data``; the rank from the file name's
    digits (``nccl_trace_rank_3``). None when it is not a dump; ValueError when it is one whose
    rank the name does not give."""
    raw: Any = None
    if data[:1] == b"\x80":
        try:
            raw = _NoClasses(io.BytesIO(data)).load()
        except Exception as exc:
            if isinstance(exc, pickle.UnpicklingError) and "names a class" in str(exc):
                raise ValueError(f"a pickle that is not a Flight Recorder dump ({exc})") from None
            return None
    elif data[:1] == b"{":
        try:
            raw = json.loads(data)
        except ValueError:
            return None
    if not isinstance(raw, dict) or "version" not in raw or not ("entries" in raw or "pg_config" in raw):
        return None
    m = _RANK_SUFFIX.match(os.path.basename(path))
    if m is None:
        raise ValueError("a Flight Recorder dump whose name does not end in its rank (as NCCL names them: nccl_trace_rank_<N>); "
                         "rename it so")
    entries, missing = _entries(raw.get("entries") or [])
    groups, descs = _groups(raw.get("pg_config") or {}, entries)
    return FrDump(path, int(m.group("rank")), str(raw.get("version")), entries, groups, descs, mtime, missing)


def _completed(e: dict[str, Any]) -> bool:
    """As the rank reads its own recorder: NCCL moves ``state`` to completed; gloo only retires."""
    if str(e.get("profiling_name", "")).startswith("nccl:"):
        return e.get("state") == "completed"
    return bool(e.get("retired")) or e.get("state") == "completed"


def _entries(raw: list[Any]) -> tuple[list[CollectiveEntry], list[str]]:
    missing: set[str] = set()
    rows = [e for e in raw if isinstance(e, dict)]
    rows.sort(key=lambda e: (int(e.get("time_created_ns") or 0), int(e.get("record_id") or 0)))
    out: list[CollectiveEntry] = []
    for i, e in enumerate(rows):
        missing.update(f for f in FR_FIELDS if f not in e)
        p2p = bool(e.get("is_p2p"))
        pg = e.get("process_group") or ("?", "")
        entry: CollectiveEntry = {
            "id": i, "rec": "nccl" if str(e.get("profiling_name", "")).startswith("nccl:") else "fr",
            "group": str(pg[0]), "desc": str(pg[1]) if len(pg) > 1 else "",
            "seq": int(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0), "p2p": p2p,
            "op": str(e.get("profiling_name", "?")).split(":")[-1], "sizes": [list(s) for s in e.get("input_sizes") or []],
            "dtypes": [str(d) for d in e.get("input_dtypes") or []], "t": int(e.get("time_created_ns") or 0) / 1e9,
            "done": _completed(e), "state": str(e.get("state", "")), "started": _seconds(e.get("time_discovered_started_ns")),
            "ended": _seconds(e.get("time_discovered_completed_ns")), "queued": False, "cell": None,
        }
        site = _frame_site(e.get("frames") or [])
        if site is not None:
            entry["file"], entry["line"], entry["func"] = site
        out.append(entry)
    return out, sorted(missing)


def _seconds(ns: Any) -> float | None:
    return int(ns) / 1e9 if ns else None


def _frame_site(frames: list[Any]) -> tuple[str, int, str] | None:
    """The user's own frame among a recorder entry's Python frames (innermost first)."""
    for f in frames:
        if not isinstance(f, dict):
            continue
        name = str(f.get("filename", ""))
        if name and not _library(name):
            return name, int(f.get("line") or 0), str(f.get("name", ""))
    return None


def _groups(config: dict[str, Any], entries: list[CollectiveEntry]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Group name → global ranks, and → description, from the dump's ``pg_config``. The default
    group may be registered under an empty name before it is named ("0"): then it is "0"."""
    groups: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    used = {e["group"] for e in entries}
    for name, info in config.items():
        if not isinstance(info, dict):
            continue
        try:
            ranks = [int(r) for r in json.loads(str(info.get("ranks", "[]")))]
        except (ValueError, TypeError):
            continue
        key = str(name)
        if key == "" and "" not in used and "0" not in config:
            key = "0"
        groups[key] = ranks
        if info.get("desc"):
            descs[key] = str(info["desc"])
    return groups, descs


def _torchrun_error(path: Path) -> TorchrunError | None:
    data = json.loads(path.read_text())
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, str):
        message, callstack, stamp = msg, "", 0.0
    elif isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        message, callstack = str(msg.get("message", "")), str(extra.get("py_callstack", ""))
        stamp = float(extra.get("timestamp") or 0)
    else:
        return None
    local = int(path.parent.name) if path.parent.name.isdigit() else -1
    own = [f for f in callstack_frames(callstack) if not _library(f[0])]
    return TorchrunError(str(path), local, message, callstack, stamp or path.stat().st_mtime, own[-1] if own else None)


def callstack_frames(text: str) -> list[tuple[str, int, str, str]]:
    """The frames of a Python traceback as printed (``File "x", line 3, in f`` and the code line
    under it), outermost first."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _CALLSTACK_FRAME.match(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _CALLSTACK_FRAME.match(lines[i + 1]) else ""
            out.append((m.group("file"), int(m.group("line")), m.group("func").strip(), code))
    return out


def _library(name: str) -> bool:
    return name.startswith("<") or "site-packages/" in name or "dist-packages/" in name or "/lib/python3." in name or "/distnb/" in name


def _place_errors(errors: list[TorchrunError], out: JobDumps) -> None:
    """torchrun names an error file by the rank's local rank: on one machine that is its rank; a
    distnb record of that local rank (same machine) says which global rank it was."""
    by_local: dict[int, list[int]] = {}
    for r, rd in out.ranks.items():
        if rd.record is not None and "local_rank" in rd.record:
            by_local.setdefault(int(rd.record["local_rank"]), []).append(r)
    # One local rank under several run folders (<run>/attempt_N/<local rank>/error.json; a
    # restart's attempts share theirs): the error files of several machines, where torchrun names
    # only the local rank, so a local rank no record places is not known to be the global rank.
    runs: dict[int, set[Path]] = {}
    for err in errors:
        runs.setdefault(err.local_rank, set()).add(Path(err.path).parents[2] if len(Path(err.path).parents) > 2 else Path(err.path))
    machines = any(len(found) > 1 for found in runs.values())
    for err in sorted(errors, key=lambda e: e.timestamp):
        if err.local_rank < 0:
            out.notes.append(f"skipped {err.path}: its folder does not name a local rank (torchrun writes <attempt>/<local rank>/error.json)")
            continue
        known = by_local.get(err.local_rank, [])
        rank = known[0] if len(known) == 1 else err.local_rank
        if len(known) > 1:
            out.notes.append(f"{err.path}: local rank {err.local_rank} is ranks {format_ranks(known)} on different machines; taken as rank {rank}")
        if machines and len(known) != 1:
            out.guessed.add(rank)
            out.notes.append(f"{err.path}: taken as rank {rank}, its local rank — error files of several machines name only local ranks "
                             "and no distnb record says which global rank it was (python -m distnb run writes such records)")
        rd = out.rank(rank)
        if rd.error is not None:
            out.notes.append(f"two torchrun error files for rank {rank}: {err.path} (newest) read, {rd.error.path} left out")
        rd.error = err
