"""A torchrun job that was not started with distnb, looked into from outside (``%dist_attach --pid
PID``, or ``%dist_attach`` when it is the one job on this machine): no preparation, nothing in the
job asked or changed.

What can be read from outside is read: each rank's Python stacks through py-spy, twice a window
apart (whether its main thread stood still, and its CPU: blocked or spinning), its state in /proc,
its environment and command line, its memory. The pool's position and verdict rules judge that;
what they cannot have — which collective each rank made, with what shapes, its sequence number,
how long it has waited before the look — no record holds, so every verdict is "likely" and says
from what. ``%dist_reproduce`` writes the notebook from the job's command line and the stacks.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from distnb import _processes
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Place, Position, position_from_stack
from distnb.analysis.verdicts.stacks import RankStack, StackReport
from distnb.analysis.verdicts.verdict import Certainty, Verdict
from distnb.errors import AttachError
from distnb.jobs.looking import AttachStatus, stop_looking
from distnb.jobs.outside_look import Seen, look_from_outside
from distnb.launching.bare_jobs import BareJobFiles, script_argv
from distnb.ranks import Ranks, format_ranks, parse_ranks
from distnb.services.cases.reproduce import Reproduced, job_facts, write_reproduction
from distnb.services.native_stacks import py_spy_dumps

__all__ = ["BareJob", "LOOK_WINDOW"]

#: How far apart the two reads of a look are: long enough that a rank computing has moved on
#: (a training step's Python frames change many times a second), short enough to answer at once.
LOOK_WINDOW = 1.0
#: A main thread busy less than this share of the window was blocked.
_BLOCKED_CPU = 0.2


class BareJob:
    """A torchrun job read from outside; build one with :func:`distnb.attach` (``pid=``)."""

    def __init__(self, files: BareJobFiles, window: float = LOOK_WINDOW) -> None:
        self.files = files
        self.job = files.job
        self.world_size = files.world_size
        self.window = window
        self.attached = True

    def pids(self) -> dict[int, int]:
        return {r: e.pid for r, e in sorted(self.files.ranks.items())}

    def _gone(self, rank: int) -> str:
        if not self.files.here:
            return "it runs on another machine of the job: attach there (its ranks are read from their own machine)"
        return "its process has exited while the others run (torchrun stops every rank when one fails: it likely ended without an error)"

    # -- views ----------------------------------------------------------------------------------
    def _look(self, ranks: list[int]) -> dict[int, Seen]:
        live = {r: e.pid for r, e in self.files.ranks.items() if r in ranks and os.path.exists(f"/proc/{e.pid}")}
        return look_from_outside(live, self.window)

    def stacks(self, ranks: Ranks = None, all_threads: bool = False, native: bool = False) -> StackReport:
        """Where every (or each given) rank is now, read twice with py-spy; ``native`` adds its native frames."""
        targets = parse_ranks(ranks, self.world_size)
        return self._stacks(self._look(targets), targets, all_threads, native)

    def _stacks(self, seen: dict[int, Seen], targets: list[int], all_threads: bool = False, native: bool = False) -> StackReport:
        out = []
        for r in targets:
            s = seen.get(r)
            if s is None:
                out.append(RankStack(r, "gone", self._gone(r)))
                continue
            if not s.threads:
                out.append(RankStack(r, "no stack", f"py-spy gave none: {s.error}"))
                continue
            threads = s.threads if all_threads else [t for t in s.threads if t.main]
            rs = RankStack(r, _state_words(s), "py-spy", threads, cpu=s.cpu)
            out.append(rs)
        if native:
            by_rank = {rs.rank: rs for rs in out if rs.threads}
            for r, text in py_spy_dumps({r: self.files.ranks[r].pid for r in by_rank}).items():
                by_rank[r].native = text
        return StackReport(out)

    def diagnose(self, hang_after: float | None = None) -> Verdict:
        """Is the job hung, and why — likely, from the stacks alone."""
        return self._diagnose(self._look(list(range(self.world_size))), hang_after)

    def _diagnose(self, seen: dict[int, Seen], hang_after: float | None = None) -> Verdict:
        ranks = list(range(self.world_size))
        stacks = self._stacks(seen, ranks)
        positions = [self._position(r, seen.get(r), stacks) for r in ranks]
        started = min((e.started for e in self.files.ranks.values()), default=time.time())
        elapsed = max(0.0, time.time() - started)
        # No record says how long a rank has waited: what was watched (the window) is all that is
        # known, so the rules judge what they see now rather than after a threshold.
        verdict = diagnose(positions, self.window if hang_after is None else hang_after, elapsed)
        verdict.certainty = Certainty.LIKELY
        verdict.reason = (f"from the ranks' stacks alone (py-spy, read twice {self.window:g} s apart): the job was not started with "
                          "distnb, so no record says which call each rank made, with what shapes, or for how long it has waited")
        if verdict.is_problem:
            verdict.details.append(f"  (likely, {verdict.reason}; python -m distnb run -- torchrun … gives the recorded view)")
        return verdict

    def _position(self, r: int, s: Seen | None, stacks: StackReport) -> Position:
        if s is None:
            script = script_argv(next(iter(self.files.ranks.values()))) if self.files.ranks else ()
            if self.files.here:
                return Position(r, Place.FINISHED, detail=self._gone(r), file=script[0] if script else "?")
            return Position(r, Place.UNRESPONSIVE, detail=self._gone(r))
        if not s.threads:
            return Position(r, Place.UNRESPONSIVE, detail=f"py-spy gave no stack: {s.error}")
        pos = position_from_stack(stacks[r])
        if pos.state == Place.COLLECTIVE and not s.still:
            # Caught passing through a call it left and made again between the reads: running.
            pos.state, pos.op = Place.COMPUTING, None
            pos.detail = "its thread ran on between two reads, caught at this line both times"
        elif pos.state == Place.COLLECTIVE:
            pos.since = None  # how long it has waited is not known: at least the window (the status line says so)
        elif s.still and s.cpu is not None and s.cpu < _BLOCKED_CPU:
            pos.detail = ", ".join(w for w in (pos.detail, f"blocked: busy {s.cpu:.0%} of {s.window:.1f} s") if w)
        return pos

    def status(self, with_diagnosis: bool = True) -> AttachStatus:
        """A line per rank (pid, where it is) and, by default, the diagnosis."""
        targets = list(range(self.world_size))
        seen = self._look(targets)
        stacks = self._stacks(seen, targets)
        rows: list[tuple[int, int | None, str]] = []
        for rs in stacks.ranks:
            e = self.files.ranks.get(rs.rank)
            rows.append((rs.rank, e.pid if e else None, rs.state if rs.threads else f"{rs.state}: {rs.source}"))
        notes = [f"not started with distnb: read from outside (py-spy, /proc), each rank twice, {self.window:g} s apart; "
                 "%dist_collectives needs the recorded view (python -m distnb run -- torchrun …)"]
        if len(self.files.ranks) < self.world_size and not self.files.here:
            notes.append(f"{format_ranks(sorted(self.files.ranks))} run here; the others on other machines")
        verdict = self._diagnose(seen).text() if with_diagnosis else ""
        return _BareStatus(self.job, self.world_size, rows, verdict, notes)

    def env(self, ranks: Ranks = None) -> EnvReport:
        """RANK, LOCAL_RANK, MASTER_*, CUDA_VISIBLE_DEVICES, NCCL_*/TORCH_* … per rank, from /proc."""
        from distnb.worker.process.control import ENV_NAMES, ENV_PREFIXES

        targets = [r for r in parse_ranks(ranks, self.world_size) if r in self.files.ranks]
        env = {r: {k: v for k, v in self.files.ranks[r].env.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES} for r in targets}
        return EnvReport(env, {r: socket.gethostname() for r in targets})

    def memory(self, ranks: Ranks = None) -> MemoryReport:
        """Each rank's resident memory now (from /proc; CUDA's allocator can't be read from outside)."""
        out: dict[int, dict[str, Any]] = {}
        for r in parse_ranks(ranks, self.world_size):
            e = self.files.ranks.get(r)
            rss = _processes.memory_of(e.pid) if e is not None else None
            if rss is not None:
                out[r] = {"rss": rss}
        return MemoryReport(out)

    def collectives(self, ranks: Ranks = None, last: int | None = None) -> Any:
        raise AttachError(self._unrecorded("%dist_collectives"))

    def stragglers(self, ranks: Ranks = None, group: str = "0", last: int = 200) -> Any:
        raise AttachError(self._unrecorded("%dist_timeline"))

    def _unrecorded(self, what: str) -> str:
        return (f"{what} reads each rank's record of its collectives, which job {self.job} does not keep: it was not started with "
                "distnb. %dist_stacks and %dist_status show where its ranks are now; start the job with python -m distnb run -- "
                "torchrun … (or TORCH_NCCL_TRACE_BUFFER_SIZE=2000 for NCCL's Flight Recorder, then %dist_load its dumps) to record them.")

    def reproduce(self, path: str | None = None, ranks: int | None = None) -> Reproduced:
        """Write a notebook that stands in for the job (services/cases/reproduce.py), from its command line,
        folder, settings and where the diagnosis puts the failure."""
        if not self.files.ranks:
            raise AttachError(f"job {self.job} has no rank left on this machine to read its command line from.")
        first = self.files.ranks[min(self.files.ranks)]
        seen = self._look(list(range(self.world_size)))
        try:
            facts = job_facts(self.job, self.world_size, script_argv(first), first.cwd, "auto", self.env().env.get(first.rank, {}),
                              self._stacks(seen, list(range(self.world_size))), self._diagnose(seen))
            return write_reproduction(facts, path or f"{self.job}-repro.ipynb", ranks=ranks)
        except ValueError as exc:
            raise AttachError(str(exc)) from None

    def detach(self) -> None:
        """Stop looking into the job (nothing in it was changed)."""
        self.attached = False
        stop_looking(self)

    def __enter__(self) -> BareJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def describe(self) -> str:
        return f"attached to job {self.job} from outside"

    def __repr__(self) -> str:
        return f"<BareJob {self.job}: {self.world_size} ranks, {len(self.files.ranks)} here>"


class _BareStatus(AttachStatus):
    def heading(self) -> str:
        return f"attached to job {self.job} from outside (read-only, not started with distnb): {self.world_size} ranks"


def _state_words(s: Seen) -> str:
    if s.state:
        return s.state
    cpu = f", busy {s.cpu:.0%} of the time" if s.cpu is not None else ""
    return (f"standing still over {s.window:.1f} s{cpu}" if s.still else f"running{cpu}")
