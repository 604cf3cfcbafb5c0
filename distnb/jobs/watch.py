"""``python -m distnb run --watch``: the job watched by itself, no notebook needed (issue 48).

The wrapper that started the job asks its ranks' control threads, once a second, what a notebook's
``%dist_attach`` would ask (the same :class:`~distnb.jobs.attached.AttachedJob`, the same rules),
and acts on a verdict only when it can never come right by waiting:

* its kind is one the records prove — ranks that made different calls at the same place of a
  group's sequence, a call only some made, a loop run a different number of times, a send with
  no receive, a rank that died or raised while others wait. A slow collective, a rank still
  computing (a long checkpoint save, a compile, a data load), a straggler, a rank that does not
  answer: none of these is acted on, whatever their duration;
* it held at two reads in a row (the same kind, culprits and sites), so a reading that caught a
  rank between two calls is not one. A reading in which a rank did not answer says nothing either
  way and does not part two such reads; any other reading does.

The ranks' waits must pass the threshold (``--hang-after``, the pool's 3 s by default): the rules
judge nothing before it. Then, once: the verdict in the job's log (stderr) in the cell report's
words; with ``dump`` or ``stop``, the verdict (``verdict.json``: its fields; ``verdict.txt``), the
stacks, the collectives and a reproduce notebook in the job's records folder; with ``stop``,
SIGTERM to the job's command (torchrun ends its ranks), before torch's own watchdog would.

A look that fails (a rank ending, a reply that does not come, a bug in distnb) is one look: the
watch says the first such error in the job's log and goes on; it stops only after
``GIVE_UP_AFTER`` looks in a row failed. Each change of a reading that finds a problem (and the
first healthy reading after one) goes to ``watch.log`` in the records folder (time, state, kind,
culprits, headline), so that why a watch did or did not act can be read afterwards without a
word in the job's log while it is healthy.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState
from distnb.config import LaunchConfig
from distnb.errors import AttachError
from distnb.jobs.attached import AttachedJob
from distnb.wire.discovery import list_jobs
from distnb.wire.job_dumps import records_dir

__all__ = ["GIVE_UP_AFTER", "INCONCLUSIVE", "ON_HANG", "PROVEN", "JobWatch", "start_watch", "verdict_record"]

#: What the watch does once it has a verdict.
ON_HANG = ("report", "dump", "stop")
#: The kinds of verdict no wait can make right: the only ones acted on.
PROVEN = frozenset({Kind.CALL_MISSING, Kind.CALL_EXTRA, Kind.LOOP_COUNT, Kind.MISMATCH, Kind.WRONG_GROUP, Kind.P2P_UNMATCHED,
                    Kind.CROSS_CELL, Kind.GROUP_CREATION, Kind.RAISED, Kind.DIED})
#: Readings that say nothing either way (a rank's control thread did not answer in time, a busy
#: machine's usual hiccup): between two readings of the same proven verdict, they do not part them.
INCONCLUSIVE = frozenset({Kind.UNRESPONSIVE, Kind.UNKNOWN})
#: How often the ranks are asked.
ASK_EVERY = 1.0
#: Looks in a row that fail before the watch stops (a minute at one a second).
GIVE_UP_AFTER = 60
#: The most lines ``watch.log`` gets.
LOG_LINES = 10_000
_PREFIX = "[distnb watch]"


def _say(text: str) -> None:
    for line in text.splitlines():
        print(f"{_PREFIX} {line}", file=sys.stderr, flush=True)


def _signature(verdict: Verdict) -> tuple[Any, ...]:
    return (verdict.kind, tuple(verdict.culprits), tuple((s.line, s.func, s.code) for s in verdict.sites))


def acts_on(verdict: Verdict) -> bool:
    """Whether ``verdict`` is one the watch acts on: a hang (or a failure others wait behind) of a
    proven kind."""
    return verdict.state in (VerdictState.HANG, VerdictState.FAILED) and verdict.kind in PROVEN


class JobWatch:
    """The watch over job ``job_id`` started by ``proc``, in a thread of the wrapper."""

    def __init__(self, proc: subprocess.Popen[Any], env: dict[str, str], on_hang: str = "report",
                 hang_after: float = LaunchConfig.hang_after, poll: float = ASK_EVERY) -> None:
        if on_hang not in ON_HANG:
            raise ValueError(f"--on-hang takes one of {', '.join(ON_HANG)}, not {on_hang!r}")
        self.proc, self.env, self.on_hang, self.hang_after, self.poll = proc, env, on_hang, hang_after, poll
        self.job_id = env["DISTNB_JOB_ID"]
        self.verdict: Verdict | None = None  # the one acted on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distnb-watch", daemon=True)
        self._started = time.monotonic()
        self._seen: tuple[Any, ...] | None = None  # the last problem written to watch.log (None: healthy since)
        self._logged = 0

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _job(self) -> AttachedJob | None:
        files = next((j for j in list_jobs() if j.job == self.job_id), None)
        if files is None or len(files.ranks) < files.world_size:
            return None  # not every rank has published yet
        return AttachedJob(files)

    def _run(self) -> None:
        job: AttachedJob | None = None
        last: tuple[Any, ...] | None = None
        failed = 0
        try:
            while not self._stop.wait(self.poll) and self.proc.poll() is None:
                job = job or self._job()
                if job is None:
                    continue
                try:
                    verdict = job.diagnose(self.hang_after)
                except Exception as exc:  # noqa: BLE001 - one failed look, not the end of the watch
                    job.detach()
                    job, last = None, None  # a rank ending, or restarted by torchrun: find its ranks again
                    failed += 1
                    self._failed(exc, failed)
                    if failed >= GIVE_UP_AFTER:
                        _say(f"stopped watching: {failed} looks in a row failed, the last with {type(exc).__name__}: {exc}")
                        return
                    continue
                failed = 0
                self._note(verdict)
                if verdict.kind in INCONCLUSIVE:
                    continue  # says nothing either way: the reading before it still stands
                if not acts_on(verdict):
                    last = None
                    continue
                if _signature(verdict) != last:
                    last = _signature(verdict)
                    continue
                self.verdict = verdict
                self._act(job, verdict)
                return
        except Exception as exc:  # noqa: BLE001 - the watch must never take the job down with it
            _say(f"stopped watching: {type(exc).__name__}: {exc}")
        finally:
            if job is not None:
                job.detach()

    def _failed(self, exc: BaseException, count: int) -> None:
        """A look that failed: in ``watch.log`` each time; in the job's log the first time only
        (a rank ending makes a few, and an attach error is expected then)."""
        self._log(f"look failed ({count} in a row): {type(exc).__name__}: {exc}")
        if count == 1 and not isinstance(exc, (AttachError, OSError)):
            _say(f"a look at the job failed ({type(exc).__name__}: {exc}); still watching")

    def _note(self, verdict: Verdict) -> None:
        """A reading unlike the last one, into ``watch.log``: a problem, or the first healthy
        reading after one (a healthy job's readings, which change with every step, are not kept)."""
        seen = (verdict.state, _signature(verdict))
        if seen != self._seen and (verdict.is_problem or self._seen is not None):
            self._seen = seen if verdict.is_problem else None
            self._log(f"{verdict.state.value} {verdict.kind.value} culprits={list(verdict.culprits)}"
                      f"{' (proven: acted on if the next look reads the same)' if acts_on(verdict) else ''}: {verdict.summary}")

    def _log(self, line: str) -> None:
        self._logged += 1
        if self._logged > LOG_LINES:
            return  # a job whose readings keep changing for days: the first lines tell the story
        if self._logged == LOG_LINES:
            line = f"(the last line kept: {LOG_LINES} lines)"
        try:
            folder = records_dir(self.env)
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / "watch.log").open("a") as f:
                f.write(f"{time.monotonic() - self._started:8.1f} s  {line}\n")
        except OSError:
            pass  # a record of the watch, not the watch: it goes on without it

    def _act(self, job: AttachedJob, verdict: Verdict) -> None:
        took = time.monotonic() - self._started
        _say(f"job {self.job_id}: {verdict.state.value} found {took:.0f} s into the job (--on-hang {self.on_hang})")
        _say(verdict.text())
        if self.on_hang in ("dump", "stop"):
            _say(_dump(job, verdict, self.env))
        if self.on_hang == "stop":
            _say(f"stopping the job: SIGTERM to {Path(str(self.proc.args[0] if isinstance(self.proc.args, list) else self.proc.args)).name} "
                 f"(pid {self.proc.pid}), which ends its ranks")
            self.proc.send_signal(signal.SIGTERM)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def verdict_record(verdict: Verdict) -> dict[str, Any]:
    """``verdict.json``'s content: the verdict's fields (its root cause as data), its headline and its text."""
    return {**_jsonable(verdict), "summary": verdict.summary, "text": verdict.text()}


def _dump(job: AttachedJob, verdict: Verdict, env: dict[str, str]) -> str:
    """The verdict, stacks, collectives and a reproduce notebook into the job's records folder; what was written, in words."""
    folder = records_dir(env)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    (folder / "verdict.json").write_text(json.dumps(verdict_record(verdict), indent=1))
    (folder / "verdict.txt").write_text(verdict.text() + "\n")
    written += ["verdict.json", "verdict.txt"]
    for name, make in (("stacks.txt", lambda: job.stacks().text()), ("collectives.txt", lambda: job.collectives().text())):
        try:
            (folder / name).write_text(make() + "\n")
            written.append(name)
        except (AttachError, OSError) as exc:
            written.append(f"not {name} ({exc})")
    try:
        written.append(Path(job.reproduce(str(folder / f"{job.job}-repro.ipynb")).path).name)
    except (AttachError, OSError, ValueError) as exc:
        written.append(f"no notebook ({exc})")
    return f"wrote {', '.join(written)} in {folder}"


def start_watch(on_hang: str, hang_after: float) -> Callable[[subprocess.Popen[Any], dict[str, str]], Callable[[], None]]:
    """For ``attach_run.run``'s ``watcher``: starts a :class:`JobWatch` on the job it started and
    returns how to stop it."""

    def begin(proc: subprocess.Popen[Any], env: dict[str, str]) -> Callable[[], None]:
        watch = JobWatch(proc, env, on_hang, hang_after).start()
        _say(f"watching job {env['DISTNB_JOB_ID']}: a hang the records prove is {'stopped' if on_hang == 'stop' else 'reported'} "
             f"once every rank has waited {hang_after:g} s (--on-hang {on_hang})")
        return watch.stop

    return begin
