"""``distnb.load(DIR)``: a job that already died or hung, read from the files it left (issue 40).

:func:`load` reads one or several folders (``controller/dump_reader.py``): distnb's per-rank
records (an attachable job, ``python -m distnb run``), PyTorch's Flight Recorder dumps and
torchrun's error files. :class:`LoadedJob` offers the read-only views an attached job has —
``status``, ``stacks``, ``collectives``, ``memory``, ``env``, ``stragglers`` and ``diagnose`` —
judged by the same parts (the ``CollectiveLog``, ``services.positions``, ``analysis.verdicts``),
with each rank's log frozen at the moment its record was written. What the files prove less is
said: ranks with no record are named, a verdict read from dumps alone is "likely", and why.
:attr:`LoadedJob.launch` gives ``%dist_reproduce`` the job's command line, folder, world size,
backend, environment and the failing call site.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from distnb.analysis.agreement.collectives import CollectiveReport, issued_words
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.agreement.sequence_numbers import dump_marks, seq_blame
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.failures import cut_message
from distnb.analysis.verdicts.position import Place, Position
from distnb.analysis.verdicts.records import is_consequence
from distnb.analysis.verdicts.stacks import RankStack, StackReport, ThreadStack, frames_from_wire, parse_faulthandler, short_path
from distnb.analysis.verdicts.stragglers import StragglerReport, stragglers_of
from distnb.analysis.verdicts.verdict import Certainty, Kind, Verdict
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.dump_reader import JobDumps, RankDump, callstack_frames, read_job_dumps
from distnb.errors import LoadError
from distnb.jobs.looking import AttachStatus, look_into, stop_looking
from distnb.ranks import Ranks, format_ranks, parse_ranks
from distnb.results import CellResult, RankResult
from distnb.services.cases.reproduce import Reproduced, job_facts, write_reproduction
from distnb.services.positions import position_of
from distnb.wire.job_dumps import StackFrame, ThreadRecord
from distnb.wire.record_types import CollectiveEntry, CollectivesRead

__all__ = ["LOOKED_FOR", "JobLaunch", "LoadStatus", "LoadedJob", "load"]

LOOKED_FOR = ("distnb's records (rank<N>.json, from python -m distnb run), Flight Recorder dumps (<prefix><rank>, pickle or JSON, "
              "as NCCL's watchdog or torch's _dump_fr_trace write them) and torchrun's error files (<attempt>/<local rank>/error.json)")


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


@dataclass(frozen=True)
class JobLaunch:
    """How the job was started and where it failed: what ``%dist_reproduce`` needs."""

    argv: tuple[str, ...]  # the rank's sys.argv: the script and its arguments
    cwd: str
    world_size: int
    backend: str  # "gloo", "nccl", "nccl+gloo", or "" when no record says
    env: dict[str, str]  # the launch variables and NCCL_*/TORCH_*/… of one rank (rank 0's when it left a record)
    site: tuple[str, int] | None  # (file, line) of the failing call in the user's script, when known


@dataclass(repr=False)  # the text is its repr, as AttachStatus's
class LoadStatus(AttachStatus):
    """What ``%dist_status`` shows for a loaded job: a line per rank (how it ended), the notes and the diagnosis."""

    folders: list[str] = field(default_factory=list)

    def heading(self) -> str:
        return f"loaded job {self.job} from {', '.join(self.folders)} (read-only): {self.world_size} ranks"


class _FrozenLog(CollectiveLog):
    """The log of a job that is over: a rank's entries are aged against the moment its record
    (or dump) was written, not against now."""

    def __init__(self) -> None:
        super().__init__()
        self.now_of: dict[int, float] = {}

    def age(self, rank: int, entry: CollectiveEntry) -> float:
        now = self.now_of.get(rank)
        return super().age(rank, entry) if now is None else max(0.0, now - float(entry["t"]))


class Found(str, Enum):
    """What a dead job's files tell of a rank."""

    WAITING = "waiting"  # in a collective when its record was last written, or until an error that only reports the wait's end
    RAISED = "raised"
    DEAD = "dead"  # a fatal signal
    DUMP = "dump"  # a Flight Recorder dump alone
    NONE = "none"

    def __str__(self) -> str:
        return self.value


@dataclass
class _Seen:
    """A rank's last known place, as its files tell (:class:`Found`), with what they hold of it."""

    state: Found
    now: float | None = None
    stacks: list[ThreadRecord] = field(default_factory=list)
    collectives: CollectivesRead | None = None
    detail: str = ""
    site: StackFrame | None = None
    ended: str = ""  # the error that ended a wait (gloo's timeout, a peer gone)
    source: str = ""  # the file that says so


def _seen(rd: RankDump) -> _Seen:
    rec = rd.record
    fr = None if rd.fr is None else cast(CollectivesRead, {"entries": rd.fr.entries, "now": rd.fr.mtime, "groups": rd.fr.groups,
                                                              "descs": rd.fr.descs})
    if rec is not None:
        exc, wait = rec.get("exception"), rec.get("waiting")
        written = float(rec["written"])
        if exc is not None:
            # gloo's messages start with the C++ source they come from: not the user's business.
            detail = f"{exc['type']}: {cut_message(_SOURCE_PREFIX.sub('', exc['message']), 200)}"
            raw = exc.get("site")
            site = (str(raw[0]), int(raw[1]), str(raw[2]), str(raw[3])) if raw else None
            if wait is not None and is_consequence(detail):
                return _Seen(Found.WAITING, written, wait["stacks"], wait["collectives"], site=site, ended=detail,
                             source="its record")
            return _Seen(Found.RAISED, written, rec.get("stacks", []), rec.get("collectives", fr), detail, site,
                         source="its record")
        stacks = wait["stacks"] if wait else rec.get("stacks", [])
        return _Seen(Found.WAITING, written, stacks, wait["collectives"] if wait else rec.get("collectives", fr), source="its record")
    if rd.error is not None:
        frames = callstack_frames(rd.error.callstack)
        return _Seen(Found.RAISED, rd.error.timestamp, [{"thread": "MainThread", "ident": 0, "main": True, "frames": frames}], fr,
                     cut_message(rd.error.message, 200), rd.error.site, source="torchrun's error file")
    if rd.fault:
        first = next((line for line in rd.fault.splitlines() if line.strip()), "")
        return _Seen(Found.DEAD, rd.fr.mtime if rd.fr else None, [], fr, f"a fatal signal ({first.strip()})", source="faulthandler")
    if rd.fr is not None:
        return _Seen(Found.DUMP, rd.fr.mtime, [], fr, source="its Flight Recorder dump")
    return _Seen(Found.NONE)


class LoadedJob:
    """A job read from the files it left; build one with :func:`load`."""

    def __init__(self, dumps: JobDumps, hang_after: float = 0.0) -> None:
        self.dumps = dumps
        self.folders = dumps.folders
        # A job that is over waits for nothing more: every wait it left is final.
        self.hang_after = hang_after
        self.seen = {r: _seen(rd) for r, rd in sorted(dumps.ranks.items())}
        records = [rd.record for rd in dumps.ranks.values() if rd.record is not None]
        self.job = str(records[0]["job"]) if records else os.path.basename(os.path.normpath(self.folders[0]))
        sizes = [int(rec["world_size"]) for rec in records]
        sizes += [max(g, default=-1) + 1 for rd in dumps.ranks.values() if rd.fr for g in rd.fr.groups.values()]
        self.world_size = max([*sizes, max(dumps.ranks, default=-1) + 1])
        self._log = _FrozenLog()
        for r, seen in self.seen.items():
            if seen.collectives is not None:
                self._log.merge(r, seen.collectives)
                self._log.now_of[r] = seen.now if seen.now is not None else float(seen.collectives.get("now", 0))

    # -- what is known ---------------------------------------------------------------------------
    @property
    def missing(self) -> list[int]:
        """Ranks that left nothing readable."""
        return [r for r in range(self.world_size) if self.seen.get(r, _Seen(Found.NONE)).state is Found.NONE]

    @property
    def launch(self) -> JobLaunch:
        """The job's command line, folder, world size, backend, environment and failing call site."""
        recs = {r: rd.record for r, rd in sorted(self.dumps.ranks.items()) if rd.record is not None}
        first = recs[min(recs)] if recs else None
        backends = sorted({b for rec in recs.values() for b in rec.get("backends", [])})
        if not backends:
            backends = sorted({"nccl" if rd.fr.entries and rd.fr.entries[0]["rec"] == "nccl" else "gloo"
                               for rd in self.dumps.ranks.values() if rd.fr is not None and rd.fr.entries})
        return JobLaunch(tuple(first.get("argv", [])) if first else (), str(first.get("cwd", "")) if first else "", self.world_size,
                         "+".join(backends), dict(first.get("env", {})) if first else {}, self._site())

    def reproduce(self, path: str | None = None, ranks: int | None = None) -> Reproduced:
        """Write a notebook that stands in for the job: a pool of its world size (or ``ranks``, fewer)
        running its script cut into cells, the call where it failed alone in the last one
        (services/cases/reproduce.py)."""
        launch = self.launch
        if not launch.argv:
            raise LoadError(f"job {self.job} left no record with its command line (only dumps or error files): run it under "
                            "python -m distnb run to have its ranks write one, or write the notebook by hand.")
        try:
            facts = job_facts(self.job, self.world_size, launch.argv, launch.cwd, launch.backend, launch.env, self.stacks(), self.diagnose())
            return write_reproduction(facts, path or f"{self.job}-repro.ipynb", ranks=ranks)
        except ValueError as exc:
            raise LoadError(str(exc)) from None

    def _site(self) -> tuple[str, int] | None:
        verdict = self.diagnose()
        by_rank = {p.rank: p for p in verdict.positions}
        for r in verdict.culprits or sorted(by_rank):
            p = by_rank.get(r)
            if p is not None and p.file and p.line:
                return p.file, p.line
        return None

    # -- views -----------------------------------------------------------------------------------
    def stacks(self, ranks: Ranks = None, all_threads: bool = False, native: bool = False) -> StackReport:
        """Each rank's last stack: where it waited, raised or died (``all_threads`` and ``native``
        are accepted for the magics' sake: a record holds the main thread's Python frames only)."""
        out = []
        for r in parse_ranks(ranks, self.world_size):
            seen = self.seen.get(r, _Seen(Found.NONE))
            rd = self.dumps.ranks.get(r)
            if seen.state is Found.DEAD and rd is not None:
                threads = parse_faulthandler(rd.fault)
                for t in threads[:1]:
                    t.main = True
                out.append(RankStack(r, f"died: {seen.detail}", "faulthandler", threads[:1]))
                continue
            threads = [ThreadStack(t["thread"], t["main"], frames_from_wire(cast(Any, t["frames"])), program=True) for t in seen.stacks]
            if seen.state is Found.WAITING:
                rs = RankStack(r, "waiting", seen.source, threads)
                pending, stuck = self._log.pending(r), self._log.stuck(r)
                entry = pending or stuck
                if entry is not None:
                    rs.annotation = (f"in {describe(entry)} ({self._log.at(entry)})" if pending is not None else
                                     f"{describe(entry)} {self._log.at(entry)} not completed ({issued_words(entry)})")
                    rs.annotation_since = self._log.age(r, entry)
                if seen.ended:
                    rs.state = f"waiting, until {seen.ended}"
            elif seen.state is Found.RAISED:
                rs = RankStack(r, f"raised {seen.detail}", seen.source, threads)
            elif seen.state is Found.DUMP:
                rs = RankStack(r, "no stack", "only its Flight Recorder dump: %dist_collectives shows its calls")
            else:
                rs = RankStack(r, "no record", "it left no record (killed before writing one, or not made attachable)")
            out.append(rs)
        return StackReport(out)

    def collectives(self, ranks: Ranks = None, last: int | None = None) -> CollectiveReport:
        """Every rank's collective sequence as its files hold it, side by side, the first
        divergence marked (by default the ranks whose files hold a log: a rank that left none
        has not "never entered" anything)."""
        targets = parse_ranks(ranks, self.world_size)
        if ranks is None:
            targets = [r for r in targets if r in self._log.entries or r in self._log.calls] or targets
        return self._log.report(targets, last)

    def memory(self, ranks: Ranks = None) -> MemoryReport:
        """Each rank's memory when its record was written (ranks whose record holds it)."""
        targets = parse_ranks(ranks, self.world_size)
        return MemoryReport({r: dict(rd.record["memory"]) for r, rd in sorted(self.dumps.ranks.items())
                             if r in targets and rd.record is not None and "memory" in rd.record})

    def env(self, ranks: Ranks = None) -> EnvReport:
        """RANK, LOCAL_RANK, MASTER_*, NCCL_*/TORCH_* … per rank, as recorded."""
        targets = parse_ranks(ranks, self.world_size)
        recs = {r: rd.record for r, rd in sorted(self.dumps.ranks.items()) if r in targets and rd.record is not None}
        return EnvReport({r: dict(rec.get("env", {})) for r, rec in recs.items()}, {r: str(rec.get("host")) for r, rec in recs.items()})

    def stragglers(self, ranks: Ranks = None, group: str = "0", last: int = 200) -> StragglerReport:
        """Who arrived last at the recorded collectives of ``group`` (``%dist_timeline``)."""
        return stragglers_of(self.collectives(ranks), group, last)

    # -- the diagnosis ---------------------------------------------------------------------------
    def positions(self) -> list[Position]:
        """Where each rank that left something was last (ranks that left nothing are absent)."""
        stacks = self.stacks()
        ranks = [r for r in range(self.world_size) if self.seen.get(r, _Seen(Found.NONE)).state is not Found.NONE]
        whole = CellResult(cast(int, None), "", ranks, {r: RankResult(r) for r in ranks})
        out = []
        for r in ranks:
            seen = self.seen[r]
            site = seen.site
            where: dict[str, Any] = {"line": site[1], "func": site[2], "code": site[3], "file": site[0]} if site else {}
            if seen.state is Found.WAITING:
                out.append(position_of(r, whole, stacks, self._elapsed(), self._log, lambda _: "it left no stack"))
            elif seen.state is Found.RAISED:
                out.append(Position(r, Place.FAILED, detail=seen.detail, **where))
            elif seen.state is Found.DEAD:
                out.append(Position(r, Place.DEAD, detail=seen.detail))
            else:
                out.append(self._from_dump(r))
        return out

    def _from_dump(self, r: int) -> Position:
        """A rank known by its Flight Recorder dump alone: in its oldest collective not completed,
        else (NCCL's abort completes them all) at its last one."""
        entries = sorted(self._log.entries.get(r, {}).values(), key=lambda e: e["id"])
        open_ = [e for e in entries if not e["done"]]
        e = open_[0] if open_ else entries[-1] if entries else None
        if e is None:
            return Position(r, Place.UNRESPONSIVE, detail="its Flight Recorder dump holds no collective")
        return Position(r, Place.COLLECTIVE, op=e["op"], seq=e["seq"], group=e["group"], shapes=describe(e, with_op=False),
                        sizes=e.get("sizes"), dtypes=e.get("dtypes"), since=self._log.age(r, e) if open_ else None,
                        line=e.get("line"), func=e.get("func", ""), file=e.get("file", ""), label=self._log.group(e["group"]).label())

    def _elapsed(self) -> float:
        recs = [rd.record for rd in self.dumps.ranks.values() if rd.record is not None]
        return max((float(rec["written"]) - float(rec.get("started", rec["written"])) for rec in recs), default=0.0)

    def diagnose(self, hang_after: float | None = None) -> Verdict:
        """Why the job hung or died: the pool's rules over the ranks' last places and logs, with
        what the files could not tell said."""
        positions = self.positions()
        if not positions:
            raise LoadError(f"no rank of job {self.job} left anything to judge in {', '.join(self.folders)}.")
        dead = [p.rank for p in positions if p.state == Place.DEAD]
        dumps_only = [r for r, s in self.seen.items() if s.state is Found.DUMP]
        verdict = diagnose(positions, self.hang_after if hang_after is None else hang_after, self._elapsed(), self.collectives(),
                           dead[0] if dead else None, dumps_only=frozenset(dumps_only))
        why: list[str] = []
        if self.missing:
            verdict.details.append(f"  {format_ranks(self.missing)} left no record (killed before writing one — torchrun ends the "
                                   "others when one rank fails — or not started with python -m distnb run)")
            why.append(f"{format_ranks(self.missing)} left no record")
        ended: dict[str, list[int]] = {}
        for r, seen in self.seen.items():
            if seen.ended:
                ended.setdefault(seen.ended.split(":", 1)[0], []).append(r)
        for what, ranks in ended.items():
            verdict.details.append(f"  then {format_ranks(ranks)} raised {what} (the wait's end: a timeout, or a peer gone), and the job ended")
        if dumps_only:
            why.append(f"{format_ranks(dumps_only)} known by Flight Recorder dumps alone (no stacks)")
            marks = {r: dump_marks(_raw_marks(self._log.entries.get(r, {}))) for r in dumps_only}
            blames = seq_blame(marks, self._log.groups or None)
            for blame in blames:
                verdict.details.append(f"  by sequence numbers: {blame.text()}")
        sites = sorted({short_path(p.file) + f":{p.line}" for p in positions if p.rank in verdict.culprits and p.file and p.line})
        if sites:
            verdict.details.append(f"  call site: {', '.join(sites)}")
        # A rank's own error or death stands whoever else left no record; where the verdict
        # weighs the ranks' places against each other, the ranks not seen make it likely only.
        if why and verdict.is_problem and verdict.kind not in (Kind.RAISED, Kind.DIED):
            verdict.certainty = Certainty.LIKELY
            verdict.reason = "; ".join(filter(None, [verdict.reason, *why]))
            verdict.details.append(f"  likely, not certain: {'; '.join(why)}")
        # Even a rank's own error names the rank only as far as its file does.
        guessed = sorted(set(verdict.culprits) & self.dumps.guessed)
        if guessed and verdict.is_problem:
            local = (f"{format_ranks(guessed)} {'is' if len(guessed) == 1 else 'are'} a local rank read from torchrun's error files of "
                     "several machines, not known to be the job's rank")
            verdict.certainty = Certainty.LIKELY
            verdict.reason = "; ".join(filter(None, [verdict.reason, local]))
            verdict.details.append(f"  likely, not certain: {local}")
        return verdict

    def status(self, with_diagnosis: bool = True) -> LoadStatus:
        """A line per rank (pid, how it ended), the reader's notes and, by default, the diagnosis."""
        rows = []
        for rs in self.stacks().ranks:
            rd = self.dumps.ranks.get(rs.rank)
            pid = int(rd.record["pid"]) if rd is not None and rd.record is not None else None
            rows.append((rs.rank, pid, rs.state + (f" — {rs.annotation_text}" if rs.annotation else "")))
        verdict = self.diagnose().text() if with_diagnosis and any(s.state is not Found.NONE for s in self.seen.values()) else ""
        return LoadStatus(self.job, self.world_size, rows, verdict, list(self.dumps.notes), folders=list(self.folders))

    # -- leaving ---------------------------------------------------------------------------------
    def describe(self) -> str:
        return f"looking into the records of job {self.job} (loaded)"

    def detach(self) -> None:
        """Stop looking into the job (nothing to close: the files stay as they are)."""
        stop_looking(self)

    def __repr__(self) -> str:
        return f"<LoadedJob {self.job}: {self.world_size} ranks, from {', '.join(self.folders)}>"


def _raw_marks(entries: dict[int, CollectiveEntry]) -> list[dict[str, Any]]:
    """The log's entries in the recorder's own field names, for :func:`dump_marks`."""
    return [{"process_group": (e["group"], ""), "collective_seq_id": e["seq"], "profiling_name": e["op"], "is_p2p": e.get("p2p")}
            for _, e in sorted(entries.items())]


def load(paths: str | os.PathLike[str] | list[str] | tuple[str, ...], hang_after: float = 0.0) -> LoadedJob:
    """Read the files a job left in ``paths`` (a folder, or several: one per machine) and look
    into it: the magics' read-only views then show it. Raises :class:`~distnb.errors.LoadError`
    (one line, what to do) when a folder does not exist or nothing in them can be read."""
    folders = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    if not folders:
        raise LoadError("give the folder the job's records are in, e.g. distnb.load('/tmp/distnb-jobs/<job>/records').")
    try:
        dumps = read_job_dumps(folders)
    except FileNotFoundError as exc:
        raise LoadError(f"{exc} does not exist: give the folder the job's records are in (python -m distnb run prints it at "
                        "the job's end; NCCL writes its dumps where TORCH_FR_DUMP_TEMP_FILE points, /tmp/nccl_trace_rank_* by default).") from None
    if not dumps.ranks:
        skipped = f" ({len(dumps.notes)} file{'s' * (len(dumps.notes) != 1)} skipped: {dumps.notes[0]}{' …' if len(dumps.notes) > 1 else ''})" \
            if dumps.notes else ""
        raise LoadError(f"nothing readable in {', '.join(folders)}{skipped}: looked for {LOOKED_FOR}. Point at the folder that holds them.")
    job = LoadedJob(dumps, hang_after)
    look_into(job)
    return job
