"""``distnb.attach()``: a torchrun job distnb did not launch, made attachable (``python -m distnb
run -- torchrun … train.py``), seen from the notebook — read-only.

:class:`AttachedJob` offers the read-only subset of the Pool's views: ``status``, ``stacks``,
``collectives``, ``memory``, ``env``, ``stragglers`` and ``diagnose``, asked of each rank's control thread (``worker/process/attachable.py``)
through :class:`~distnb.controller.attach_link.AttachLink` and judged by the same parts a pool
uses (the ``CollectiveLog``, ``services.positions``, ``analysis.verdicts``). None of them changes
the job: no cell, interrupt or push. Only ``debug()`` (``%dist_debug``) steps into a rank, when
asked and with a warning: it runs what the user types in that rank and may pause it
(services/job_console.py). ``detach()`` lets a paused rank go, closes the notebook's sockets and
leaves the ranks serving as before.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from distnb import _processes
from distnb.analysis.agreement.collectives import CollectiveReport, issued_words
from distnb.analysis.agreement.entry_words import describe
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.stacks import RankStack, StackReport, ThreadStack, frames_from_wire
from distnb.analysis.verdicts.stragglers import StragglerReport, stragglers_of
from distnb.analysis.verdicts.verdict import Verdict
from distnb.config import LaunchConfig
from distnb.controller.attach_link import AttachLink
from distnb.controller.collective_log import CollectiveLog
from distnb.errors import AttachError
from distnb.jobs.looking import AttachStatus, current_job, look_into, stop_looking
from distnb.launching.bare_jobs import BareJobFiles, bare_job_of, find_bare_jobs, unreadable_note
from distnb.ranks import Ranks, format_ranks, parse_ranks
from distnb.results import CellResult, RankResult
from distnb.services.cases.reproduce import JobFacts, Reproduced, job_facts, write_reproduction
from distnb.services.debugger import Ask, read_line
from distnb.services.inspector import REREAD_AFTER
from distnb.services.job_console import JobConsole, warning
from distnb.services.job_stepper import JobStepper
from distnb.services.native_stacks import py_spy_dumps, py_spy_path
from distnb.services.positions import position_of, unsettled
from distnb.wire.discovery import JobFiles, jobs_root, list_jobs
from distnb.wire.protocol import Msg
from distnb.wire.record_types import CollectivesRead, PeekRead
from distnb.worker.process.peek import EVAL_TIMEOUT

if TYPE_CHECKING:
    from distnb.jobs.bare import BareJob

__all__ = ["AttachedJob", "attach", "current_attached", "detach"]

#: How long each rank has to answer the first request of an attach, and every later one.
JOB_ANSWER_TIMEOUT = 2.0


class AttachedJob:
    """A job attached read-only; build one with :func:`attach`."""

    def __init__(self, files: JobFiles, timeout: float = JOB_ANSWER_TIMEOUT) -> None:
        self.job = files.job
        self.files = files
        self.world_size = files.world_size
        self.timeout = timeout
        self.hang_after = LaunchConfig.hang_after
        self._link: AttachLink | None = AttachLink(files.ranks)
        self._log = CollectiveLog()
        self._attached_at = time.monotonic()
        self._steppers: dict[int, JobStepper] = {}  # debugpy in the ranks the user paused (services/job_stepper.py)

    # -- the job's ranks ------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self._link is not None

    def pids(self) -> dict[int, int]:
        return {r: e.pid for r, e in sorted(self.files.ranks.items())}

    def _require(self) -> AttachLink:
        if self._link is None:
            raise AttachError(f"job {self.job} is detached; attach again with %dist_attach {self.job} (distnb.attach({self.job!r})).")
        return self._link

    def _ask(self, ranks: list[int], msg: dict[str, Any], timeout: float | None = None) -> dict[int, dict[str, Any]]:
        return self._require().ask([r for r in ranks if r in self.files.ranks], msg, self.timeout if timeout is None else timeout)

    def why_silent(self, rank: int) -> str:
        e = self.files.ranks.get(rank) or self.files.stale.get(rank)
        if e is None:
            return "it published no discovery file (not started, or not made attachable)"
        if e.machine:
            return (f"its control thread on {e.machine} (pid {e.pid}, {e.address}) did not answer within {self.timeout:g} s: a firewall "
                    "between the machines, an address this one can't reach (DISTNB_ATTACH_HOST), or a busy rank; ask again")
        if not e.alive():
            return f"its process (pid {e.pid}) is gone"
        state = _processes.process_state(e.pid)
        return (f"its control thread did not answer within {self.timeout:g} s (pid {e.pid}{' is ' + state if state else ' runs'}); "
                "a C loop holding the GIL, or a machine this busy: ask again, or py-spy dump --pid " + str(e.pid))

    # -- views ----------------------------------------------------------------------------------
    def stacks(self, ranks: Ranks = None, all_threads: bool = False, native: bool = False) -> StackReport:
        """Where every (or each given) rank of the job is now, with the collective it waits in;
        ``native`` adds py-spy's native frames (the ranks run on this machine)."""
        targets = parse_ranks(ranks, self.world_size)
        since = {r: self._log.cursor(r) for r in targets}
        msg = {"t": Msg.STACKS, "all_threads": all_threads, "collectives_since": min(since.values(), default=-1),
               "calls_since": min((self._log.last_call(r) for r in targets), default=-1), "groups": self._log.wants_groups(targets)}
        replies = self._ask(targets, msg)
        self._merge({r: m["collectives"] for r, m in replies.items() if "collectives" in m}, since)
        out = []
        for r in targets:
            reply = replies.get(r, {})
            if "stacks" in reply:
                threads = [ThreadStack(t["thread"], t["main"], frames_from_wire(t["frames"]), program=True) for t in reply["stacks"]]
                rs = RankStack(r, "in the job", "control thread", threads)
            else:
                rs = RankStack(r, "no answer", f"no answer: {reply.get('error') or self.why_silent(r)}")
            pending = self._log.pending(r)
            stuck = self._log.stuck(r)
            if pending is not None:
                rs.annotation = f"in {describe(pending)} ({self._log.at(pending)})"
                rs.annotation_since = self._log.age(r, pending)
            elif stuck is not None:
                rs.annotation = f"{describe(stuck)} {self._log.at(stuck)} not completed ({issued_words(stuck)})"
                rs.annotation_since = self._log.age(r, stuck)
            out.append(rs)
        if native:
            by_rank = {rs.rank: rs for rs in out}
            here = {r: e.pid for r, e in self.files.ranks.items() if r in by_rank and not e.machine}
            for r, text in py_spy_dumps(here).items():
                by_rank[r].native = text
            for r in sorted(set(by_rank) - set(here)):
                by_rank[r].native = f"(rank {r} runs on {self.files.ranks[r].machine}: py-spy dump --native --pid {self.files.ranks[r].pid} there)"
        return StackReport(out)

    def collectives(self, ranks: Ranks = None, last: int | None = None) -> CollectiveReport:
        """Every rank's collective sequence (from its Flight Recorder), side by side, the first
        divergence marked."""
        targets = parse_ranks(ranks, self.world_size)
        since = {r: self._log.cursor(r) for r in targets}
        msg = {"t": Msg.COLLECTIVES, "since": min(since.values(), default=-1),
               "calls_since": min((self._log.last_call(r) for r in targets), default=-1), "groups": self._log.wants_groups(targets)}
        self._merge(self._ask(targets, msg), since)
        return self._log.report(targets, last)

    def _merge(self, replies: dict[int, dict[str, Any]], since: dict[int, int]) -> None:
        for r, answer in replies.items():
            reply = cast(CollectivesRead, answer)
            if "error" in answer:
                continue
            reply["entries"] = [e for e in reply.get("entries", []) if e["id"] > since.get(r, -1) or not e["done"]]
            self._log.merge(r, reply)

    def memory(self, ranks: Ranks = None) -> MemoryReport:
        """Each rank's memory now (RSS; CUDA's allocator and the device where the job uses one)."""
        replies = self._ask(parse_ranks(ranks, self.world_size), {"t": Msg.MEMORY})
        return MemoryReport({r: m["memory"] for r, m in sorted(replies.items()) if "memory" in m})

    def env(self, ranks: Ranks = None) -> EnvReport:
        """RANK, LOCAL_RANK, MASTER_*, CUDA_VISIBLE_DEVICES, NCCL_*/TORCH_* … per rank."""
        replies = self._ask(parse_ranks(ranks, self.world_size), {"t": Msg.ENV})
        return EnvReport({r: m["env"] for r, m in sorted(replies.items()) if "env" in m},
                         {r: socket.gethostname() for r in replies})  # the job's ranks run on this machine

    def stragglers(self, ranks: Ranks = None, group: str = "0", last: int = 200) -> StragglerReport:
        """Who arrives last at the recent collectives of ``group`` (``%dist_timeline``)."""
        return stragglers_of(self.collectives(ranks), group, last)

    def diagnose(self, hang_after: float | None = None) -> Verdict:
        """Is the job hung, and why? The pool's rules over the job's stacks and collective logs;
        the job's whole run stands for the cell. A reading that caught a rank between two places
        is read again, as the pool does."""
        return self._diagnose(self.hang_after if hang_after is None else hang_after)

    def _diagnose(self, threshold: float, stacks: StackReport | None = None) -> Verdict:
        verdict = self._judge(threshold, stacks)
        if verdict.is_problem and unsettled(verdict.positions):
            time.sleep(REREAD_AFTER)
            verdict = self._judge(threshold)
        return verdict

    def _judge(self, threshold: float, stacks: StackReport | None = None) -> Verdict:
        ranks = list(range(self.world_size))
        stacks = stacks if stacks is not None else self.stacks(ranks)
        report = self.collectives(ranks)
        # A stand-in for the cell a pool would judge: every rank still "running" the job. Its
        # cell is None, so positions read every open entry whatever cell (none) it came from.
        whole = CellResult(cast(int, None), "", ranks, {r: RankResult(r) for r in ranks})
        started = min((e.started for e in self.files.ranks.values()), default=time.time())
        elapsed = max(0.0, time.time() - started)
        positions = [position_of(r, whole, stacks, elapsed, self._log, self.why_silent) for r in ranks]
        return diagnose(positions, threshold, elapsed, report, None, {}, None)

    def status(self, with_diagnosis: bool = True) -> AttachStatus:
        """A line per rank (pid, where it is) and, by default, the diagnosis."""
        stacks = self.stacks()
        rows = []
        for rs in stacks.ranks:
            e = self.files.ranks.get(rs.rank) or self.files.stale.get(rs.rank)
            where = rs.annotation_text or (rs.state if not rs.threads else "computing")
            rows.append((rs.rank, e.pid if e else None, where if rs.threads else rs.source))
        notes = []
        if self.files.stale:
            notes.append(f"{format_ranks(sorted(self.files.stale))}: the process that wrote the discovery file is gone")
        missing = [r for r in range(self.world_size) if r not in self.files.ranks and r not in self.files.stale]
        if missing:
            notes.append(f"{format_ranks(missing)}: no discovery file")
        verdict = self._diagnose(self.hang_after, stacks).text() if with_diagnosis else ""
        return AttachStatus(self.job, self.world_size, rows, verdict, notes)

    # -- stepping in (only when asked) ---------------------------------------------------------
    def peek(self, rank: int, what: str = "frames", frame: int | None = None, expr: str | None = None,
             want: tuple[str, str] | None = None) -> PeekRead:
        """A look into rank ``rank``'s main thread as it stands, not stopping it (worker/process/peek.py):
        its frames, or ``expr`` run in frame ``frame`` (``what``: eval · pretty · exec · args ·
        locals · source · function; ``want``: that frame's (file, function) as last read, so a rank
        that ran on is looked at where that function is now, or says it returned). It runs code in
        the job: ``debug`` is the console over it."""
        msg: dict[str, Any] = {"t": Msg.PEEK, "what": what, "consent": True}
        msg.update({k: v for k, v in (("frame", frame), ("expr", expr), ("want", list(want) if want else None)) if v is not None})
        reply = self._ask([rank], msg, max(self.timeout, EVAL_TIMEOUT + self.timeout)).get(rank)
        if reply is None:
            raise AttachError(f"rank {rank} gave no answer: {self.why_silent(rank)}.")
        if "frames" not in reply:  # refused (a job started with DISTNB_ATTACH_DEBUG=0), or an older distnb
            raise AttachError(f"rank {rank} gave no look: {reply.get('error', 'no frames in its answer')}.")
        return cast(PeekRead, {k: reply[k] for k in PeekRead.__annotations__ if k in reply})

    def debug(self, rank: int | None = None, commands: Sequence[str] | None = None, ask: Ask = read_line,
              say: Callable[[str], None] = print) -> None:
        """pdb's words on rank ``rank`` of the live job (default: the rank the diagnosis blames,
        else 0) at the frame it stands in, said with a warning first (services/job_console.py):
        looks that do not stop it, and ``pause``, ``n``, ``s``, ``c`` through debugpy. ``commands``
        are run in order (then the console ends); without them each line comes from ``ask``
        (``input()``: Jupyter's input box). ``q``, the end, or an interrupt leaves the rank running."""
        if rank is None:
            culprits = self.diagnose().culprits
            rank = culprits[0] if culprits else 0
        if not 0 <= rank < self.world_size:
            raise AttachError(f"job {self.job} has ranks 0-{self.world_size - 1}, not {rank}; %dist_debug RANK names one of them.")
        link = self._require()
        stacks = self.stacks([rank]).ranks[0]
        console = JobConsole(rank, self.world_size, self.peek, lambda: self._steppers.setdefault(rank, JobStepper(link, rank)))
        say(warning(rank, self.job, self.pids().get(rank), stacks.annotation_text or ""))
        try:
            say(console.open())
            lines = iter(commands) if commands is not None else None
            while not console.done:
                if lines is not None:
                    line = next(lines, "q")
                    say(f"(rank {rank}) {line}")
                else:
                    line = _read(ask, f"(rank {rank}) ", say)
                said = console.run(line)
                if said:
                    say(said)
        finally:
            left = console.leave()  # an interrupt, an error: the rank is not left paused
            if left:
                say(left)

    # -- to a notebook --------------------------------------------------------------------------
    def facts(self) -> JobFacts:
        """What a notebook needs to stand in for the job (``reproduce``): its command line and folder
        (from the discovery files), its settings (rank 0's NCCL/torch variables), and where the
        diagnosis puts the failure (services/cases/reproduce.py's ``job_facts``)."""
        first = self.files.ranks[min(self.files.ranks)] if self.files.ranks else None
        if first is None or not first.argv:
            raise AttachError(f"job {self.job}'s discovery files carry no command line (written by an older distnb); "
                              "start the job again with this distnb's python -m distnb run.")
        stacks = self.stacks()
        env = self.env().env
        try:
            return job_facts(self.job, self.world_size, first.argv, first.cwd, "auto", env.get(min(env), {}) if env else {}, stacks,
                             self._diagnose(self.hang_after, stacks))
        except ValueError as exc:
            raise AttachError(str(exc)) from None

    def reproduce(self, path: str | None = None, ranks: int | None = None) -> Reproduced:
        """Write a notebook that stands in for the job: a pool of its world size (or ``ranks``, fewer)
        running its script cut into cells, the call where it hangs alone in the last one
        (services/cases/reproduce.py)."""
        try:
            return write_reproduction(self.facts(), path or f"{self.job}-repro.ipynb", ranks=ranks)
        except ValueError as exc:
            raise AttachError(str(exc)) from None

    # -- the end --------------------------------------------------------------------------------
    def detach(self) -> None:
        """Close the notebook's connections; the job runs on as it was (a rank paused from here goes on)."""
        for stepper in self._steppers.values():
            stepper.resume()
        self._steppers.clear()
        if self._link is not None:
            self._link.close()
            self._link = None
        stop_looking(self)

    def __enter__(self) -> AttachedJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"<AttachedJob {self.job}: {self.world_size} ranks, {'attached' if self.attached else 'detached'}>"

    def describe(self) -> str:
        return f"attached to job {self.job}"


def attach(job: str | None = None, timeout: float = JOB_ANSWER_TIMEOUT, hosts: Sequence[str] | str | None = None,
           slurm: bool = False, pid: int | None = None) -> AttachedJob | BareJob:
    """Attach to a job: ``job`` names it (as ``python -m distnb run`` printed it, or
    ``torchrun-PID``); ``pid`` finds it by its torchrun agent's or any rank's process; without
    either, the one job there is. An attachable job (started with ``python -m distnb run``) is
    asked by its ranks' control threads; any other torchrun job on this machine is read from
    outside (:class:`~distnb.jobs.bare.BareJob`: py-spy and /proc, verdicts "likely"). Its ranks
    on this machine, and on ``hosts`` (read over ssh) or every node of the current Slurm
    allocation (``slurm``), which need the job started with ``DISTNB_ATTACH_HOST`` set to an
    address this machine reaches. Raises :class:`~distnb.errors.AttachError` with what to do when
    there is none, several, or its ranks are gone or silent."""
    jobs, unread = _listings(hosts, slurm)
    if pid is not None:
        hooked = [j for j in jobs if any(e.pid == pid for e in j.ranks.values())]
        if hooked:
            job = hooked[0].job
        else:
            return _bare(bare_job_of(pid), f"pid {pid}: {unreadable_note(pid)}")
    if job is not None and job.startswith("torchrun-") and not any(j.job == job for j in jobs):
        agent = job.removeprefix("torchrun-")
        return _bare(bare_job_of(int(agent)) if agent.isdigit() else None, f"no torchrun job {job!r} on this machine now: it has ended, or its name is not "
                     "torchrun-<its agent's pid>; %dist_attach with no argument finds the job there is")
    if job is None and not any(j.ranks for j in jobs):
        bare = find_bare_jobs()
        if len(bare) == 1:
            return _bare(bare[0], "")
        if len(bare) > 1:
            raise AttachError("several torchrun jobs on this machine, none started with distnb; name one by its agent's pid: "
                              + "; ".join(b.line() for b in bare))
    if job is not None:
        named = [j for j in jobs if j.job == job]
        if not named:
            known = ", ".join(j.job for j in jobs) or "none"
            raise AttachError(f"no attachable job {job!r} under {jobs_root()}{' or on the machines asked' if hosts or slurm else ''} "
                              f"(jobs there: {known}); start it with python -m distnb run -- torchrun …, or name one of those"
                              + "".join(f"; {m}: {why}" for m, why in unread.items()) + ".")
        files = named[0]
    else:
        live = [j for j in jobs if j.ranks]
        if not live:
            stale = f" ({len(jobs)} with stale files only: {', '.join(j.job for j in jobs)}, their processes gone)" if jobs else ""
            where = "on this machine" + (" or the machines asked" if hosts or slurm else "")
            raise AttachError(f"no attachable job {where}{stale}, nor any other torchrun job here: start one with python -m distnb "
                              "run -- torchrun --nproc-per-node N train.py (or set DISTNB_ATTACH=1 with the hook on the ranks' PYTHONPATH); "
                              "a job started otherwise is found by its processes (%dist_attach --pid PID when ps shows it)"
                              + "".join(f"; {m}: {why}" for m, why in unread.items()) + ".")
        if len(live) > 1:
            raise AttachError("several attachable jobs on this machine; name one, e.g. %dist_attach "
                              f"{live[0].job}: " + "; ".join(j.line() for j in live))
        files = live[0]
    if not files.ranks:
        gone = ", ".join(f"rank {r} pid {e.pid}" for r, e in sorted(files.stale.items()))
        raise AttachError(f"job {files.job} has ended: the processes of its discovery files are gone ({gone}); "
                          f"remove {files.folder} and start the job again.")
    attached = AttachedJob(files, timeout)
    answered = attached._ask(sorted(files.ranks), {"t": Msg.STACKS, "all_threads": False}, timeout)
    if not answered:
        attached.detach()
        raise AttachError(f"no rank of job {files.job} answered within {timeout:g} s (pids "
                          f"{', '.join(str(e.pid) for e in files.ranks.values())}): their control threads are not serving; "
                          "was the job started with python -m distnb run (or DISTNB_ATTACH=1)?")
    look_into(attached)
    return attached


def _bare(files: BareJobFiles | None, why_not: str) -> BareJob:
    """A job not started with distnb, looked into from outside; ``why_not`` when there is none."""
    if files is None:
        raise AttachError(f"{why_not}.")
    if not files.ranks:
        raise AttachError(f"job {files.job} has no rank on this machine that this user can read.")
    if py_spy_path() is None:
        raise AttachError(f"job {files.job} was not started with distnb, so it is read from outside, with py-spy: pip install py-spy "
                          "(or distnb[native]) beside this Python, then attach again.")
    from distnb.jobs.bare import BareJob

    found = BareJob(files)
    look_into(found)
    return found


def _read(ask: Ask, prompt: str, say: Callable[[str], None]) -> str:
    """The console's next line; "q" when there is none to be had (end of input, a front-end without input)."""
    try:
        return ask(prompt)
    except EOFError:
        return "q"
    except NotImplementedError:  # IPython's StdinNotImplementedError: nbconvert, a kernel run without stdin
        say("[distnb] this front-end gives no input line: %dist_debug RANK -c CMD [-c CMD …] runs commands instead.")
        return "q"


def _listings(hosts: Sequence[str] | str | None, slurm: bool) -> tuple[list[JobFiles], dict[str, str]]:
    """This machine's jobs and the other machines', one per id; and why a machine gave none."""
    from distnb.launching.remote_jobs import jobs_in_allocation, jobs_on, merge_jobs

    names = [h for h in (hosts.split(",") if isinstance(hosts, str) else hosts or []) if h]
    found, unread = jobs_on(names) if names else ([], {})
    if slurm:
        more, why = jobs_in_allocation()
        found, unread = found + more, {**unread, **why}
    return merge_jobs(list_jobs() + found), unread


def current_attached() -> AttachedJob | None:
    """The job the notebook is attached to, if any."""
    job = current_job()
    return job if isinstance(job, AttachedJob) else None


def detach() -> bool:
    """Detach from (or leave) the current job; False when there was none."""
    job = current_job()
    if job is None:
        return False
    job.detach()
    return True
