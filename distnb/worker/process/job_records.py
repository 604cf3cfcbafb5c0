"""What an attachable rank leaves behind when it dies or hangs, for ``%dist_load`` (issue 40).

Into the job's records folder (``wire/job_dumps.py``) a rank writes its record
(``rank<N>.json``: who it was, how it was started, its Flight Recorder entries and call log, its
main thread's stack, how it ended) and the Flight Recorder's own pickle beside it:

* on an uncaught exception in the main thread: ``sys.excepthook`` is chained (the job's previous
  hook runs after, unchanged, so the user sees the same output), with an ``atexit`` fallback for a
  job that replaced the hook itself (Python keeps the exception in ``sys.last_value``);
* when the main thread has sat in one torch.distributed call (or a recorder entry has stayed
  open while the group's sequence numbers did not move: NCCL returns to the host at enqueue) for
  ``DISTNB_RECORD_AFTER`` seconds, rewritten every :data:`REWRITE_EVERY` while the wait goes on,
  and removed when the rank moves on (it was slow, not stuck);
* on a fatal signal, faulthandler's stacks into ``faulthandler_rank<N>.txt`` — only when the job
  had not enabled faulthandler itself (its own choice of file stands).

It never issues a collective, never signals, and never waits on the job: the watcher is a daemon
thread that looks at the main thread's frames and the groups' sequence numbers (a few µs) every
:data:`POLL` seconds and reads the recorder only when something may be stuck. Any failure of its
own is one line on stderr; the job goes on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from distnb.worker.process.exit_guard import torch_work
from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["POLL", "RECORD_AFTER", "RECORD_AFTER_ENV", "RECORDS_SWITCH", "REWRITE_EVERY", "JobRecorder", "user_site"]

#: How long a rank sits in one collective before its record is written. Measured
#: (benchmarks/bench_record_after.py, results/record_after.json; 2 busy cores, gloo): a healthy
#: DDP loop's ranks sit at most ~36 ms in one collective, and up to ~0.6 s in init_process_group
#: waiting for the others (8 ranks). 2 s sits well above both and far below any collective
#: timeout a job sets; a record written for a longer wait that then ends is removed.
RECORD_AFTER = 2.0
RECORD_AFTER_ENV = "DISTNB_RECORD_AFTER"
#: While the wait goes on, the record is rewritten this often (its "since" stays; the stacks and
#: the recorder's entries are refreshed).
REWRITE_EVERY = 10.0
#: How often the watcher looks (a frame walk and the groups' counters: a few µs).
POLL = 0.25
#: ``DISTNB_RECORDS=0`` leaves the records out (benchmarks compare).
RECORDS_SWITCH = "DISTNB_RECORDS"
#: A wait that ended is forgotten (its record removed) this long after, unless an exception ended it.
_GRACE = 1.0


def user_site(frames: list[tuple[str, int, str, str]]) -> tuple[str, int, str, str] | None:
    """The innermost frame of the user's own code: not in site-packages, the stdlib, distnb or
    Python's frozen modules."""
    for f in reversed(frames):
        name = f[0]
        if (name.startswith("<") or "site-packages/" in name or "dist-packages/" in name or "/lib/python3." in name
                or "/distnb/" in name):
            continue
        return f
    return None


class JobRecorder:
    """The records of one attachable rank; :meth:`install` once, from ``attachable.maybe_start``."""

    def __init__(self, rank: int, world_size: int, folder: Path, calls: Any = None, after: float = RECORD_AFTER) -> None:
        self.rank = rank
        self.world_size = world_size
        self.folder = folder
        # The rank's CallLog (worker/torch_hooks/call_log.py), or a function that makes it on
        # first use: importing it at interpreter start-up would cost every job's start.
        self._calls = calls
        self.after = after
        self.started = time.time()
        # A process the rank forks (a DataLoader worker) inherits the hooks, not the rank's role:
        # it writes no record and leaves the rank's faulthandler file alone.
        self.pid = os.getpid()
        self.path = folder / f"rank{rank}.json"
        self.wait: dict[str, Any] | None = None  # the WaitRecord last written, while the wait goes on
        self.ended = False  # an exception ended the main thread, and was recorded
        self.writes = 0
        self._lock = threading.Lock()
        self._previous_hook: Any = None
        self._fault_file: Any = None
        self._failed = False
        self._clock: Any = None
        self._ids: Any = None
        self._seqs: Any = None

    @property
    def calls(self) -> Any:
        if callable(self._calls) and not hasattr(self._calls, "since"):
            self._calls = self._calls()
        return self._calls

    # -- installing ------------------------------------------------------------------------------
    def install(self) -> None:
        import atexit
        import faulthandler

        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)
        if not faulthandler.is_enabled():  # the job's own faulthandler (PYTHONFAULTHANDLER, -X) stands
            self.folder.mkdir(parents=True, exist_ok=True)
            self._fault_file = open(self.folder / f"faulthandler_rank{self.rank}.txt", "w")
            faulthandler.enable(file=self._fault_file, all_threads=True)
        os.register_at_fork(after_in_child=self._forked)
        threading.Thread(target=self._watch, name="distnb-records", daemon=True).start()

    def _forked(self) -> None:
        if self._fault_file is not None:
            import faulthandler

            faulthandler.disable()  # the child's crash is not the rank's death
            self._fault_file = None

    def _say(self, what: str, exc: BaseException) -> None:
        if not self._failed:  # one line, once: the job comes first
            self._failed = True
            print(f"distnb: rank {self.rank}: could not {what} ({type(exc).__name__}: {exc}); the job goes on.", file=sys.stderr, flush=True)

    # -- an exception ends the main thread -------------------------------------------------------
    def _excepthook(self, etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            if os.getpid() == self.pid:
                self.record_exception(etype, value, tb)
        except Exception as exc:
            self._say("write its record of the error", exc)
        finally:
            (self._previous_hook or sys.__excepthook__)(etype, value, tb)

    def _at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        value = getattr(sys, "last_value", None)
        if value is not None and not self.ended:  # the job replaced sys.excepthook: Python kept the error
            try:
                self.record_exception(type(value), value, value.__traceback__)
            except Exception as exc:
                self._say("write its record of the error", exc)
        if self._fault_file is not None:
            try:
                if self._fault_file.tell() == 0:  # no fatal signal: leave no empty file behind
                    import faulthandler

                    faulthandler.disable()
                    self._fault_file.close()
                    os.unlink(self._fault_file.name)
            except (OSError, ValueError):
                pass

    def record_exception(self, etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        import traceback

        frames = [(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_tb(tb)]
        exception = {"type": etype.__name__, "message": str(value), "frames": frames, "site": user_site(frames),
                     "traceback": "".join(traceback.format_exception(etype, value, tb))}
        stacks = [{"thread": "MainThread", "ident": threading.get_ident(), "main": True, "frames": frames}]
        self.ended = True
        self._write("exception", exception=exception, stacks=stacks)

    # -- the watcher -----------------------------------------------------------------------------
    def _watch(self) -> None:
        key: tuple[Any, ...] | None = None
        same_since = time.time()
        looked = False  # the recorder was read once in this quiet spell
        forget_at: float | None = None
        warm = False
        while not self.ended:
            time.sleep(POLL)
            # It reads torch's recorder (C++): never while the rank exits (exit_guard.py).
            with torch_work() as watching:
                if not watching:
                    return
                try:
                    c10d = imported_module("torch.distributed.distributed_c10d")
                    if c10d is None:
                        continue  # nothing distributed yet (or still importing); never import torch from here
                    if not warm:
                        # What a write needs, imported now, once (an attachable rank's control thread
                        # has most of it already): the first write must not spend the wait importing.
                        warm = _warm_up()
                    now = time.time()
                    outer, names = _c10d_frame()
                    new_key = (id(outer), names, self._seq_snapshot(), self.calls.newest() if self.calls is not None else 0)
                    if new_key != key:
                        key, same_since, looked = new_key, now, False
                        if self.wait is not None and forget_at is None:
                            # Moved on: slow, not stuck — unless an exception ended the wait (gloo's
                            # timeout), whose record keeps it: the hook has a moment to say so.
                            forget_at = now + _GRACE
                    if forget_at is not None and now >= forget_at:
                        forget_at = None
                        self._forget()
                    if now - same_since < self.after:
                        continue
                    if names:
                        what = names
                    elif not looked or (self.wait is not None and now - self.wait["written"] >= REWRITE_EVERY):
                        # Quiet: is a recorder entry open (NCCL returned at enqueue)? Asked once per
                        # quiet spell, and again before each rewrite: it may have completed since.
                        looked = True
                        what = self._open_entry(now)
                        if not what and self.wait is not None and forget_at is None:
                            forget_at = now
                    else:
                        what = self.wait["what"] if self.wait is not None else ""
                    if what and (self.wait is None or now - self.wait["written"] >= REWRITE_EVERY):
                        since = self.wait["since"] if self.wait is not None else same_since
                        self._write("waiting", since=since, what=what)
                except Exception as exc:
                    self._say("watch its collectives", exc)
                    return

    def _seq_snapshot(self) -> Any:
        if self._seqs is None:
            from distnb.worker.torch_hooks.flight_recorder import SeqWatch

            self._seqs = SeqWatch()
        return self._seqs.snapshot()

    def _open_entry(self, now: float) -> str:
        entries = self._read().get("entries", [])
        stuck = [e for e in entries if not e["done"] and now - e["t"] >= self.after]
        if not stuck:
            return ""
        e = min(stuck, key=lambda e: e["id"])
        return f"{e['op']} #{e['seq']} on group {e['group']}"

    def _forget(self) -> None:
        with self._lock:
            if self.ended:
                return
            self.wait = None
            for path in (self.path, self.folder / f"distnb_fr_rank_{self.rank}"):
                try:
                    path.unlink()
                except OSError:
                    pass

    # -- writing ---------------------------------------------------------------------------------
    def _read(self) -> Any:
        from distnb.worker.torch_hooks.flight_recorder import CellClock, RecordIds, read_collectives

        if self._clock is None:
            self._clock, self._ids = CellClock(), RecordIds()
        return read_collectives(-1, self._clock, self.calls, -1, ids=self._ids, groups=True)

    def _write(self, reason: str, exception: dict[str, Any] | None = None, stacks: list[Any] | None = None,
               since: float | None = None, what: str = "") -> None:
        # The main thread (an exception) must not wait long for the watcher's write.
        if not self._lock.acquire(timeout=5.0):
            return
        try:
            self._write_locked(reason, exception, stacks, since, what)
        finally:
            self._lock.release()

    def _write_locked(self, reason: str, exception: dict[str, Any] | None, stacks: list[Any] | None, since: float | None, what: str) -> None:
        import socket

        from distnb.wire.discovery import job_id_from_env
        from distnb.wire.job_dumps import FR_PREFIX, RECORD_FORMAT, write_json_atomic
        from distnb.worker.process.control import ENV_NAMES, ENV_PREFIXES, thread_stacks
        from distnb.worker.recorders.memory_sampler import MemorySampler
        from distnb.worker.torch_hooks.flight_recorder import backends_in_use

        self.folder.mkdir(parents=True, exist_ok=True)
        # A job that never imported torch (it failed before) has nothing to read: importing
        # torch now, at its end, would only make it slower to go.
        torch_up = imported_module("torch") is not None
        collectives = self._read() if torch_up else {"unavailable": "the job had not imported torch"}
        if stacks is None:
            stacks = thread_stacks(False, {threading.get_ident()})
        now = time.time()
        record: dict[str, Any] = {
            "format": RECORD_FORMAT, "job": job_id_from_env(), "rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
            "host": socket.gethostname(), "written": now, "reason": reason, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "started": self.started, "argv": list(sys.argv), "cwd": os.getcwd(), "torch": _torch_version(),
            "backends": sorted(backends_in_use()) if torch_up else [],
            "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES},
            "stacks": stacks, "collectives": collectives,
        }
        try:
            record["memory"] = MemorySampler(record["local_rank"]).stop()
        except Exception:
            pass
        if reason == "waiting":
            self.wait = {"since": since if since is not None else now, "what": what, "stacks": stacks, "collectives": collectives,
                         "written": now}
        if self.wait is not None:
            record["waiting"] = {k: v for k, v in self.wait.items() if k != "written"}
        if exception is not None:
            record["exception"] = exception
        if self._fault_file is not None:
            record["fault_file"] = os.path.basename(self._fault_file.name)
        # With the calls' Python frames only once the main thread has left its collective: torch
        # symbolises them under a lock that a collective in progress holds (measured: a dump
        # with frames waits for the collective to end; one without returns at once).
        fr = self._write_fr(self.folder / f"{FR_PREFIX}{self.rank}", frames=reason != "waiting") if torch_up else ""
        if fr:
            record["fr_file"] = fr
        write_json_atomic(self.path, record)
        self.writes += 1

    @staticmethod
    def _write_fr(path: Path, frames: bool) -> str:
        """The Flight Recorder's own pickle (with the Python frames of each call when ``frames``),
        in the format ``fr_trace`` reads: NCCL's recorder when the rank uses NCCL, else the one
        gloo writes."""
        try:
            from torch._C import _distributed_c10d as c

            from distnb.worker.torch_hooks.flight_recorder import backends_in_use
        except ImportError:
            return ""
        dumper = getattr(c, "_dump_nccl_trace" if "nccl" in backends_in_use() else "_dump_fr_trace", None)
        if dumper is None:
            return ""
        data = _named_default_group(dumper(includeCollectives=True, includeStackTraces=frames, onlyActive=False))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path.name


def _named_default_group(data: bytes) -> bytes:
    """torch's bytes, unless (torch 2.13, gloo) the default group sits in ``pg_config`` under the
    empty name it had before it was named "0": ``fr_trace`` then fails (KeyError ('0', rank)), so
    the dump is pickled again with that group under the name its entries use. The dump comes from
    this process: unpickling it is safe."""
    import pickle

    dump = pickle.loads(data)
    config = dump.get("pg_config") or {}
    used = {str(e["process_group"][0]): str(e["process_group"][1]) for e in dump.get("entries") or [] if e.get("process_group")}
    unnamed = [name for name in used if name not in config]
    if "" not in config or "" in used or len(unnamed) != 1:
        return data
    info = dict(config.pop(""))
    info.update(name=unnamed[0], desc=info.get("desc") or used[unnamed[0]])
    config[unnamed[0]] = info
    return pickle.dumps(dump, protocol=2)


def _c10d_frame() -> tuple[Any, str]:
    """The main thread's outermost frame in ``distributed_c10d.py`` and its function's name
    (``all_reduce``), or ``(None, "")``."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    outer, name = None, ""
    for _ in range(64):
        if frame is None:
            break
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            outer, name = frame, frame.f_code.co_name
        frame = frame.f_back
    return outer, name


def _warm_up() -> bool:
    import distnb.wire.job_dumps  # noqa: F401
    import distnb.worker.process.control  # noqa: F401
    import distnb.worker.recorders.memory_sampler  # noqa: F401
    import distnb.worker.torch_hooks.flight_recorder  # noqa: F401

    return True


def _torch_version() -> str:
    return str(getattr(imported_module("torch"), "__version__", ""))
